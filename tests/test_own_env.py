"""Bring your own environment: `actor.env` as an import path, checked, and trained on end to end
(the example package in examples/guess_env), and an environment that fails mid-episode costs
that episode, never the actor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT, free_port, smoke_args

from actors.envs import Environment, make_env

EXAMPLE = ROOT / "examples" / "guess_env"


@pytest.fixture
def importable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The example package and a scratch module directory on sys.path."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def write_module(where: Path, name: str, source: str) -> None:
    (where / f"{name}.py").write_text(textwrap.dedent(source))


def test_an_import_path_builds_an_environment_with_its_kwargs(importable: Path) -> None:
    env = make_env("guess_env:make_env", high=8, max_turns=3)
    assert isinstance(env, Environment) and env.name == "guess"
    first = env.reset(5)
    assert "from 1 to 8" in first and "Turn 1 of 3" in first
    result = env.step("4")
    assert result.terminated or result.observation.startswith(("Higher", "Lower"))


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("nosuch_pkg.tasks:make", r"cannot import module 'nosuch_pkg.tasks': ModuleNotFoundError"),
        ("broken_env:make", r"cannot import module 'broken_env': ZeroDivisionError"),
        ("plain_env:missing", r"module 'plain_env' has no attribute 'missing'"),
        ("plain_env:NOT_CALLABLE", r"'NOT_CALLABLE' is not callable"),
        ("chess", r"unknown environment 'chess'; known: .*or an import path"),
        ("plain_env:", r"unknown environment 'plain_env:'"),
    ],
)
def test_a_bad_import_path_is_named_in_the_error(importable: Path, path: str, message: str) -> None:
    write_module(importable, "broken_env", "1 / 0\n")
    write_module(importable, "plain_env", "NOT_CALLABLE = 3\n")
    with pytest.raises(ValueError, match=message):
        make_env(path)


def test_an_object_that_is_not_an_environment_is_refused_naming_what_it_lacks(
    importable: Path,
) -> None:
    write_module(
        importable,
        "half_env",
        """
        class Half:
            name = "half"
            max_new_tokens = 0
            stop = "\\n"
            def reset(self, seed): return "go"
            step = None

        def make(): return Half()
        def lacking(): return object()
        def strict(size: int = 3): return Half()
        """,
    )
    with pytest.raises(
        TypeError, match=r"missing name, max_new_tokens, stop, reset, step, compact"
    ):
        make_env("half_env:lacking")
    with pytest.raises(TypeError, match=r"missing compact"):
        make_env("half_env:make")
    with pytest.raises(
        TypeError,
        match=r"^actor.env_kwargs: environment 'half_env:strict' \(half_env:strict\) takes no "
        r"argument\(s\) colour; it accepts: size",
    ):
        make_env("half_env:strict", colour="red")


@pytest.mark.system
def test_the_cli_refuses_a_bad_env_before_starting_anything(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "up", "--config", "configs/smoke.yaml"]
        + ["--set", "actor.env=nosuch_pkg:make", "--set", f"run.out_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    assert "actor.env: environment 'nosuch_pkg:make': cannot import module" in result.stderr
    assert not (tmp_path / "run" / "logs").exists()
    result = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "up", "--config", "configs/smoke.yaml"]
        + ["--set", "actor.env=maze", "--set", "actor.env_kwargs={turns: 3}"]
        + ["--set", f"run.out_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    assert (
        "actor.env_kwargs: environment 'maze' (actors.envs.maze:MazeEnv) takes no argument(s) "
        "turns; it accepts: max_turns" in result.stderr
    ), result.stderr
    assert not (tmp_path / "run" / "logs").exists()


def run_up(tmp_path: Path, tiny_model: Path, procs, env: str, pythonpath: list[Path]) -> dict:
    summary = tmp_path / "summary.json"
    path = os.pathsep.join([*(str(p) for p in pythonpath), os.environ.get("PYTHONPATH", "")])
    proc = procs.start(
        smoke_args(tmp_path, tiny_model, free_port(), "--set", f"actor.env={env}")
        + ["--summary", str(summary)],
        tmp_path / "up.log",
        env={"PYTHONPATH": path},
    )
    assert proc.wait(timeout=300) == 0, (tmp_path / "up.log").read_text()[-3000:]
    return json.loads(summary.read_text())


@pytest.mark.system
def test_training_runs_end_to_end_on_the_example_package(tmp_path, tiny_model, procs) -> None:
    """examples/guess_env, outside asyncppo, named by import path: real broker, learner and
    actors train on it, and the actors played it (its task name is on every trained step)."""
    s = run_up(tmp_path, tiny_model, procs, "guess_env:make_env", [EXAMPLE])
    assert s["learner_steps"] == 4 and s["trajectories_trained"] == 4 * 8
    assert s["rejected_invalid"] == 0
    actor_log = (tmp_path / "run" / "logs" / "actor-0.log").read_text()
    assert '"env": "guess_env:make_env"' in actor_log


@pytest.mark.system
def test_an_environment_that_fails_mid_episode_costs_the_episode_not_the_actor(
    tmp_path, tiny_model, procs
) -> None:
    """Every third instance raises on its second turn, and every fifth returns a reward that is
    not a number: those episodes are abandoned and counted, their permits freed, and training
    goes on to the end with the actors that started it."""
    write_module(
        tmp_path,
        "flaky_env",
        """
        from actors.envs.base import StepResult
        from guess_env import GuessEnv

        class Flaky(GuessEnv):
            def reset(self, seed):
                self.seed = seed
                return super().reset(seed)

            def step(self, action):
                result = super().step(action)
                if self.seed % 3 == 0 and self._turns == 2:
                    raise RuntimeError("the task server went away")
                if self.seed % 5 == 0:
                    return StepResult(result.observation, "0", result.terminated, False, {})
                return result

        def make(**kwargs):
            return Flaky(max_turns=3)
        """,
    )
    s = run_up(tmp_path, tiny_model, procs, "flaky_env:make", [EXAMPLE, tmp_path])
    assert s["learner_steps"] == 4 and s["actors"] == 2
    logs = [(tmp_path / "run" / "logs" / f"actor-{i}.log").read_text() for i in (0, 1)]
    assert any("the task server went away" in log for log in logs)
    assert any("step returned reward '0', expected a finite number" in log for log in logs)
    assert all("actor stopped" in log for log in logs)
