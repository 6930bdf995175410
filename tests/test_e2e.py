"""The whole loop in real processes: `asyncppo up` on configs/smoke.yaml, Ctrl-C of a running `up`,
and (slow) what `make demo` runs and promises."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.request
from datetime import datetime

import pytest
from conftest import free_port, smoke_args
from prometheus_client.parser import text_string_to_metric_families

from deploy.launcher import STOP_TIMEOUT_S

SLOW_EPOCHS = 5000  # passes over each batch: a step of the tiny model that takes minutes


@pytest.mark.system
def test_smoke_run_trains_and_every_actor_gets_new_weights(tmp_path, tiny_model, procs):
    metrics = free_port()
    summary_path = tmp_path / "summary.json"
    proc = procs.start(
        smoke_args(
            tmp_path,
            tiny_model,
            free_port(),
            "--set",
            f"run.metrics_base_port={metrics}",
            "--summary",
            str(summary_path),
        ),
        tmp_path / "up.log",
    )
    scraped = {}
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        for role, port in (("broker", metrics), ("learner", metrics + 1), ("actor", metrics + 10)):
            with contextlib.suppress(OSError):  # not up yet, or already gone
                scraped[role] = (
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
                    .read()
                    .decode()
                )
        time.sleep(1)
    assert proc.wait(timeout=30) == 0, (tmp_path / "up.log").read_text()[-3000:]
    s = json.loads(summary_path.read_text())
    assert s["learner_steps"] == 4
    assert s["policy_version"] >= 2
    assert s["trajectories_trained"] == 4 * 8 and s["tokens_trained"] > 0
    assert s["actors"] == 2 and all(v >= 2 for v in s["actor_versions"].values()), s[
        "actor_versions"
    ]
    assert s["max_staleness_seen"] <= s["max_staleness_allowed"] == 1
    assert s["rejected_invalid"] == 0 and s["dropped_stale"] == 0
    for key in ("reward_first", "reward_last", "wall_seconds"):
        assert isinstance(s[key], float)
    # each role's CPU seconds: every role worked, and none more than the run's wall time on
    # every core of this machine (a sample is at most one watch tick behind the role)
    cpu = s["cpu_seconds"]
    assert set(cpu) == {"broker", "learner", "actors"}, cpu
    assert all(0 < seconds <= s["wall_seconds"] * os.cpu_count() for seconds in cpu.values()), cpu
    assert "asyncppo_broker_trajectories_accepted_total" in scraped["broker"]
    actor = {
        sample.name: sample.value
        for family in text_string_to_metric_families(scraped["actor"])
        for sample in family.samples
    }
    # what the engine ran: every step sampled at least one token (counted before the step)
    engine_steps = actor["asyncppo_actor_engine_steps_total"]
    assert 0 < engine_steps <= actor["asyncppo_actor_tokens_generated_total"], actor
    assert "asyncppo_learner_policy_version" in scraped["learner"]
    steps = [
        json.loads(line)
        for line in (tmp_path / "run" / "learner_steps.jsonl").read_text().splitlines()
    ]
    assert [st["version"] for st in steps] == sorted(st["version"] for st in steps)


@pytest.mark.system
def test_ctrl_c_stops_every_role(tmp_path, tiny_model, procs):
    proc = procs.start(
        smoke_args(tmp_path, tiny_model, free_port(), "--set", "learner.total_steps=0"),
        tmp_path / "up.log",
    )
    steps = tmp_path / "run" / "learner_steps.jsonl"
    deadline = time.monotonic() + 180
    while not (steps.exists() and steps.read_text().strip()) and time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=90) == 0, (tmp_path / "up.log").read_text()[-3000:]
    log = (tmp_path / "up.log").read_text()
    assert "[up] summary" in log
    learner_log = (tmp_path / "run" / "logs" / "learner.log").read_text()
    assert "checkpoint saved" in learner_log and "learner finished" in learner_log
    for name in ("actor-0", "actor-1"):
        assert "actor stopped" in (tmp_path / "run" / "logs" / f"{name}.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_learner_stopped_in_a_long_step_finishes_it_and_checkpoints(tmp_path, tiny_model, procs):
    """`up` stopping at run.max_wall_s waits for a learner whose step outlasts the 30 s other roles
    get, as long as its /healthz says it makes progress (a real model's step on CPU takes
    minutes; killing it lost the run's last checkpoint)."""
    proc = procs.start(
        smoke_args(
            tmp_path,
            tiny_model,
            free_port(),
            *("--set", "learner.total_steps=0", "--set", f"learner.ppo_epochs={SLOW_EPOCHS}"),
            *("--set", "run.max_wall_s=30", "--set", f"run.metrics_base_port={free_port()}"),
        ),
        tmp_path / "up.log",
    )
    assert proc.wait(timeout=540) == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert "stopping the learner" in (tmp_path / "up.log").read_text()
    lines = [
        json.loads(line)
        for line in (tmp_path / "run" / "logs" / "learner.log").open()
        if line.startswith("{")
    ]
    events = [line["event"] for line in lines]
    signalled = events.index("stop signal: finishing")
    assert "step" in events[signalled:], "the step in progress at the signal was finished"
    assert events[-2:] == ["checkpoint saved", "learner finished"], events[-5:]
    assert (tmp_path / "run" / "checkpoints" / "policy" / "latest").exists()
    at = [datetime.fromisoformat(lines[i]["timestamp"]) for i in (signalled, -2)]
    waited = (at[1] - at[0]).total_seconds()
    assert waited > STOP_TIMEOUT_S, (
        f"the step ended {waited:.0f} s after the signal: too short a test"
    )


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_demo_learns_its_task_on_held_out_instances(tmp_path, procs):
    """`make demo`'s two commands (on its own port, model directory and run directory): held-out
    success from near 0 to >= 0.8 at the final version, which the evaluator always scores.
    Alone on 2 cores: ~80 s and ~200 s; the limits leave room for a busy machine."""
    warm = tmp_path / "warm"
    built = procs.start(
        ["model", "warmup", "chain", "--out", str(warm)],
        tmp_path / "warm.log",
        env={"OMP_NUM_THREADS": "1"},
    )
    assert built.wait(timeout=900) == 0, (tmp_path / "warm.log").read_text()[-3000:]
    args = smoke_args(
        tmp_path,
        warm,
        free_port(),
        *("--set", "run.metrics_base_port=0", "--set", "run.max_wall_s=1200"),
        *("--summary", str(tmp_path / "summary.json")),
        config="configs/demo.yaml",
    )
    proc = procs.start(args, tmp_path / "up.log")
    assert proc.wait(timeout=1300) == 0, (tmp_path / "up.log").read_text()[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    first, last = summary["eval"]
    assert summary["policy_version"] == last["version"] == 40
    assert first["success"] < 0.3 and last["success"] >= 0.8, summary["eval"]
