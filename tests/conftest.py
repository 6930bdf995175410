"""Shared fixtures: free ports, a tiny model built once per session, process cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
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
