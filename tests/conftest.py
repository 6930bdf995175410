"""Shared fixtures: free ports, a tiny model built once per session, process cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.transport import free_port  # noqa: F401 (tests import it from here)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The built-in tiny model, built once through the same path `model.builtin: tiny` takes."""
    from common.model import ensure_model

    path = tmp_path_factory.mktemp("models") / "tiny"
    ensure_model(path, builtin="tiny")
    return path


class Procs:
    """Real processes started by a test; whatever is left is killed (whole session) at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(
        self, args: list[str], log: Path, *, launcher: tuple[str, ...] = (), **kw
    ) -> subprocess.Popen:
        """`python [launcher...] -m deploy.cli args...`: launcher is e.g. torchrun's module+flags."""
        out = open(log, "ab")  # noqa: SIM115 (owned by the process)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **kw.pop("env", {})}
        proc = subprocess.Popen(
            [sys.executable, *launcher, "-m", "deploy.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=True,
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


def smoke_args(tmp_path: Path, tiny_model: Path, port: int, *extra: str) -> list[str]:
    """`asyncppo up` on configs/smoke.yaml with its own endpoint, model and run dir (tmp_path/run)."""
    endpoint = f"tcp://127.0.0.1:{port}"
    return [
        "up",
        "--config",
        "configs/smoke.yaml",
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
