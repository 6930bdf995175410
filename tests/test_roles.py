"""Roles started by hand as in docs/operations.md (separate processes, explicit endpoints), a late-joining
actor, actors added and removed while training runs, and a broker restarted without a spool."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from conftest import ROOT, free_port, smoke_args

from common.config import load_config
from common.metrics import Health, serve_metrics
from common.transport import Client, Endpoint, TransportError
from testkit.peers import BrokerProcess


def stats(endpoint: str) -> dict:
    client = Client(
        Endpoint(load_config().security, 1 << 20), endpoint, "test-stats", timeout_s=2.0
    )
    try:
        return client.request("STATS").header["stats"]
    except TransportError:
        return {}
    finally:
        client.close()


def wait_for(cond, timeout: float, what: str, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        for p in procs:
            assert p.poll() is None, f"a role exited early while waiting for {what}"
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def get(url: str) -> tuple[int, bytes]:
    """Status and body; status 0 while nothing listens yet."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except urllib.error.URLError:
        return 0, b""


def steps_of(run_dir) -> list[dict]:
    path = run_dir / "learner_steps.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.system
def test_roles_by_hand_with_a_late_joiner(tmp_path, tiny_model, procs):
    port, endpoint = free_port(), None
    endpoint = f"tcp://127.0.0.1:{port}"
    common = [
        "--config",
        "configs/smoke.yaml",
        "--set",
        f"model.path={tiny_model}",
        "--set",
        f"run.out_dir={tmp_path}",
        "--set",
        "learner.total_steps=0",
    ]
    broker = procs.start(
        ["broker", *common, "--set", f"broker.bind={endpoint}", "--metrics-port", "0"],
        tmp_path / "broker.log",
    )
    learner = procs.start(
        ["learner", *common, "--set", f"learner.broker={endpoint}"], tmp_path / "learner.log"
    )
    actor = procs.start(
        ["actor", *common, "--set", f"actor.broker={endpoint}", "--set", "actor.id=first"],
        tmp_path / "a1.log",
    )
    wait_for(
        lambda: len(steps_of(tmp_path)) >= 2, 180, "two learner steps", [broker, learner, actor]
    )
    version_now = stats(endpoint)["policy_version"]
    late = procs.start(
        ["actor", *common, "--set", f"actor.broker={endpoint}", "--set", "actor.id=late"],
        tmp_path / "a2.log",
    )
    wait_for(
        lambda: stats(endpoint).get("actor_versions", {}).get("late", -1) >= version_now,
        120,
        "the late joiner to load the newest version",
        [broker, late],
    )
    wait_for(
        lambda: "late" in {a for s in steps_of(tmp_path) for a in s["actors"]},
        120,
        "the late joiner's episodes to be trained on",
        [broker, learner, actor, late],
    )
    learner.send_signal(signal.SIGTERM)
    assert learner.wait(timeout=60) == 0, (tmp_path / "learner.log").read_text()[-2000:]
    final = stats(endpoint)
    assert final["policy_version"] == len(steps_of(tmp_path)) and final["rejected_invalid"] == 0
    assert {"first", "late"} <= set(final["actor_versions"])
    for p in (actor, late, broker):
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0


