"""The guard's language-model judge over a real OpenAI-compatible endpoint (an agent-mode actor's
plain route), its failure policy, and the labelled set's evaluation."""

from __future__ import annotations

import json

import openai
import pytest
from test_agent import agent_actor  # noqa: F401  (the fixture)
from test_broker import start_broker  # noqa: F401  (the fixture agent_actor needs)

from actors.envs import make_env
from actors.envs.guard import keyword_judge
from actors.envs.judge import LLMJudge
from bench import judge as bench

UNREACHABLE = "http://127.0.0.1:9/v1"  # the discard port: nothing listens


@pytest.mark.system
def test_plain_completions_take_no_permit_and_train_nothing(agent_actor) -> None:  # noqa: F811
    actor, learner = agent_actor
    client = openai.OpenAI(base_url=f"{actor.server.address}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model=actor.driver.model, messages=[{"role": "user", "content": "hi"}], temperature=0.5
    )
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens > 0
    stats = learner.stats()
    assert stats["permits_in_use"] == 0 and stats["queued_episodes"] == 0
    assert not actor.driver.sessions and not actor.driver.plain


@pytest.mark.system
def test_the_judge_asks_a_real_endpoint_and_counts_what_it_got(agent_actor) -> None:  # noqa: F811
    actor, _ = agent_actor
    judge = LLMJudge(f"{actor.server.address}/v1", actor.driver.model, on_failure="allow")
    verdicts = [judge(call) for call in ("read src/main.py", "read answers.txt")]
    assert sum(judge.outcomes.values()) == 2
    assert set(judge.outcomes) <= {"hack", "ok", "garbage"}  # it answered, in time
    # failing open, a call is blocked only when the model itself said HACK
    assert sum(verdicts) <= judge.outcomes.get("hack", 0)


@pytest.mark.parametrize(("on_failure", "blocked"), [("block", True), ("allow", False)])
def test_a_judge_that_cannot_answer_fails_closed_or_open(on_failure: str, blocked: bool) -> None:
    judge = LLMJudge(UNREACHABLE, "m", on_failure=on_failure, timeout_s=2)
    assert judge("read src/main.py") is blocked
    assert judge.outcomes == {"error": 1}
    env = make_env(
        "tooluse",
        judge={"url": UNREACHABLE, "model": "m", "on_failure": on_failure, "timeout_s": 2},
    )
    env.reset(0)
    result = env.step("read spec.txt")  # the rules let it through; the judge cannot answer
    assert (result.observation == "error: permission denied") is blocked
    assert result.info["hack_judge"] == int(blocked)


def test_judge_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="on_failure must be 'block' or 'allow'"):
        LLMJudge(UNREACHABLE, "m", on_failure="maybe")
    with pytest.raises(TypeError, match="tooluse: judge: .*unexpected keyword argument 'colour'"):
        make_env("tooluse", judge={"url": UNREACHABLE, "model": "m", "colour": 1})


def test_the_labelled_set_scores_rules_judge_and_guard() -> None:
    """The rules flag no legitimate call of the set; a judge can only add catches to them."""
    cases = json.loads(bench.CASES.read_text())["cases"]
    report = bench.evaluate(cases, keyword_judge(["reference", "solution", "answers", "urllib"]))
    assert report["rules"]["false_positives"] == 0 and report["rules"]["precision"] == 1.0
    assert 0 < report["rules"]["recall"] < 1  # the disguised hacks are what the rules miss
    assert report["guard"]["true_positives"] > report["rules"]["true_positives"]
    hacks = sum(case["hack"] for case in cases)
    for name in ("rules", "judge", "guard"):
        r = report[name]
        assert r["true_positives"] + r["false_negatives"] == hacks
