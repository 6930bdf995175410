"""Agent mode: the real `openai` client (sync and async, concurrent sessions) against an actor's
OpenAI-compatible API, with a real broker; the trained segments checked token for token."""

from __future__ import annotations

import asyncio
import http.client as http_client
import importlib.util
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path

import numpy as np
import openai
import pytest
from conftest import ROOT, free_port, smoke_args
from prometheus_client import REGISTRY
from test_broker import start_broker, wait_until  # noqa: F401  (the fixture)
from test_engine import reference_logprobs

from actors.actor import Actor
from common.config import load_config
from common.lifecycle import spawn
from common.model import load_causal_lm, load_tokenizer, state_dict_for_export
from common.weights import pack_state_dict
from testkit.peers import ScriptedLearner

pytestmark = pytest.mark.system  # every test here starts real processes


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture
def agent_actor(start_broker, tiny_model: Path):  # noqa: F811
    """A broker with the tiny model's weights published as version 0, a learner that pulls
    batches of 4 episodes, and an actor in agent mode serving on a free port."""
    broker = start_broker({"broker.max_staleness": 1})
    learner = ScriptedLearner(broker.address, "learner")
    learner.hello(batch_size=4)
    learner.send_weights(
        *pack_state_dict(state_dict_for_export(load_causal_lm(tiny_model)), 0, 1 << 20)
    )
    cfg = load_config(
        None,
        [
            f"actor.broker={broker.address}",
            f"model.path={tiny_model}",
            "actor.mode=agent",
            "actor.agent_port=0",
            "actor.agent_max_tokens=12",
            "actor.id=agent-actor",
        ],
    )
    actor = Actor(cfg)
    stop = threading.Event()
    runner = threading.Thread(target=actor.run, args=(stop.is_set,))
    runner.start()
    wait_until(lambda: actor.engine.version == 0, 30, "the actor to load version 0")
    yield actor, learner
    stop.set()
    runner.join(timeout=30)
    assert not runner.is_alive()


def start(actor: Actor) -> dict:
    status, session = post(f"{actor.server.address}/v1/sessions", {})
    assert status == 200, session
    return session


def end(actor: Actor, session: dict, reward: float) -> dict:
    status, reply = post(
        f"{actor.server.address}/v1/sessions/{session['id']}/end", {"reward": reward}
    )
    assert status == 200, reply
    return reply


def next_batch(learner: ScriptedLearner, n: int) -> dict[str, list]:
    """The next batch of n whole episodes from the broker: episode id -> its segments, in order."""
    batches: list = []
    wait_until(
        lambda: bool(batches.append(learner.get_batch(0, n)) or batches[-1]),
        60,
        f"a batch of {n} sessions",
        every_s=0.1,
    )
    episodes = defaultdict(list)
    for seg in sorted(batches[-1], key=lambda s: s.segment):
        episodes[seg.episode_id].append(seg)
    return episodes


def replies(segments: list, tokenizer) -> list[str]:
    """The text of every run of action tokens, in order: what the completions returned."""
    texts = []
    for seg in segments:
        acts = np.flatnonzero(seg.action_mask)
        runs = np.split(acts, np.flatnonzero(np.diff(acts) > 1) + 1)
        texts += [tokenizer.decode(seg.tokens[run], skip_special_tokens=True) for run in runs]
    return texts


def test_agent_sessions_are_trained_token_for_token(agent_actor, tiny_model: Path) -> None:
    actor, learner = agent_actor
    model_name = actor.driver.model
    tokenizer = load_tokenizer(tiny_model)
    texts: dict[str, list[str]] = defaultdict(list)  # session -> completion texts, in order

    # a sync session: two turns with a tool result between them, then a compaction (a rewritten
    # history), a third turn, and the end: one episode of two segments
    cut = start(actor)
    client = openai.OpenAI(base_url=cut["base_url"], api_key="unused")
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    first = client.chat.completions.create(model=model_name, messages=messages)
    texts[cut["id"]].append(first.choices[0].message.content)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "tool", "content": "calculator: 5"},
    ]
    second = client.chat.completions.create(model=model_name, messages=messages)
    texts[cut["id"]].append(second.choices[0].message.content)
    compacted = [{"role": "user", "content": "Summary: the tool said 5. Answer now."}]
    third = client.chat.completions.create(model=model_name, messages=compacted)
    texts[cut["id"]].append(third.choices[0].message.content)
    assert client.models.list().data[0].id == model_name
    end(actor, cut, 1.0)

    # three async sessions at once, one turn each
    async def one_session(i: int) -> str:
        session = start(actor)
        aclient = openai.AsyncOpenAI(base_url=session["base_url"], api_key="unused")
        reply = await aclient.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": f"Say {i}."}]
        )
        texts[session["id"]].append(reply.choices[0].message.content)
        await aclient.close()
        return session

    async def concurrently() -> list[dict]:
        return await asyncio.gather(*(one_session(i) for i in range(3)))

    for i, session in enumerate(asyncio.run(concurrently())):
        end(actor, session, 0.5 * i)

    episodes = next_batch(learner, 4)
    assert set(episodes) == set(texts)  # whole episodes, every session's
    model = load_causal_lm(tiny_model).eval()
    for episode_id, segments in episodes.items():
        assert segments[-1].last and segments[-1].terminated
        for seg in segments:
            # the recorded tokens are the ones the engine sampled in this very context: their
            # log-probs equal a fresh forward of the learner's model over the segment
            acts = np.flatnonzero(seg.action_mask)
            expected = reference_logprobs(
                model, seg.tokens[: acts[0]].tolist(), seg.tokens[acts[0] :].tolist(), 1.0, 1.0
            )
            np.testing.assert_allclose(
                seg.behavior_logprobs[acts], expected[acts - acts[0]], atol=1e-4
            )
        assert replies(segments, tokenizer) == texts[episode_id]  # what each call returned
    two = episodes[cut["id"]]
    assert [s.truncated for s in two] == [True, False] and not two[0].last
    assert two[1].rewards[np.flatnonzero(two[1].action_mask)[-1]] == 1.0
    tool_ids = tokenizer("calculator: 5", add_special_tokens=False)["input_ids"]
    tokens = two[0].tokens.tolist()
    at = next(i for i in range(len(tokens)) if tokens[i : i + len(tool_ids)] == tool_ids)
    assert not two[0].action_mask[at : at + len(tool_ids)].any()  # the tool's words: observation