@pytest.mark.system
def test_a_learner_stopped_after_its_broker_died_checkpoints_and_exits(tmp_path, tiny_model, procs):
    """kill -9 the broker while the learner waits for a batch, then SIGTERM the learner: it must
    not wait for the broker for ever (its retries would keep it from the final checkpoint)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    common = ["--config", "configs/smoke.yaml", "--set", f"model.path={tiny_model}"]
    common += ["--set", f"run.out_dir={tmp_path}", "--set", "learner.total_steps=0"]
    common += ["--set", "learner.broker_timeout_s=2", "--set", "broker.batch_wait_s=1"]
    broker = procs.start(
        ["broker", *common, "--set", f"broker.bind={endpoint}"], tmp_path / "broker.log"
    )
    learner = procs.start(
        ["learner", *common, "--set", f"learner.broker={endpoint}"], tmp_path / "learner.log"
    )
    log = tmp_path / "learner.log"
    wait_for(lambda: "waiting for a batch" in log.read_text(), 120, "the learner", [learner])
    broker.kill()
    broker.wait()
    time.sleep(3)  # past one GET_BATCH timeout: the learner is retrying now
    learner.send_signal(signal.SIGTERM)
    assert learner.wait(timeout=30) == 0, log.read_text()[-2000:]
    saved = [json.loads(x) for x in log.read_text().splitlines() if '"checkpoint saved"' in x]
    assert [(s["step"], s["version"]) for s in saved] == [(0, 0)]
    assert (tmp_path / "checkpoints" / "policy" / "step0").is_dir()


@pytest.mark.system
def test_torchrun_learner_trains_data_parallel_on_two_ranks(tmp_path, tiny_model, procs):
    """The multi-node learner command: torchrun starts 2 DeepSpeed ranks (gloo on CPU); rank 0
    talks to the broker, both train every step and exit together."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    common = ["--config", "configs/smoke.yaml", "--set", f"model.path={tiny_model}"]
    common += ["--set", f"run.out_dir={tmp_path}", "--set", "learner.total_steps=2"]
    broker = procs.start(
        ["broker", *common, "--set", f"broker.bind={endpoint}"], tmp_path / "broker.log"
    )
    actor = procs.start(["actor", *common, "--set", f"actor.broker={endpoint}"], tmp_path / "a.log")
    torchrun = ("-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}")
    learner = procs.start(
        ["learner", *common, "--set", f"learner.broker={endpoint}"],
        tmp_path / "learner.log",
        launcher=torchrun,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert learner.wait(timeout=240) == 0, (tmp_path / "learner.log").read_text()[-3000:]
    log = (tmp_path / "learner.log").read_text().splitlines()
    ready = [json.loads(x) for x in log if '"learner ready"' in x]
    assert sorted((r["rank"], r["world"]) for r in ready) == [(0, 2), (1, 2)]
    steps = steps_of(tmp_path)
    assert [s["step"] for s in steps] == [0, 1] and all(s["episodes"] > 0 for s in steps)
    assert stats(endpoint)["policy_version"] == 2
    for p in (actor, broker):
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0


@pytest.mark.system
def test_actors_scale_up_and_down_while_training(tmp_path, tiny_model, procs):
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    run_dir = tmp_path / "run"
    up = procs.start(
        smoke_args(
            tmp_path,
            tiny_model,
            port,
            "--set",
            "learner.total_steps=0",
            "--set",
            "run.num_actors=1",
        ),
        tmp_path / "up.log",
    )
    wait_for(lambda: len(steps_of(run_dir)) >= 1, 180, "the first step", [up])

    def scale(n: int) -> None:
        subprocess.run(
            [sys.executable, "-m", "deploy.cli", "scale", "--run-dir", str(run_dir), str(n)],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )

    scale(3)
    wait_for(lambda: stats(endpoint).get("actors") == 3, 120, "3 connected actors", [up])
    n = len(steps_of(run_dir))

    def trained_by_three() -> bool:  # every actor's episodes reach the learner, however slow
        later = steps_of(run_dir)[n:]
        return len(later) >= 2 and len({a for s in later for a in s["actors"]}) >= 3

    wait_for(trained_by_three, 180, "training on the episodes of all 3 actors", [up])
    scale(1)
    wait_for(lambda: stats(endpoint).get("actors") == 1, 60, "actors to leave", [up])
    n = len(steps_of(run_dir))
    wait_for(lambda: len(steps_of(run_dir)) >= n + 2, 120, "training to go on with 1 actor", [up])
    up.send_signal(signal.SIGUSR1)  # +1 by signal
    wait_for(lambda: stats(endpoint).get("actors") == 2, 120, "the signalled actor", [up])
    up.send_signal(signal.SIGUSR2)  # -1 by signal
    wait_for(lambda: stats(endpoint).get("actors") == 1, 60, "the signalled actor to leave", [up])
    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=90) == 0
    versions = [s["version"] for s in steps_of(run_dir)]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert len({a for s in steps_of(run_dir) for a in s["actors"]}) >= 3


