"""Continuous batching: episodes in flight at their own turns, prefix reuse, and the actor's loop
against a real broker (its permits asked for while slots are free)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import zlib
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from test_broker import start_broker, wait_until  # noqa: F401  (the fixture)

from actors.actor import Actor
from actors.chat import ChatFormat
from actors.engines import TorchEngine
from actors.envs import make_env
from actors.episode import Episode
from actors.play import Rollouts
from common.config import load_config
from testkit.peers import ScriptedLearner


def maze_episodes(fmt: ChatFormat, n: int, max_turns: int = 6) -> list[Episode]:
    return [
        Episode(
            make_env("maze", max_turns=max_turns),
            fmt,
            seed=zlib.crc32(f"rollout-test/{i}".encode()),
            permit=f"p{i}",
            actor_id="test",
            group_id=None,
            max_turns=max_turns,
            context_budget=400,  # small: most episodes compact once
        )
        for i in range(n)
    ]


def play_all(rollouts: Rollouts, episodes: list[Episode], inflight: int) -> list[set[int]]:
    """Drive `rollouts` as the actor does (refill a free slot, step), one new episode a step at
    most, as permits arrive; the turn numbers of the episodes in flight at every step."""
    waiting, turns_in_flight = list(episodes), []
    while waiting or len(rollouts):
        if waiting and len(rollouts) < inflight:
            rollouts.add(waiting.pop(0))
        turns_in_flight.append({ep.turns for ep in rollouts})
        rollouts.step()
    return turns_in_flight


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> TorchEngine:
    torch.set_num_threads(1)
    return TorchEngine(str(tiny_model))


def test_episodes_play_at_their_own_turns_and_segments_are_whole(engine: TorchEngine) -> None:
    """Episodes that joined at different steps are at different turns at once (nobody waits for
    a batch to finish its turn), every episode ends, and its segments (compaction cuts
    included) come out in order, the last one marked `last`."""
    fmt = ChatFormat(engine.tokenizer)
    episodes = maze_episodes(fmt, 12)
    turns = play_all(Rollouts(engine, temperature=1.0, top_p=1.0), episodes, inflight=5)
    assert any(len(at) > 1 for at in turns)
    assert max(len(at) for at in turns) <= 5
    assert not engine.by_key  # every finished episode released its key
    assert sum(len(ep.segments) for ep in episodes) > len(episodes)  # compaction happened
    for ep in episodes:
        assert ep.done
        assert [s.segment for s in ep.segments] == list(range(len(ep.segments)))
        assert [s.last for s in ep.segments] == [False] * (len(ep.segments) - 1) + [True]
        for seg in ep.segments:
            assert np.isfinite(seg.behavior_logprobs).all()


def test_prefix_reuse_encodes_each_context_token_once(engine: TorchEngine) -> None:
    """With reuse a turn encodes only its new tokens (after a compaction, only what the summary
    does not share with the old context); without it every turn re-encodes its whole context.
    The episodes' token counts bound both from the data alone."""
    fmt = ChatFormat(engine.tokenizer)
    encoded = {}
    for reuse in (True, False):
        episodes = maze_episodes(fmt, 6)
        engine.encoded_tokens = 0
        play_all(Rollouts(engine, temperature=1.0, top_p=1.0, reuse_prefix=reuse), episodes, 6)
        segments = [s for ep in episodes for s in ep.segments]
        # every segment's tokens but its final sampled one pass through the model at least once
        floor = sum(len(s.tokens) - 1 for s in segments)
        encoded[reuse] = (engine.encoded_tokens, floor)
    used, floor = encoded[True]
    assert floor - 16 * len(segments) <= used <= floor  # at most once: nothing re-encoded
    used, floor = encoded[False]
    assert used > 1.5 * floor  # each turn's context again