def test_bad_requests_get_openai_errors_and_the_actor_serves_on(agent_actor) -> None:
    actor, _ = agent_actor
    session = start(actor)
    client = openai.OpenAI(base_url=session["base_url"], api_key="unused")
    ok = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-9", messages=ok)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=actor.driver.model, messages=[{"role": "robot", "content": "x"}]
        )
    assert err.value.param == "messages[0].role"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=actor.driver.model, messages=ok, temperature=0.3)
    stranger = openai.OpenAI(
        base_url=session["base_url"].replace(session["id"], "nope"), api_key="x"
    )
    with pytest.raises(openai.NotFoundError):
        stranger.chat.completions.create(model=actor.driver.model, messages=ok)
    status, reply = post(
        f"{actor.server.address}/v1/sessions/{session['id']}/end", {"reward": "high"}
    )
    assert status == 400 and reply["error"]["param"] == "reward"

    # Bodies that cannot be parsed are answered and counted like every other request.
    def counted(status: str) -> float:
        labels = {"route": "start", "status": status}
        return REGISTRY.get_sample_value("asyncppo_actor_agent_requests_total", labels) or 0.0

    before = counted("400"), counted("413")
    for body in (b"{not json", b"\xff\xfe not utf-8", b"[1, 2]"):
        request = urllib.request.Request(f"{actor.server.address}/v1/sessions", body)
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(request, timeout=30)
        assert http.value.code == 400
    host, port = actor.server.address.removeprefix("http://").split(":")
    huge = http_client.HTTPConnection(host, int(port), timeout=30)
    huge.putrequest("POST", "/v1/sessions")
    huge.putheader("Content-Length", str(1 << 30))
    huge.endheaders()
    assert huge.getresponse().status == 413
    huge.close()
    assert (counted("400"), counted("413")) == (before[0] + 3, before[1] + 1)
    reply = client.chat.completions.create(model=actor.driver.model, messages=ok)
    assert reply.choices[0].message.role == "assistant"  # still serving after all of that
    end(actor, session, 0.0)


def test_the_example_agent_trains_end_to_end(tmp_path: Path, tiny_model: Path, procs) -> None:
    """examples/calc_agent, written only against the openai client, drives an actor in agent
    mode under `asyncppo up`: real broker, DeepSpeed learner and actor train on its sessions
    until the run's steps are done."""
    port = free_port()
    summary = tmp_path / "summary.json"
    up = procs.start(
        smoke_args(tmp_path, tiny_model, free_port())
        + ["--set", "actor.mode=agent", "--set", f"actor.agent_port={port}"]
        + ["--set", "actor.agent_model=tiny", "--set", "run.num_actors=1"]
        + ["--set", "learner.total_steps=3", "--summary", str(summary)],
        tmp_path / "up.log",
    )
    actor = f"http://127.0.0.1:{port}"

    def serving() -> bool:
        assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
        try:
            return urllib.request.urlopen(f"{actor}/v1/models", timeout=2).status == 200
        except OSError:
            return False

    wait_until(serving, 120, "the actor's agent API", every_s=0.5)
    agent = spawn(
        [sys.executable, "examples/calc_agent/agent.py", "--actor", actor, "--model", "tiny"]
        + ["--episodes", "200", "--parallel", "4"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert up.wait(timeout=300) == 0, (tmp_path / "up.log").read_text()[-3000:]
    finally:
        agent.kill()
    played = [json.loads(line) for line in agent.stdout.read().splitlines() if line.startswith("{")]
    s = json.loads(summary.read_text())
    assert s["learner_steps"] == 3 and s["trajectories_trained"] >= 3 * 8
    assert len(played) >= 3 * 8 and any(p["compactions"] for p in played)
    assert s["rejected_invalid"] == 0


def test_the_example_agent_is_trained_on_exactly_what_it_saw(agent_actor, tiny_model) -> None:
    """examples/calc_agent's own episode loop (tool calls, its own compaction) against the
    actor: the batch holds its sessions whole, and each session's action tokens decode, in
    order, to exactly the replies the agent received."""
    actor, learner = agent_actor
    spec = importlib.util.spec_from_file_location(
        "calc_agent", ROOT / "examples" / "calc_agent" / "agent.py"
    )
    calc_agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calc_agent)
    played = [
        calc_agent.episode(actor.server.address, actor.driver.model, seed) for seed in range(4)
    ]
    episodes = next_batch(learner, 4)
    tokenizer = load_tokenizer(tiny_model)
    assert set(episodes) == {p["session"] for p in played}
    for result in played:
        segments = episodes[result["session"]]
        assert len(segments) == 1 + result["compactions"]  # one cut per compaction
        assert replies(segments, tokenizer) == result["replies"]
        last = segments[-1]
        assert last.rewards[np.flatnonzero(last.action_mask)[-1]] == result["reward"]