@pytest.mark.system
def test_a_broker_restarted_without_spool_gets_the_learners_weights_again(
    tmp_path, tiny_model, procs
):
    """Without a spool a restarted broker has no weights: actors would wait (`no_weights`) and the
    learner for a batch, forever. The learner's HELLO finds the broker behind and publishes its
    current weights again, under its current version. The learner is ready (/readyz) only once
    a broker has answered it."""
    broker = BrokerProcess(tmp_path / "broker.log")  # no spool_dir: the default
    metrics = f"http://127.0.0.1:{free_port()}"
    common = ["--config", "configs/smoke.yaml"] + [
        arg
        for setting in (
            f"model.path={tiny_model}",
            f"run.out_dir={tmp_path}",
            f"learner.broker={broker.address}",
            f"actor.broker={broker.address}",
            "learner.total_steps=0",
            "learner.batch_size=4",
            "learner.broker_timeout_s=3",  # a GET_BATCH lost with the broker times out soon
        )
        for arg in ("--set", setting)
    ]
    learner_log = tmp_path / "learner.log"
    learner = procs.start(
        ["learner", *common, "--metrics-port", metrics.rsplit(":", 1)[1]], learner_log
    )
    actor = procs.start(["actor", *common, "--set", "actor.id=a"], tmp_path / "actor.log")
    try:
        wait_for(lambda: "learner ready" in learner_log.read_text(), 120, "the models", [learner])
        time.sleep(1)
        assert get(f"{metrics}/readyz")[0] == 503, "ready before any broker answered"
        broker.start()
        wait_for(lambda: get(f"{metrics}/readyz")[0] == 200, 60, "readiness", [learner])
        wait_for(lambda: steps_of(tmp_path), 180, "a learner step", [learner, actor])
        actor.send_signal(signal.SIGSTOP)  # no more episodes: the learner ends up waiting

        def waiting() -> bool:  # told WAIT: it published after its last step and asks again
            lines = learner_log.read_text().splitlines()
            return bool(lines) and '"waiting for a batch"' in lines[-1]

        wait_for(waiting, 60, "the learner to wait for a batch", [learner])
        version = steps_of(tmp_path)[-1]["version"] + 1  # the learner's current version
        assert stats(broker.address)["policy_version"] == version
        broker.kill()
        broker.start()
        wait_for(
            lambda: stats(broker.address)["policy_version"] >= 0,
            60,
            "the learner's weights on the restarted broker",
            [learner],
        )
        assert stats(broker.address)["policy_version"] == version
        assert "broker lacks the current weights" in learner_log.read_text()
        n = len(steps_of(tmp_path))
        actor.send_signal(signal.SIGCONT)
        wait_for(lambda: len(steps_of(tmp_path)) > n, 120, "training to go on", [learner, actor])
        assert steps_of(tmp_path)[n]["version"] == version
        learner.send_signal(signal.SIGTERM)
        assert learner.wait(timeout=60) == 0, learner_log.read_text()[-2000:]
    finally:
        broker.close()


def test_healthz_turns_503_when_the_loop_stalls_and_names_what_it_waits_for():
    """The watchdog of every role: liveness fails after stall_s without a beat, recovers on the
    next one; readiness also needs the role to say it is ready."""
    health = Health(stall_s=0.5)
    server = serve_metrics("127.0.0.1", 0, health, role="test")
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        health.beat("a batch from the broker")
        assert get(f"{base}/healthz")[0] == 200
        assert get(f"{base}/readyz")[0] == 503  # alive, not ready yet
        time.sleep(0.8)
        code, body = get(f"{base}/healthz")
        info = json.loads(body)
        assert code == 503 and not info["alive"]
        assert info["waiting_for"] == "a batch from the broker"
        assert info["seconds_since_progress"] >= 0.5
        health.beat()
        health.ready = True
        assert get(f"{base}/healthz")[0] == get(f"{base}/readyz")[0] == 200
    finally:
        server.shutdown()
        server.server_close()
