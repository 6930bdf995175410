"""Shared fixtures: free ports, a tiny model built once per session, process cleanup."""

from __future__ import annotations

import multiprocessing.process
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import torch
import torch.distributed as dist

from common.lifecycle import spawn
from common.transport import free_port  # noqa: F401 (tests import it from here)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The built-in tiny model, built once through the same path `model.builtin: tiny` takes."""
    from common.model import ensure_model

    path = tmp_path_factory.mktemp("models") / "tiny"
    ensure_model(path, builtin="tiny")
    return path


# The in-process world of one (single_process_group) must not leak into a started process: a
# learner there would try to listen on the port this process's group already holds.
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class Procs:
    """Real processes started by a test; whatever is left is killed (whole session) at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(
        self, args: list[str], log: Path, *, launcher: tuple[str, ...] = (), **kw
    ) -> subprocess.Popen:
        """`python [launcher...] -m deploy.cli args...`: launcher is e.g. torchrun's module+flags."""
        out = open(log, "ab")  # noqa: SIM115 (owned by the process)
        inherited = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
        env = {**inherited, "PYTHONUNBUFFERED": "1", **kw.pop("env", {})}
        proc = spawn(
            [sys.executable, *launcher, "-m", "deploy.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            **kw,
        )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.close()


def smoke_args(
    tmp_path: Path, tiny_model: Path, port: int, *extra: str, config: str = "configs/smoke.yaml"
) -> list[str]:
    """`asyncppo up` on `config` (the smoke run unless said) with its own endpoint, model and run
    dir (tmp_path/run)."""
    endpoint = f"tcp://127.0.0.1:{port}"
    return [
        "up",
        "--config",
        config,
        "--set",
        f"broker.bind={endpoint}",
        "--set",
        f"actor.broker={endpoint}",
        "--set",
        f"learner.broker={endpoint}",
        "--set",
        f"model.path={tiny_model}",
        "--set",
        f"run.out_dir={tmp_path / 'run'}",
        *extra,
    ]


@pytest.fixture(scope="module")
def single_process_group():
    """The env DeepSpeed reads for a world of one, set for the using module only (subprocesses
    started by other tests must not inherit it); one thread, since the machine is shared. The
    process group the first learner creates lives until the session ends: DeepSpeed keeps it, so
    destroying it would break the next module's learners."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as env:
        for key, value in {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }.items():
            env.setenv(key, value)
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def _destroy_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _logging_back_to_defaults():
    """A test that configures a role's logging binds it to that test's captured stderr, which
    pytest closes afterwards: every later log line would fail. Each test starts from defaults."""
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


# Programs that libraries run to probe the machine (DeepSpeed's numactl and its compiler checks,
# bench/record.py's git): not processes a test starts.
LIBRARY_PROBES = {"numactl", "gcc", "cc", "git", "lscpu", "ldconfig", "uname"}


@pytest.fixture(autouse=True)
def _a_test_that_starts_processes_is_marked_system(request, monkeypatch):
    """`-m "not slow and not system"` (`make test-unit`) must be the in-process suite: a test
    it selects (or a fixture of its own) that starts a process fails and says so. Slow tests
    (experiments, soak, the demo) all start processes and are never in that suite. Processes
    started by a module- or session-scoped fixture are not seen here; such modules carry the
    marker."""
    if any(request.node.get_closest_marker(m) is not None for m in ("system", "slow")):
        yield
        return
    started: list[str] = []
    popen_init, mp_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def popen(self, args, *a, **kw):
        program = Path(args[0] if isinstance(args, list | tuple) else str(args).split()[0]).name
        if program not in LIBRARY_PROBES:
            started.append(str(args))
        popen_init(self, args, *a, **kw)

    def mp(self):
        started.append(f"multiprocessing {self.name}")
        mp_start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", mp)
    yield
    assert not started, f"starts {started[:3]}: mark the test @pytest.mark.system"