@pytest.mark.system
def test_the_actor_fills_its_slots_from_a_real_broker(start_broker, tiny_model: Path) -> None:  # noqa: F811
    """An actor asks for permits while slots are free (more in flight than one request grants),
    never holds more than max_inflight_episodes, and the broker hands out whole episodes."""
    broker = start_broker({"broker.max_staleness": 1})
    learner = ScriptedLearner(broker.address, "learner")
    learner.hello(batch_size=8)
    learner.publish(0)  # the simulated engine adopts the version and ignores the tensors
    cfg = load_config(
        None,
        [
            f"actor.broker={broker.address}",
            f"model.path={tiny_model}",
            "actor.engine=simulated",
            "actor.env=maze",
            "actor.env_kwargs={max_turns: 3}",
            "actor.max_turns=3",
            "actor.max_inflight_episodes=12",
            "actor.permits_per_request=4",
            "actor.id=filler",
        ],
    )
    actor = Actor(cfg)
    in_flight = []
    step = actor.driver.step
    actor.driver.step = lambda: (in_flight.append(len(actor.driver)), step())[1]
    stop = threading.Event()
    runner = threading.Thread(target=actor.run, args=(stop.is_set,))
    runner.start()
    try:
        batches = []
        wait_until(
            lambda: bool(batches.append(learner.get_batch(0, 8)) or batches[-1]),
            timeout_s=60,
            what="a batch of 8 episodes",
            every_s=0.1,
        )
    finally:
        stop.set()
        runner.join(timeout=30)
    assert not runner.is_alive()
    assert 4 < max(in_flight) <= 12
    episodes = defaultdict(list)
    for seg in batches[-1]:
        episodes[seg.episode_id].append(seg)
    assert len(episodes) >= 8
    for segments in episodes.values():
        assert [s.segment for s in segments] == list(range(len(segments)))
        assert segments[-1].last


@pytest.mark.system
def test_the_rollout_benchmark_runs_and_reencode_is_exact(tmp_path: Path, tiny_model: Path) -> None:
    """`python -m bench.rollout --quick` (the benchmark's command, few episodes): every variant plays the
    same episodes, and under weight swaps `reencode` leaves every token's μ equal to its
    version's log π while `keep` does not."""
    out = tmp_path / "rollout.json"
    subprocess.run(
        [sys.executable, "-m", "bench.rollout", "--quick", "--model", str(tiny_model)]
        + ["--swap-every", "10", "--out", str(out)],
        check=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[1],
    )
    report = json.loads(out.read_text())
    rows = {(r["workload"], r["variant"]): r for r in report["throughput"]}
    for workload in ("maze 2-50 turns", "single turn"):
        played = {rows[workload, v]["episodes"] for v in rows_of(rows, workload)}
        assert played == {8 if workload.startswith("maze") else 32}
        assert rows[workload, "(a) lockstep x4"]["episodes_per_s_vs_a"] == 1
    reuse = rows["maze 2-50 turns", "(c) continuous + prefix reuse"]
    again = rows["maze 2-50 turns", "(b) continuous"]
    assert reuse["engine_encoded_tokens"] < again["engine_encoded_tokens"]
    swaps = {r["policy"]: r for r in report["swap_policies"]}
    assert swaps["reencode"]["versions"] > 1
    assert swaps["reencode"]["mismatch"]["max_abs"] < 1e-4
    assert swaps["keep"]["mismatch"]["max_abs"] > 1e-4
    assert out.with_suffix(".png").stat().st_size > 0


def rows_of(rows: dict, workload: str) -> list[str]:
    return [v for w, v in rows if w == workload and v != "FLOP ceiling"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_in_system_benchmark_measures_the_actors_of_a_real_run(tmp_path: Path) -> None:
    """`python -m bench.insystem --quick --profile`: a real `asyncppo up`, the actors' counters
    and CPU over a window, py-spy's split of actor 0's and the learner's CPU, and the loop alone
    at the batch the actors ran; the engine did most of what the actor spent its CPU on, the
    steps most of the learner's."""
    out = tmp_path / "insystem.json"
    subprocess.run(
        [sys.executable, "-m", "bench.insystem", "--quick", "--profile", "--out", str(out)],
        check=True,
        timeout=840,
        cwd=Path(__file__).resolve().parents[1],
    )
    report = json.loads(out.read_text())
    head = report["systems"]["this tree"]
    assert head["episodes"] > 0 and 0 < head["actor_cpu_utilisation"] <= 1.05
    assert head["batch"] >= 1 and head["encoded_per_token"] >= 1
    assert 0 <= head["reencoded_fraction"] < 1
    engine = sum(v for k, v in head["actor0_cpu_breakdown"].items() if k.startswith("engine"))
    assert engine > 0.3, head["actor0_cpu_breakdown"]
    step = sum(v for k, v in head["learner_cpu_breakdown"].items() if k.startswith("step"))
    assert step > 0.3, head["learner_cpu_breakdown"]  # the learner's CPU went into its steps
    assert {"inflight 64"} <= set(report["alone"])
    assert out.with_suffix(".png").stat().st_size > 0
