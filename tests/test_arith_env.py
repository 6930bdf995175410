"""The instruct-style arithmetic task: prompts, the exact checker, and the environment contract."""

from __future__ import annotations

import re

import pytest

from actors.chat import ChatFormat
from actors.envs import ENV_NAMES, Environment, make_env
from actors.envs.arith import arith_reward, is_bare_integer, last_integer
from actors.episode import Episode
from common.model import load_tokenizer

PROMPT = re.compile(r"^What is (\d+) ([+\-*]) (\d+)\? Answer with the number only\.$")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("68", 68),
        ("The answer is 68.", 68),
        ("23 + 45 = 68", 68),
        ("9-2=7", 7),
        ("It is -3", -3),
        ("1,234", 1234),
        ("1,23", 23),
        ("no digits here", None),
    ],
)
def test_last_integer(text, expected):
    assert last_integer(text) == expected


@pytest.mark.parametrize(
    ("action", "reward"),
    [
        ("68", 1.0),
        (" 68.\n", 1.0),
        ("1,068", 0.0),
        ("The answer is 68.", 0.5),
        ("23 + 45 = 68", 0.5),
        ("68 is the answer, not 67", 0.0),
        ("67", 0.0),
        ("", 0.0),
        ("6 8", 0.0),
    ],
)
def test_reward_credits_the_right_number_and_the_asked_format(action, reward):
    assert arith_reward(action, 68) == reward


def test_bare_integer_is_only_a_number():
    assert is_bare_integer("-12") and is_bare_integer("12.") and is_bare_integer("9,801")
    assert (
        not is_bare_integer("12 apples") and not is_bare_integer("") and not is_bare_integer("1.5")
    )


def test_registered_and_follows_the_protocol():
    assert "arith" in ENV_NAMES
    env = make_env("arith", max_operand=9, operations="+-*", max_new_tokens=8)
    assert isinstance(env, Environment) and env.name == "arith"
    assert env.max_new_tokens == 8 and env.stop == ["\n"]


@pytest.mark.parametrize("operations", ["+", "-", "*", "+-*"])
def test_prompts_are_deterministic_in_range_and_answered_exactly(operations):
    env = make_env("arith", max_operand=30, operations=operations)
    seen_ops = set()
    for seed in range(200):
        prompt = env.reset(seed)
        assert env.reset(seed) == prompt
        a, op, b = PROMPT.match(prompt).groups()
        a, b = int(a), int(b)
        assert 0 <= a <= 30 and 0 <= b <= 30 and op in operations
        seen_ops.add(op)
        target = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert target >= 0
        result = env.step(str(target))
        assert result.terminated and not result.truncated and result.observation == ""
        assert result.reward == 1.0 and result.info["success"] and result.info["target"] == target
    assert seen_ops == set(operations)


def test_seeds_give_varied_questions():
    env = make_env("arith")
    assert len({env.reset(seed) for seed in range(100)}) > 50


def test_wrong_and_wordy_answers_are_scored_in_info():
    env = make_env("arith")
    env.reset(0)
    target = PROMPT.match(env.compact()).groups()
    total = int(target[0]) + int(target[2])
    wordy = env.step(f"The sum is {total}.")
    assert wordy.reward == 0.5 and wordy.info["correct"] and not wordy.info["success"]
    env.reset(0)
    wrong = env.step(str(total + 1))
    assert wrong.reward == 0.0 and not wrong.info["correct"]


def test_misuse_and_bad_arguments_raise_clear_errors():
    env = make_env("arith")
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("1")
    env.reset(1)
    env.step("1")
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("1")
    with pytest.raises(ValueError, match="operations must be a non-empty string of"):
        make_env("arith", operations="/")
    with pytest.raises(ValueError, match="max_operand must be >= 1"):
        make_env("arith", max_operand=0)
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        make_env("arith", max_new_tokens=2.5)


def test_episode_puts_the_reward_on_the_last_action_token(tiny_model):
    """Through the chat template, as an actor plays it: one terminated segment."""
    from actors.engines import Generation

    tokenizer = load_tokenizer(tiny_model)
    env = make_env("arith")
    episode = Episode(
        env,
        ChatFormat(tokenizer),
        seed=3,
        permit="p",
        actor_id="a",
        group_id=None,
        max_turns=1,
        context_budget=512,
    )
    a, _, b = PROMPT.match(env.compact()).groups()
    answer = tokenizer.encode(str(int(a) + int(b)), add_special_tokens=False)
    (segment,) = episode.step(
        Generation(answer, [-0.5] * len(answer), [0] * len(answer), "stop", 1.0, 1.0)
    )
    assert segment.terminated and not segment.truncated
    assert segment.rewards.tolist() == [0.0] * (segment.num_tokens - 1) + [1.0]
    assert segment.action_mask.tolist()[-len(answer) :] == [1] * len(answer)
    assert sum(segment.action_mask) == len(answer)
