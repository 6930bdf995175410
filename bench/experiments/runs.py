"""One run of an experiment: a real `asyncppo up`, its held-out evaluations, and the record the
report keeps of it; the `Experiment` an experiment module declares, and the starting models'
preparation."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.experiments.stats import cumulative_episodes, final_reward, pipeline_rates
from bench.experiments.tasks import (
    BASE,
    CHAIN,
    CHAIN_VARIANTS,
    FITTED_CRITICS,
    MODEL,
    QUICK_CRITIC,
    ROOT,
    RUNS,
    SMOLLM2,
    WARM_CHAIN_2K_MODEL,
    WARM_CHAIN_MODEL,
)
from common.lifecycle import spawn
from common.transport import free_port
from deploy.launcher import read_jsonl


@dataclass(frozen=True)
class Run:
    """One `asyncppo up` invocation: a labelled configuration and seed."""

    name: str
    labels: dict[str, Any]
    overrides: dict[str, Any]
    seed: int = 0
    actors: int = 2
    wall_s: float = 120.0
    config: str | None = None  # a configs/ YAML under the overrides (default: the built-in config)
    evaluate: bool = False  # score the final policy on the held-out set (`asyncppo eval`)
    # learner steps whose checkpoint's critic is scored on held-out episodes beside the
    # Monte-Carlo value function (`asyncppo eval --checkpoint`)
    critic_steps: tuple[int, ...] = ()


@dataclass
class Result:
    run: Run
    summary: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    returncode: int = 0
    held_out: dict[str, Any] | None = None  # `asyncppo eval` of the final policy
    critic_curve: list[dict[str, Any]] = field(default_factory=list)  # per run.critic_steps
    # the evaluator beside training (eval.every_versions): one held-out score per version
    held_out_curve: list[dict[str, Any]] = field(default_factory=list)
    launched_at: float = 0.0  # time.time() at launch: the origin of the wall-clock axes


SERIES_KEYS = (  # the step-log fields every learner writes, kept per step in a run record
    "reward_mean",
    "tokens",
    "icepop_kept_fraction",
    "importance_weight_mean",
    "importance_weight_max",
    "max_staleness",
    "step_seconds",
    "time",
    "explained_variance",
    "approx_kl",
)


def run_record(res: Result) -> dict[str, Any]:
    """What the JSON keeps of a run: configuration, summary, per-step series and derived metrics."""
    steps = res.steps
    series = {key: [s[key] for s in steps] for key in SERIES_KEYS}
    series.update(  # written by learners since the update statistics landed (issue 14)
        {
            key: [s.get(key) for s in steps]
            for key in ("update_kl", "entropy", "zero_advantage_fraction", "advantage_mean")
        }
    )
    staleness = np.zeros(max((len(s["staleness_histogram"]) for s in steps), default=0), dtype=int)
    for s in steps:
        staleness[: len(s["staleness_histogram"])] += s["staleness_histogram"]
    return {
        "name": res.run.name,
        "labels": res.run.labels,
        "seed": res.run.seed,
        "actors": res.run.actors,
        "overrides": res.run.overrides,
        "returncode": res.returncode,
        "learner_steps": len(steps),
        "summary": res.summary,
        "episodes": cumulative_episodes(steps),
        "series": series,
        "staleness_histogram": staleness.tolist(),
        "final_reward": final_reward(steps),
        "held_out": res.held_out,
        "critic_curve": res.critic_curve,
        "held_out_curve": res.held_out_curve,
        "launched_at": res.launched_at,
        **pipeline_rates(steps),
    }


def override_texts(overrides: dict[str, Any]) -> list[str]:
    """`key=value` for each override; values as JSON, which `--set` parses as YAML (a superset)."""
    return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]


def override_args(overrides: dict[str, Any]) -> list[str]:
    """`--set key=value` pairs for a command line."""
    return [a for text in override_texts(overrides) for a in ("--set", text)]


def launch(run: Run, experiment: str) -> Result:
    """One real `asyncppo up` in a fresh run dir on a free port; returns its summary and step log."""
    run_dir = RUNS / experiment / run.name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    overrides = {
        **BASE,
        **run.overrides,
        "broker.bind": endpoint,
        "actor.broker": endpoint,
        "learner.broker": endpoint,
        "actor.seed": run.seed,
        "learner.seed": run.seed,
        "run.out_dir": str(run_dir.relative_to(ROOT)),
        "run.max_wall_s": run.wall_s,
        **({"learner.export_dir": str(run_dir / "export")} if run.evaluate else {}),
        **({"learner.checkpoint_every": math.gcd(*run.critic_steps)} if run.critic_steps else {}),
    }
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "up",
        "--actors",
        str(run.actors),
        "--summary",
        str(run_dir / "summary.json"),
        *(["--config", run.config] if run.config else []),
        *override_args(overrides),
    ]
    # one thread per process: on 2 cores, torch's default thread pools oversubscribe
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t0, launched_at = time.monotonic(), time.time()
    with open(run_dir / "up.log", "wb") as out:
        proc = spawn(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            # the cap plus time for startup and an orderly shutdown
            code = proc.wait(timeout=run.wall_s + 180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            code = proc.wait()
    summary_path, steps_path = run_dir / "summary.json", run_dir / "learner_steps.jsonl"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    steps = (
        [json.loads(line) for line in steps_path.read_text().splitlines() if line.strip()]
        if steps_path.exists()
        else []
    )
    held_out = (
        {
            "start": start_eval(overrides, run_dir, run.config),
            "final": held_out_eval(
                ["--model", str(run_dir / "export")], overrides, run_dir / "eval.json", run.config
            ),
        }
        if run.evaluate and (run_dir / "export" / "config.json").exists()
        else None
    )
    critic_curve = [
        {"step": step}
        | held_out_eval(
            ["--checkpoint", str(run_dir / "checkpoints"), "--tag", f"step{step}"],
            overrides,
            run_dir / f"eval_critic_step{step}.json",
            run.config,
        )
        for step in run.critic_steps
        if (run_dir / "checkpoints" / "policy" / f"step{step}").is_dir()
    ]
    held_out_curve = [  # seconds: since the run was launched (wall clock)
        {k: e[k] for k in ("version", "success", "success_ci95", "episodes")}
        | {"seconds": round(e["time"] - launched_at, 1)}
        for e in read_jsonl(run_dir / "eval.jsonl")
    ]
    print(
        f"[{experiment}] {run.name}: {len(steps)} steps, final reward {final_reward(steps):.3f}, "
        + (
            f"held-out success {held_out['start']['success']:.3f} -> "
            f"{held_out['final']['success']:.3f}, "
            if held_out
            else ""
        )
        + f"{time.monotonic() - t0:.0f}s, rc {code}",
        flush=True,
    )
    return Result(run, summary, steps, code, held_out, critic_curve, held_out_curve, launched_at)


_START_EVALS: dict[str, dict[str, Any]] = {}


def start_eval(overrides: dict[str, Any], run_dir: Path, config: str | None) -> dict[str, Any]:
    """The held-out score of the starting model on the run's task, once per task and model
    (every arm of a task starts from the same one)."""
    keys = ("model.path", "actor.env", "actor.env_kwargs", "actor.max_turns", "eval.episodes")
    key = json.dumps([overrides.get(k) for k in keys], sort_keys=True)
    if key not in _START_EVALS:
        _START_EVALS[key] = held_out_eval(
            ["--model", overrides["model.path"]], overrides, run_dir / "eval_start.json", config
        )
    return _START_EVALS[key]


def held_out_eval(
    policy: list[str], overrides: dict[str, Any], out: Path, config: str | None = None
) -> dict[str, Any]:
    """`asyncppo eval` of `policy` (``--model DIR`` or ``--checkpoint DIR --tag T``) on the run's
    environment: the held-out set, never trained on."""
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "eval",
        *policy,
        "--out",
        str(out),
        *(["--config", config] if config else []),
        *override_args({**overrides, "run.log_format": "json"}),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, cwd=ROOT, check=True, env=env, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    return {k: v for k, v in result.items() if k != "records"}


def chain_run(
    name: str, labels: dict[str, Any], quick: bool, seed: int, steps: int, **overrides: Any
) -> Run:
    """One run on the chain (CHAIN + `overrides`), scored on the held-out set before and after."""
    return Run(
        name,
        labels,
        {
            **CHAIN,
            "learner.total_steps": 15 if quick else steps,
            "eval.episodes": 48 if quick else 96,
            **overrides,
        },
        seed,
        wall_s=600 if quick else 1500,
        evaluate=True,
    )


@dataclass(frozen=True)
class Experiment:
    make_runs: Callable[[bool, int], list[Run]]
    summarize: Callable[[list[dict]], dict[str, Any]]
    plot: Callable[[list[dict], list[Any]], None]
    panels: int
    default_seeds: int
    claim: str
    model: str = MODEL
    # builds or checks a starting model before the runs (given --quick)
    prepare: Callable[[bool], None] | None = None


def warm_model(env: str, out: str) -> Callable[[bool], None]:
    """`asyncppo model warmup` for `env` in its own process (reused when `out` holds the same
    recipe)."""

    def prepare(quick: bool) -> None:
        cmd = [sys.executable, "-m", "deploy.cli", "model", "warmup", env, "--out", out]
        subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    return prepare


def long_context_copy(quick: bool) -> None:
    """The chain's warm model, then WARM_CHAIN_2K_MODEL: its files with max_position_embeddings
    2048. The same weights: Llama's rotary embeddings encode positions relative to each other,
    with no table to grow (a model type with one is refused)."""
    warm_model("chain", WARM_CHAIN_MODEL)(quick)
    src, dst = ROOT / WARM_CHAIN_MODEL, ROOT / WARM_CHAIN_2K_MODEL
    config = json.loads((src / "config.json").read_text())
    if config["model_type"] != "llama":
        raise SystemExit(f"{src}: model_type {config['model_type']!r} is not llama (rotary)")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))


def fitted_critic(quick: bool, critics: dict[str, tuple[int, int, int]] = FITTED_CRITICS) -> None:
    """The chain's warm model, then `asyncppo critic` on its early-termination episodes with the
    critic arms' settings, once per size of `critics` (reused when the directory holds the
    same recipe); --quick fits one small one (every quick arm's critic_init is rewritten to it)."""
    warm_model("chain", WARM_CHAIN_MODEL)(quick)
    overrides = {
        **CHAIN,
        "actor.env_kwargs": CHAIN_VARIANTS["early"],
        "eval.episodes": 48 if quick else 96,
    }
    for out, sizes in [QUICK_CRITIC] if quick else critics.items():
        size = [f"--{k}={v}" for k, v in zip(("instances", "plays", "steps"), sizes, strict=True)]
        cmd = [sys.executable, "-m", "deploy.cli", "critic", *override_args(overrides), *size]
        subprocess.run([*cmd, "--out", out], cwd=ROOT, check=True)


def require_smollm2(quick: bool) -> None:
    if not (ROOT / SMOLLM2 / "config.json").exists():
        raise SystemExit(f"{SMOLLM2} is missing: run `make smollm2` first")
