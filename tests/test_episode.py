"""Episodes -> segments, token by token, on known transcripts (masks around tool output, rewards,
versions, compaction boundaries). Real tokenizer and chat template; scripted actions."""

from __future__ import annotations

import numpy as np
import pytest

from actors.chat import ChatFormat
from actors.engines import Generation
from actors.envs import make_env
from actors.envs.maze import make_layout, next_move
from actors.episode import Episode
from common.model import load_tokenizer


@pytest.fixture(scope="module")
def fmt(tiny_model):
    return ChatFormat(load_tokenizer(tiny_model))


def action(fmt: ChatFormat, text: str, version: int = 0, *, ended: bool = True) -> Generation:
    ids = fmt.tok(text, add_special_tokens=False)["input_ids"] + (
        [fmt.stop_token_ids[0]] if ended else []
    )
    return Generation(
        ids, [-0.5] * len(ids), [version] * len(ids), "stop" if ended else "length", 1.0, 1.0
    )


def solve(
    env, episode: Episode, fmt: ChatFormat, max_steps: int = 200, version_of=lambda i: 0
) -> list:
    """Drive the maze with its optimal policy; returns the segments emitted along the way."""
    out = []
    for i in range(max_steps):
        target = env._layout.key if not env._has_key else env._layout.door
        out += episode.step(action(fmt, next_move(env._position, target), version_of(i)))
        if episode.done:
            return out
    raise AssertionError("episode did not finish")


def test_known_transcript_masks_rewards_and_versions(fmt):
    env = make_env("maze")
    ep = Episode(
        env,
        fmt,
        seed=3,
        permit="p",
        actor_id="a",
        group_id=None,
        max_turns=50,
        context_budget=10**6,
    )
    prompt = list(ep.context)
    first = action(fmt, "L", version=7)
    assert ep.step(first) == [] and not ep.done
    # Token by token: prompt (mask 0) | first action (mask 1, its log-probs, version 7) | observation (mask 0)
    segs = solve(env, ep, fmt, version_of=lambda i: 8)
    assert len(segs) == 1
    seg = segs[0]
    n_prompt, n_act = len(prompt), len(first.token_ids)
    assert list(seg.tokens[:n_prompt]) == prompt and not seg.action_mask[:n_prompt].any()
    assert list(seg.tokens[n_prompt : n_prompt + n_act]) == first.token_ids
    assert seg.action_mask[n_prompt : n_prompt + n_act].all()
    assert np.allclose(seg.behavior_logprobs[n_prompt : n_prompt + n_act], -0.5)
    assert (seg.versions[n_prompt : n_prompt + n_act] == 7).all()
    # the tokens right after the first action are observation tokens, not actions
    assert seg.action_mask[n_prompt + n_act] == 0
    # a version per action token: the first turn was sampled by 7, the rest by 8
    assert set(seg.versions[seg.action_mask.astype(bool)].tolist()) == {7, 8}
    assert (seg.versions[~seg.action_mask.astype(bool)] == -1).all()
    assert (seg.behavior_logprobs[~seg.action_mask.astype(bool)] == 0).all()
    # sparse reward: exactly one nonzero reward, 1.0, on the very last (action) token
    assert (
        seg.rewards.sum() == 1.0 and seg.rewards[-1] == 1.0 and np.count_nonzero(seg.rewards) == 1
    )
    assert seg.terminated and not seg.truncated and seg.last
    # the number of action spans is the number of turns
    starts = np.flatnonzero(np.diff(np.concatenate([[0], seg.action_mask])) == 1)
    assert len(starts) == seg.metrics["turns"] == ep.turns


def test_engine_ids_are_kept_not_retokenized(fmt):
    """Token in, token out: an unusual split of the action text survives exactly."""
    env = make_env("digits")
    ep = Episode(
        env, fmt, seed=0, permit="p", actor_id="a", group_id="g", max_turns=1, context_budget=10**6
    )
    odd = [fmt.tok.convert_tokens_to_ids(c) for c in "12"] + [
        fmt.stop_token_ids[0]
    ]  # char-split, may differ from BPE
    [seg] = ep.step(Generation(odd, [-1.0] * 3, [0] * 3, "stop", 1.0, 1.0))
    assert list(seg.tokens[-3:]) == odd and seg.group_id == "g"


def test_eos_still_gets_the_end_of_turn_marker(fmt):
    eos = Generation([fmt.tok.eos_token_id], [-1.0], [0], "stop", 1.0, 1.0)
    assert fmt.tok.decode(fmt.turn("obs", eos.token_ids)).startswith("<|im_end|>")


def test_turn_after_stop_token_does_not_repeat_it(fmt):
    ended, cut = action(fmt, "R"), action(fmt, "R", ended=False)
    with_stop, without_stop = fmt.turn("obs", ended.token_ids), fmt.turn("obs", cut.token_ids)
    assert fmt.tok.convert_ids_to_tokens(fmt.stop_token_ids[0]) == "<|im_end|>"
    # rendered text after an action that sampled <|im_end|> equals the cut one minus that token
    assert fmt.tok.decode(ended.token_ids + with_stop) == fmt.tok.decode(
        cut.token_ids + without_stop
    )
    assert "obs" in fmt.tok.decode(with_stop)


def long_maze_seed() -> int:
    import random

    return next(s for s in range(1000) if make_layout(random.Random(s), 50).optimal_turns >= 30)


def test_compaction_cuts_an_episode_into_truncated_segments(fmt):
    env = make_env("maze")
    seed = long_maze_seed()
    ep = Episode(
        env,
        fmt,
        seed=seed,
        permit="p",
        actor_id="a",
        group_id=None,
        max_turns=50,
        context_budget=400,
    )
    segs = solve(env, ep, fmt)
    assert len(segs) >= 3, "a long episode under a small budget yields several segments"
    assert [s.segment for s in segs] == list(range(len(segs)))
    assert len({s.episode_id for s in segs}) == 1
    for s in segs[:-1]:  # compaction boundaries: not terminal, bootstrapped, episode goes on
        assert s.truncated and not s.terminated and not s.last and s.rewards.sum() == 0
        assert s.num_tokens <= 400
    assert segs[-1].last and segs[-1].terminated and segs[-1].rewards.sum() == 1.0
    assert segs[-1].metrics["compactions"] == len(segs) - 1
    # every segment after a compaction starts from the compacted observation (a prompt, mask 0)
    for s in segs[1:]:
        text = fmt.tok.decode(s.tokens[: np.flatnonzero(s.action_mask)[0]])
        assert "Summary after" in text
    assert sum(s.metrics["segment_turns"] for s in segs) == segs[-1].metrics["turns"]


def test_turn_budget_truncates_without_terminal(fmt):
    env = make_env("maze")
    ep = Episode(
        env,
        fmt,
        seed=long_maze_seed(),
        permit="p",
        actor_id="a",
        group_id=None,
        max_turns=3,
        context_budget=10**6,
    )
    segs = []
    while not ep.done:
        segs += ep.step(action(fmt, "nonsense"))
    assert len(segs) == 1 and segs[0].truncated and not segs[0].terminated and segs[0].last
