"""Working hard never looks like being dead, stops stop, exit codes mean something, a client of
another protocol version is told so once, and a refused version leaves the actor quiet.

Real broker processes, real actors (in a thread, so the test can watch them), real signals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgpack
import psutil
import pytest
import torch
import zmq
from conftest import ROOT, free_port, smoke_args
from test_broker import start_broker, wait_until  # noqa: F401  (the fixture)

from actors.actor import M_REFUSED_VERSION, Actor
from actors.engines.simulated import SimulatedEngine
from common.config import load_config
from common.heartbeat import Heartbeat
from common.lifecycle import spawn
from common.model import load_causal_lm, state_dict_for_export
from common.protocol import PROTO
from common.transport import TransportError
from common.weights import pack_state_dict
from deploy.launcher import run_outcome
from testkit.peers import Peer, ScriptedLearner


def actor_config(broker_address: str, model: Path, *extra: str):
    return load_config(None, [f"actor.broker={broker_address}", f"model.path={model}", *extra])


def batch_of(learner: ScriptedLearner, version: int, n: int, what: str) -> list:
    """The next batch of ``n`` whole episodes the learner gets at ``version``."""
    batches: list = []
    wait_until(lambda: bool(batches.append(learner.get_batch(version, n)) or batches[-1]), 60,
               what, every_s=0.1)  # fmt: skip
    return batches[-1]


def run_in_thread(actor: Actor) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(target=actor.run, args=(stop.is_set,), daemon=True)
    thread.start()
    return stop, thread


@pytest.mark.system
def test_an_engine_step_three_times_the_heartbeat_timeout_is_not_taken_for_death(
    start_broker,  # noqa: F811
    tiny_model: Path,
) -> None:
    """Every engine step takes 3 s against a 1 s heartbeat timeout: the actor's heartbeat thread
    keeps it registered, none of its permits is reclaimed, and its episodes reach the learner."""
    broker = start_broker({"broker.heartbeat_timeout_s": 1.0})
    learner = ScriptedLearner(broker.address, "learner", timeout_s=10.0)
    learner.hello(batch_size=2)
    learner.publish(0)  # the simulated engine adopts the version and ignores the tensors
    cfg = actor_config(
        broker.address,
        tiny_model,
        "actor.engine=simulated",
        "actor.env=arith",
        "actor.env_kwargs={max_new_tokens: 2}",
        "actor.max_inflight_episodes=2",
        "actor.id=slow",
    )
    actor = Actor(cfg)
    actor.engine = actor.driver.rollouts.engine = SimulatedEngine(
        str(tiny_model), median_token_latency_s=3.0, latency_sigma=0.0, seed=0
    )
    stop, thread = run_in_thread(actor)
    try:
        batch = batch_of(learner, 0, 2, "two episodes of 3 s engine steps")
        stats = learner.stats()
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert len({seg.episode_id for seg in batch}) == 2
    assert stats["permits_reclaimed"] == 0 and stats["dropped_incomplete_episode"] == 0
    assert actor.link.heartbeat.sent >= 6  # ~3 a second while each 3 s step ran
    learner.close()


@pytest.mark.system
def test_the_learner_keeps_its_role_through_a_long_step(start_broker) -> None:  # noqa: F811
    """HEARTBEAT from the learner's own connection is liveness: with it, another connection cannot
    take the learner role after the lease; without it, it can."""
    broker = start_broker({"broker.learner_lease_s": 1.0})
    learner = ScriptedLearner(broker.address, "learner")
    learner.hello(batch_size=2, version=3)
    beat = Heartbeat(learner.client, lambda: 0.2, header=lambda: {"version": 3}).start()
    time.sleep(2.0)  # twice the lease, "training"
    usurper = ScriptedLearner(broker.address, "usurper")
    with pytest.raises(TransportError) as refused:
        usurper.hello(batch_size=2)
    assert refused.value.code == "learner_taken" and beat.sent >= 5
    beat.stop()
    time.sleep(1.5)  # silent past the lease: the role is free
    usurper.hello(batch_size=2)
    learner.close()
    usurper.close()


@pytest.mark.system
def test_a_client_of_protocol_1_is_told_once_in_its_own_version(start_broker) -> None:  # noqa: F811
    """A client built against version 1 of docs/protocol.md gets one ERROR that it can decode
    (proto 1, its own req echoed) naming both versions, and the broker serves on."""
    broker = start_broker()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker.address)
    try:
        hello = {"proto": 1, "kind": "HELLO", "req": 7, "id": "old-actor", "role": "actor"}
        sock.send(msgpack.packb({**hello, "version": -1}))
        assert sock.poll(5000), "no answer to a version-1 HELLO"
        frames = sock.recv_multipart()
    finally:
        sock.close()
    assert len(frames) == 1
    reply = msgpack.unpackb(frames[0])
    assert reply["proto"] == 1 and reply["kind"] == "ERROR" and reply["req"] == 7
    assert reply["code"] == "bad_proto" and reply["field"] == "proto"
    assert reply["retryable"] is False
    assert f"protocol version {PROTO}" in reply["message"] and "says 1" in reply["message"]
    stats = Peer(broker.address, "probe").stats()  # still serving, the rejection counted
    assert stats["rejected_bad_proto"] == 1 and stats["actors"] == 0


def adapter_for_another_base(version: int) -> tuple[dict, list]:
    """A LoRA adapter manifest: a torch engine that loaded full weights refuses it."""
    tensors = {
        "model.layers.0.self_attn.q_proj.weight.lora_A": torch.zeros(2, 64),
        "model.layers.0.self_attn.q_proj.weight.lora_B": torch.zeros(64, 2),
    }
    return pack_state_dict(tensors, version, 1 << 20, adapter_base="0" * 64)


@pytest.mark.system
def test_a_refused_version_leaves_the_actor_alive_quiet_and_not_ready(
    start_broker,  # noqa: F811
    tiny_model: Path,
) -> None:
    """The actor refuses the latest version: it finishes what it plays, then asks the broker
    for nothing (no permit, no weights) but its heartbeat, says so in its health (alive, not
    ready, what it waits for) and metrics, and plays again from the next version it can load."""
    broker = start_broker({"broker.max_staleness": 1})
    learner = ScriptedLearner(broker.address, "learner")
    learner.hello(batch_size=2)
    weights = state_dict_for_export(load_causal_lm(tiny_model))
    learner.send_weights(*pack_state_dict(weights, 0, 1 << 20))
    actor = Actor(actor_config(broker.address, tiny_model, "actor.env=digits", "actor.id=picky"))
    calls: list[str] = []
    call = actor.link.call
    actor.link.call = lambda kind, *a, **kw: (calls.append(kind), call(kind, *a, **kw))[1]
    stop, thread = run_in_thread(actor)
    try:
        wait_until(lambda: actor.health.ready, 60, "the actor to load version 0")
        learner.send_weights(*adapter_for_another_base(1))
        wait_until(lambda: actor.refused == 1, 30, "the actor to refuse version 1")
        wait_until(lambda: not len(actor.driver), 60, "the episodes in flight to finish")
        time.sleep(0.5)
        calls.clear()
        time.sleep(3.0)
        assert calls == [], f"a waiting actor asked the broker for {sorted(set(calls))}"
        alive, status = actor.health.status()
        assert alive and not status["ready"]
        assert "refused v1" in status["waiting_for"]
        assert M_REFUSED_VERSION._value.get() == 1
        assert actor.link.heartbeat.sent > 0  # still alive at the broker
        learner.send_weights(*pack_state_dict(weights, 2, 1 << 20))
        wait_until(lambda: actor.engine.version == 2, 30, "the actor to load version 2")
        batch = batch_of(learner, 2, 2, "episodes played at version 2")
        assert actor.health.ready
        assert all(seg.min_version == 2 for seg in batch)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    learner.close()


# ------------------------------------------------------------------------------ processes
def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """The processes still alive (not zombies) after waiting up to ``timeout_s``."""
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.system
def test_asyncppo_up_killed_hard_leaves_no_role_behind(tmp_path: Path, tiny_model: Path, procs):
    """SIGKILL the launcher mid-run (it can clean nothing up): every role it started gets
    SIGTERM from the kernel and stops by itself."""
    up = procs.start(
        smoke_args(tmp_path, tiny_model, free_port(), "--set", "learner.total_steps=0"),
        tmp_path / "up.log",
    )
    steps = tmp_path / "run" / "learner_steps.jsonl"
    wait_until(lambda: steps.exists() and steps.read_text().strip(), 180, "a step", every_s=0.5)
    roles = descendants(up.pid)
    assert len(roles) >= 4, [r.cmdline() for r in roles]  # broker, learner, 2 actors
    up.kill()
    up.wait()
    left = wait_gone(roles, 90)
    assert not left, [p.cmdline() for p in left]


@pytest.mark.system
def test_a_test_run_killed_hard_leaves_no_role_behind(tmp_path: Path) -> None:
    """A pytest process that started a broker through the tests' own helper is SIGKILLed (as
    `timeout` or a CI runner does): the broker goes with it."""
    pids = tmp_path / "pids.txt"
    inner = tmp_path / "test_inner.py"
    inner.write_text(
        textwrap.dedent(
            f"""
            import time
            from conftest import free_port

            def test_holds_a_broker(procs, tmp_path):
                endpoint = f"tcp://127.0.0.1:{{free_port()}}"
                broker = procs.start(
                    ["broker", "--set", f"broker.bind={{endpoint}}",
                     "--set", f"run.out_dir={{tmp_path}}"],
                    tmp_path / "broker.log",
                )
                with open({str(pids)!r}, "w") as f:
                    f.write(str(broker.pid))
                time.sleep(600)
            """
        )
    )
    tests = ROOT / "tests"
    pytest_run = spawn(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest"]
        + [str(inner)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(ROOT)])},
        stdout=(tmp_path / "pytest.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: pids.exists() and pids.read_text(), 120, "the inner test's broker")
        broker = psutil.Process(int(pids.read_text()))
        assert broker.is_running()
        pytest_run.kill()  # SIGKILL: no fixture teardown runs
        pytest_run.wait()
        assert not wait_gone([broker], 30), broker.cmdline()
    finally:
        if pytest_run.poll() is None:
            os.killpg(pytest_run.pid, signal.SIGKILL)


@pytest.mark.system
def test_up_exits_nonzero_when_the_run_ends_before_total_steps(tmp_path: Path, tiny_model):
    """`run.max_wall_s` reached with none of 4 steps done: exit status 1, and the last line
    says why. The run dir held an earlier run: it is moved aside, so the new logs start clean."""
    earlier_log = tmp_path / "run" / "logs" / "learner.log"
    earlier_log.parent.mkdir(parents=True)
    earlier_log.write_text("the earlier run\n")
    result = subprocess.run(
        [sys.executable, "-m", "deploy.cli"]
        + smoke_args(tmp_path, tiny_model, free_port(), "--set", "run.max_wall_s=3")
        + ["--summary", str(tmp_path / "summary.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last == "[up] incomplete: run.max_wall_s (3 s) reached after 0 of 4 steps", last
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit"] == 1 and summary["outcome"] == last.removeprefix("[up] ")
    moved = tmp_path / "run.prev" / "logs" / "learner.log"
    assert f"held an earlier run: moved to {tmp_path / 'run.prev'}" in result.stdout
    assert moved.read_text() == "the earlier run\n"
    assert "the earlier run" not in (tmp_path / "run" / "logs" / "learner.log").read_text()


@pytest.mark.parametrize(
    "failure, ended, done, total, expected",
    [
        (None, "the learner exited", 4, 4, (0, "done: 4 of 4 steps")),
        (None, "run.max_wall_s (9 s) reached", 2, 4, (1, "incomplete: run.max_wall_s (9 s) reached after 2 of 4 steps")),
        (None, "stopped", 3, 0, (0, "stopped after 3 steps (learner.total_steps 0: run until stopped)")),
        (None, "stopped", 0, 0, (1, "incomplete: stopped after 0 of ∞ steps")),
        ("the broker exited with status 1", "", 4, 4, (1, "failed after 4 of 4 steps: the broker exited with status 1")),
    ],
)  # fmt: skip
def test_the_exit_status_says_whether_the_run_did_what_it_was_asked(
    failure, ended, done, total, expected
) -> None:
    assert run_outcome(failure, ended, done, total) == expected


@pytest.mark.system
def test_the_learner_compiles_nothing_at_its_first_start(tmp_path: Path) -> None:
    """DeepSpeed's CPU comm backend would JIT-build its shared-memory inference all-reduce into
    TORCH_EXTENSIONS_DIR at the first start (40 s to minutes); the learner never needs it."""
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    code = "from learner.distributed import init_distributed; print(init_distributed())"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "(0, 1)" in result.stdout
    assert list(extensions.rglob("*")) == [], "something was compiled"


@pytest.mark.system
def test_every_version_gauge_reads_minus_one_before_any_version() -> None:
    """0 would mean "holds version 0": before any version every role's gauge says -1."""
    code = textwrap.dedent(
        """
        import actors.actor, actors.evaluation, learner.trainer
        from prometheus_client import REGISTRY
        for role in ("actor", "learner", "eval"):
            print(role, REGISTRY.get_sample_value(f"asyncppo_{role}_policy_version"))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["actor", "-1.0", "learner", "-1.0", "eval", "-1.0"]


def test_only_an_earlier_run_is_moved_aside_not_a_callers_own_files(tmp_path: Path) -> None:
    from deploy.launcher import set_aside_earlier_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "up.log").write_text("the caller's log of this very run\n")
    assert set_aside_earlier_run(run) is None and (run / "up.log").exists()
    (run / "learner_steps.jsonl").write_text("{}\n")
    assert set_aside_earlier_run(run) == tmp_path / "run.prev"
    assert not run.exists() and (tmp_path / "run.prev" / "learner_steps.jsonl").exists()
    assert set_aside_earlier_run(run) is None  # nothing there any more
