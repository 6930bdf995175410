"""Experiments that reproduce the seed claims at small scale, on real `asyncppo up` runs.

Each experiment starts broker, learner and actors as real processes (one `asyncppo up` per
configuration and seed, its own port and run dir under runs/experiments/), reads the learner's
step log (`learner_steps.jsonl`) and the run summary, and writes JSON and a PNG plot to
runs/bench/ or --out (`<name>.json`/`.png`; `<name>_quick.*` for --quick).

    python -m bench.experiments long_horizon [--quick] [--seeds N]  # PPO vs GRPO on chain, held-out
    python -m bench.experiments cut_bootstrap [--quick] [--seeds N] # compaction cuts: critic vs 0
    python -m bench.experiments critic [--quick] [--seeds N]        # which critic explains the return
    python -m bench.experiments ppo_vs_grpo [--quick] [--seeds N]   # critic PPO vs GRPO, maze + digits
    python -m bench.experiments icepop      [--quick] [--seeds N]   # bf16 sampling, fp32 training
    python -m bench.experiments icepop_smollm2 [--quick]             # the same on SmolLM2-135M (make smollm2)
    python -m bench.experiments staleness   [--quick] [--seeds N]   # max_staleness 0..8, icepop vs none
    python -m bench.experiments async       [--quick] [--seeds N]   # max_staleness 4 vs 0, torch + simulated
    python -m bench.experiments asynchrony  [--quick] [--seeds N]   # η 0/4/8 x (ours, no weight, naive) on chain, held out
    python -m bench.experiments credit      [--quick] [--seeds N]   # token- vs turn-level GAE on chain, pre-fitted critic

A Makefile target would be `for e in ppo_vs_grpo icepop staleness async; do $(PY) -m
bench.experiments $$e; done`. --quick finishes in a few minutes per experiment (what the slow
tests run); the full settings take tens of minutes on 2 CPU cores. --max-wall caps every run.
--reuse takes the runs the existing report already holds from it: `--seeds 5 --reuse` after a
3-seed report runs only seeds 3 and 4.

Measures, per run (from the step log):
* reward / success rate per step against cumulative episodes trained (environment samples);
* final reward = mean episode reward over the last quarter of the episodes trained;
* trained tokens/s = Σ tokens of steps 2..n / (time_n − time_1) (the first step's wait is excluded);
* learner idle fraction = Σ (time_i − time_{i−1} − step_seconds_i) / (time_n − time_1): the share of
  wall time the learner was not inside a training step (waiting for a batch, plus publishing,
  which takes milliseconds for the tiny model).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.record import SCRATCH, write_report
from common.lifecycle import spawn
from common.transport import free_port
from deploy.launcher import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "experiments"
MODEL = "runs/models/tiny"  # the built-in random-init model: the same starting point for every run
SMOLLM2 = "runs/models/smollm2-135m-instruct"  # `make smollm2` prepares it
WARM_MAZE_MODEL = "runs/models/tiny-maze-warm"  # `asyncppo model warmup maze` builds it
WARM_CHAIN_MODEL = "runs/models/tiny-chain-warm"  # `asyncppo model warmup chain` builds it
# `asyncppo critic` on the warm chain model's early-termination episodes (fitted_critic): its
# directory -> (instances, plays, steps); the second plays 4x the instances for 4x the steps
WARM_CHAIN_CRITIC = "runs/models/tiny-chain-warm-critic"
WARM_CHAIN_CRITIC_12K = "runs/models/tiny-chain-warm-critic-12k"
FITTED_CRITICS = {WARM_CHAIN_CRITIC: (400, 8, 300), WARM_CHAIN_CRITIC_12K: (1600, 8, 1200)}
QUICK_CRITIC = ("runs/models/tiny-chain-warm-critic-quick", (40, 4, 50))
# The warm chain model's weights with 2,048 positions: a 50-turn episode without compaction is
# ~1,400 tokens (long_context_copy)
WARM_CHAIN_2K_MODEL = "runs/models/tiny-chain-warm-2k"

BASE = {
    "model.path": MODEL,
    "model.builtin": "tiny",
    "learner.zero_stage": 1,
    "learner.checkpoint_every": 0,
    "run.metrics_base_port": 0,
    "run.log_format": "json",
}
DIGITS = {
    "actor.env": "digits",
    "actor.permits_per_request": 8,
    "learner.batch_size": 32,
    "learner.lr": 3e-3,
    "learner.critic_lr": 3e-3,
    "learner.ppo_epochs": 2,
}


def maze(max_turns: int) -> dict[str, Any]:
    """2..max_turns turns (log-uniform), sparse 0/1 reward, compaction past 384 context tokens.

    The random-init tiny model almost never emits a valid move: use it for pipeline throughput,
    and MAZE_LEARNING (a warmed start) where learning is measured.
    """
    return {
        "actor.env": "maze",
        "actor.env_kwargs": {"max_turns": max_turns},
        "actor.max_turns": max_turns,
        "actor.context_budget_tokens": 384,
        "actor.permits_per_request": 4,
        "learner.batch_size": 16,
        "learner.lr": 3e-3,
        "learner.critic_lr": 3e-3,
        "learner.ppo_epochs": 1,
    }


# The long-horizon comparison: 2-50 turn mazes (the spec's horizon), a hint with the next optimal
# move on every turn, 2 tokens per action (a move letter and the end of turn), started from the
# warmed tiny model of deploy/warmup.py (a partial instruction follower). What RL must
# learn is to follow the hint on every turn of a long episode rewarded only at its end.
MAZE_LEARNING = {
    **maze(50),
    "actor.env_kwargs": {"max_turns": 50, "hint_max_turns": 50, "action_tokens": 2},
    "model.path": WARM_MAZE_MODEL,
    "model.builtin": None,
    "learner.lr": 3e-4,  # 1e-3 drifted the warmed model off the hint within 25 steps
    "learner.critic_warmup_steps": 2,
}


# The long-horizon testbed (actors/envs/chain.py): N log-uniform in 2-50 right answers, reward
# only after the N-th, compaction past 384 context tokens (one to about ten segments an episode),
# from the chain warm start of deploy/warmup.py (it copies the hint on ~85% of turns: held-out
# success ~0.3, most short instances and few long ones).
# Every arm: 32 episodes a step in groups of 8 (GRPO's groups; PPO gets the same instance
# stream), advantages centred over the batch's action tokens, the same steps, so the same
# episodes; generated tokens are reported per run.
CHAIN = {
    "actor.env": "chain",
    "actor.max_turns": 100,
    "actor.context_budget_tokens": 384,
    "actor.permits_per_request": 8,
    "actor.group_size": 8,
    "learner.batch_size": 32,
    "model.path": WARM_CHAIN_MODEL,
    "model.builtin": None,
    "learner.lr": 3e-4,
    "learner.critic_lr": 1e-3,
    "learner.advantage_norm": "centre",
    "broker.max_staleness": 1,
}
CHAIN_VARIANTS = {  # name -> environment arguments
    "early": {"max_turns": 50, "early_termination": True},
    # A wrong answer costs a turn of a budget of N + 10%: the warm start's ~15% wrong answers
    # exhaust it on long instances (at the default 50% slack it starts at ~0.97, nothing to learn).
    "no-early": {"max_turns": 50, "early_termination": False, "slack": 0.1},
    "coin-flip": {"max_turns": 50, "early_termination": True, "coin_flip": True},
    "short": {"min_turns": 1, "max_turns": 3, "early_termination": True},
}


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


# ---------------------------------------------------------------------------- metrics (pure)
def cumulative_episodes(steps: list[dict]) -> list[int]:
    """x axis of the sample-efficiency curves: episodes trained after each step."""
    return np.cumsum([s["episodes"] for s in steps]).tolist()


def final_reward(steps: list[dict], fraction: float = 0.25) -> float:
    """Mean episode reward over the last `fraction` of all episodes trained."""
    rewards = [r for s in steps for r in s["episode_rewards"]]
    if not rewards:
        return float("nan")
    k = max(1, round(len(rewards) * fraction))
    return float(np.mean(rewards[-k:]))


def pipeline_rates(steps: list[dict]) -> dict[str, float]:
    """Trained tokens/s and learner idle fraction between the first and the last step.

    tokens/s = Σ_{i≥2} tokens_i / (t_n − t_1);  idle = Σ_{i≥2} (t_i − t_{i−1} − step_seconds_i) / (t_n − t_1)
    """
    if len(steps) < 2:
        return {
            "tokens_per_second": float("nan"),
            "idle_fraction": float("nan"),
            "episodes_per_second": float("nan"),
        }
    span = steps[-1]["time"] - steps[0]["time"]
    idle = sum(
        b["time"] - a["time"] - b["step_seconds"] for a, b in zip(steps, steps[1:], strict=False)
    )
    return {
        "tokens_per_second": sum(s["tokens"] for s in steps[1:]) / span,
        "episodes_per_second": sum(s["episodes"] for s in steps[1:]) / span,
        "idle_fraction": max(0.0, idle) / span,
    }


def mean_std(values: list[float]) -> dict[str, float]:
    arr = np.asarray([v for v in values if np.isfinite(v)], dtype=float)
    if arr.size == 0:
        return {"mean": float("nan"), "std": float("nan"), "n": 0}
    return {"mean": float(arr.mean()), "std": float(arr.std()), "n": int(arr.size)}


def smooth(ys: list[float], window: int = 3) -> np.ndarray:
    """Trailing moving average (the first points average what exists so far)."""
    ys = np.asarray(ys, dtype=float)
    csum = np.cumsum(np.insert(ys, 0, 0.0))
    idx = np.arange(1, len(ys) + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def seed_curves(runs: list[dict], y_key: str, window: int) -> tuple[list[dict], np.ndarray]:
    """The runs that trained at least one step, and their smoothed `y_key` series stacked into
    [seeds, steps], cut to the shortest run so that the seeds share one x axis."""
    runs = [r for r in runs if r["learner_steps"]]
    if not runs:
        return runs, np.empty((0, 0))
    n = min(r["learner_steps"] for r in runs)
    return runs, np.stack([smooth(r["series"][y_key][:n], window) for r in runs])


def episodes_to_reach(runs: list[dict], level: float, window: int = 5) -> int | None:
    """Sample efficiency: the episodes trained when the seed-mean success curve (trailing average
    of `window` steps) first reaches `level`; None if it never does.

    The runs of one arm train the same number of episodes per step, so their curves share an x
    axis; it is cut to the shortest run.
    """
    runs, ys = seed_curves(runs, "reward_mean", window)
    if not runs:
        return None
    reached = np.flatnonzero(ys.mean(0) >= level)
    return int(runs[0]["episodes"][reached[0]]) if reached.size else None


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


# ------------------------------------------------------------------------------ running
def override_args(overrides: dict[str, Any]) -> list[str]:
    """`--set key=value` pairs; values as JSON, which `--set` parses as YAML (a superset)."""
    return [a for k, v in overrides.items() for a in ("--set", f"{k}={json.dumps(v)}")]


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


# ---------------------------------------------------------------------------- experiments
def ppo_vs_grpo_runs(quick: bool, seeds: int) -> list[Run]:
    """Same model, group size, batch and step budget; only the advantage estimator differs.

    Long horizon: the 2-50 turn maze from a warmed start (MAZE_LEARNING, ~8 s a step on
    2 cores); short: the single-turn digits task from the random-init model.
    """
    runs = []
    tasks = (("maze", MAZE_LEARNING, 12 if quick else 40), ("digits", DIGITS, 15 if quick else 40))
    for task, base, steps in tasks:
        for algo in ("ppo", "grpo"):
            for seed in range(seeds):
                over = {
                    **base,
                    "actor.group_size": 4,
                    "learner.algorithm": algo,
                    "learner.total_steps": steps,
                    "broker.max_staleness": 1,
                }
                runs.append(
                    Run(
                        f"{task}-{algo}-s{seed}",
                        {"task": task, "algorithm": algo},
                        over,
                        seed,
                        wall_s=(180 if quick else 600)
                        if task == "maze"
                        else (90 if quick else 300),
                    )
                )
    return runs


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


def long_horizon_runs(quick: bool, seeds: int) -> list[Run]:
    """Critic PPO vs GRPO on the chain, with and without early termination, at equal steps and
    episodes; each scored on the held-out set before and after. Controls (seed 0 only): a
    coin-flip reward (must not learn) and the 1-3 turn short twin."""
    return [
        chain_run(
            f"{variant}-{algo}-s{seed}",
            {"task": variant, "algorithm": algo},
            quick,
            seed,
            # Without early termination an episode plays up to 75 turns (~5 s a step on 2 cores,
            # against ~1.3 s): fewer steps there, the same for both methods.
            60 if variant == "no-early" else 120,
            **{
                "actor.env_kwargs": env_kwargs,
                "learner.algorithm": algo,
                **({"eval.horizon_buckets": [1, 3]} if variant == "short" else {}),
            },
        )
        for variant, env_kwargs in CHAIN_VARIANTS.items()
        for algo in ("ppo", "grpo")
        for seed in range(1 if variant in ("coin-flip", "short") else seeds)
    ]


# cut_bootstrap's arms: label -> learner/actor overrides
CUT_MODES = {
    "cut -> critic": {"learner.cut_bootstrap": "critic"},  # ours
    "cut -> zero": {"learner.cut_bootstrap": "zero"},  # slime's choice
    # every episode one segment: the same weights with room for a whole episode, and a context
    # budget no episode reaches
    "no compaction": {"model.path": WARM_CHAIN_2K_MODEL, "actor.context_budget_tokens": 2048},
}


def cut_bootstrap_runs(quick: bool, seeds: int) -> list[Run]:
    """Critic PPO on the chain (early termination): a compaction cut bootstraps from the critic's
    value at the next segment (ours) or ends the segment's return at 0 (slime's choice), or the
    context is never compacted."""
    return [
        chain_run(
            f"{label.removeprefix('cut -> ').replace(' ', '-')}-s{seed}",
            {"task": "early", "algorithm": f"ppo, {label}"},
            quick,
            seed,
            120,
            **{"actor.env_kwargs": CHAIN_VARIANTS["early"], "learner.algorithm": "ppo", **extra},
        )
        for label, extra in CUT_MODES.items()
        for seed in range(seeds)
    ]


FAST_CRITIC_G1 = {"actor.group_size": 1, "learner.critic_lr": 3e-3, "learner.critic_updates": 8}
CRITICS = {  # label -> (run name prefix, learner overrides); "separate" is long_horizon's PPO
    "separate": ("separate", {}),
    "shared": ("shared", {"learner.critic": "shared"}),
    # 4 updates a step at a higher lr, after 10 steps that train only the critic (the name is the
    # one docs/results/critic.json records)
    "separate, lr 3e-3 x4, 10 critic-only steps": (
        "separate-fast",
        {
            "learner.critic_lr": 3e-3,
            "learner.critic_updates": 4,
            "learner.critic_warmup_steps": 10,
        },
    ),
    # 32 instances a step instead of 4 x 8 plays (a 30-step probe: the critic generalises from
    # more instances), 8 updates a step, and a warm-up of 20 critic-only steps ...
    "separate, groups of 1, lr 3e-3 x8, 20 critic-only steps": (
        "separate-g1",
        {**FAST_CRITIC_G1, "learner.critic_warmup_steps": 20},
    ),
    # ... or one that ends once the critic's explained variance on fresh batches averages 0.25
    # over 5 steps (at most 30 steps) ...
    "separate, groups of 1, lr 3e-3 x8, critic-only until EV 0.25": (
        "separate-g1-ev",
        {**FAST_CRITIC_G1, "learner.critic_warmup_steps": 30, "learner.critic_warmup_ev": 0.25},
    ),
    # ... or none: the critic starts fitted to the warm policy's own episodes (`asyncppo critic`,
    # 400 instances x 8 plays: 3,200 episodes, 29k generated tokens, before step 0; a run trains on
    # 3,840 episodes), and a lower lr keeps that fit (at 3e-3 x8 one seed fell to 0.51 / 0.25 / 0.31
    # of the value function at steps 10 / 20 / 30)
    "separate, groups of 1, lr 3e-4 x8, pre-trained on the warm policy": (
        "separate-g1-init",
        {
            **FAST_CRITIC_G1,
            "learner.critic_lr": 3e-4,
            "learner.critic_init": WARM_CHAIN_CRITIC,
        },
    ),
    # ... fitted to 4x the episodes (12,800: the fit's held-out EV still rose at 3,200), and with
    # its 8 updates a step drawn from the last 8 batches instead of repeating this step's one
    "separate, groups of 1, lr 3e-4 x8 over the last 8 batches, pre-trained on 12,800 episodes": (
        "separate-g1-init12k-replay8",
        {
            **FAST_CRITIC_G1,
            "learner.critic_lr": 3e-4,
            "learner.critic_replay": 8,
            "learner.critic_init": WARM_CHAIN_CRITIC_12K,
        },
    ),
}


# Steps whose checkpoint's critic the critic experiment scores on held-out episodes (the target:
# >= 0.8 of V^π's explained variance before step 30).
CRITIC_STEPS = (10, 20, 30, 60, 120)


def critic_runs(quick: bool, seeds: int) -> list[Run]:
    """Critic PPO on the chain (early termination) with three critics: does any explain the
    return (explained variance, in training and on held-out episodes beside the value
    function's), and does that buy held-out success?"""
    return [
        dataclasses.replace(
            chain_run(
                f"{prefix}-s{seed}",
                {"task": "early", "algorithm": f"ppo, {label}"},
                quick,
                seed,
                120,
                **{
                    "actor.env_kwargs": CHAIN_VARIANTS["early"],
                    "learner.algorithm": "ppo",
                    **extra,
                    **(
                        {"learner.critic_init": QUICK_CRITIC[0]}
                        if quick and "learner.critic_init" in extra
                        else {}
                    ),
                },
            ),
            critic_steps=(5, 10, 15) if quick else CRITIC_STEPS,
        )
        for label, (prefix, extra) in CRITICS.items()
        for seed in range(seeds)
    ]


def seed_interval(values: list[float]) -> dict[str, Any]:
    """Mean over seeds with a 95% t-interval (none from one seed)."""
    t95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365}
    n, mean = len(values), float(np.mean(values)) if values else float("nan")
    if n < 2:
        return {"mean": mean, "ci95": None, "seeds": n, "values": values}
    half = t95.get(n, 1.96) * float(np.std(values, ddof=1)) / np.sqrt(n)
    return {"mean": mean, "ci95": [mean - half, mean + half], "seeds": n, "values": values}


def summarize_long_horizon(records: list[dict]) -> dict[str, Any]:
    """Per arm: held-out success at the start and the end (mean over seeds, 95% t-interval),
    its change, per horizon bucket, the training reward's variance, the critic's explained
    variance at the end, GRPO's share of tied (zero-advantage) tokens, and tokens generated."""
    out: dict[str, Any] = {}
    for (task, algo), rs in groups(records, "task", "algorithm").items():
        rs = [r for r in rs if r["held_out"]]
        if not rs:
            continue
        final = [r["held_out"]["final"] for r in rs]
        start = rs[0]["held_out"]["start"]
        last = lambda r, key: [x for x in r["series"][key][-10:] if x is not None]  # noqa: E731
        out[f"{task}/{algo}"] = {
            "held_out_start": {"success": start["success"], "ci95": start["success_ci95"]},
            "held_out_final": seed_interval([f["success"] for f in final]),
            "gain": seed_interval([f["success"] - start["success"] for f in final]),
            "final_by_horizon": {
                b: seed_interval([f["buckets"][b]["success"] for f in final if b in f["buckets"]])
                for b in final[0]["buckets"]
            },
            "start_by_horizon": {b: v["success"] for b, v in start["buckets"].items()},
            "training_reward_variance": seed_interval(
                [float(np.var(r["series"]["reward_mean"])) for r in rs]
            ),
            "explained_variance_last10": seed_interval(
                [float(np.mean(last(r, "explained_variance"))) for r in rs]
            ),
            "zero_advantage_fraction": seed_interval(
                [
                    float(
                        np.mean(
                            [x for x in r["series"]["zero_advantage_fraction"] if x is not None]
                            or [float("nan")]
                        )
                    )
                    for r in rs
                ]
            ),
            "action_tokens_trained": seed_interval([float(sum(r["series"]["tokens"])) for r in rs]),
            "segments_per_episode": seed_interval(  # what compaction made of an episode
                [
                    r["summary"]["trajectories_trained"] / r["summary"]["episodes_trained"]
                    for r in rs
                    if r["summary"].get("episodes_trained")
                ]
            ),
        }
    return out


# summary name -> the key of `asyncppo eval --checkpoint`'s critic record
CRITIC_SCORES = {
    "critic_ev": "critic_explained_variance",
    "value_function_ev": "value_function_explained_variance",
    "fraction": "critic_fraction_of_value_function",
    "exact_value_function_ev": "exact_value_function_explained_variance",
    "fraction_of_exact": "critic_fraction_of_exact_value_function",
}


def critic_curve_intervals(curves: list[list[dict]]) -> dict[int, dict[str, Any]]:
    """Per scored step of some seeds' critic curves, each of CRITIC_SCORES as a mean over seeds
    with its 95% t-interval (a ratio is left out where its denominator explained nothing)."""
    by_step: dict[int, list[dict]] = {}
    for curve in curves:
        for point in curve:
            by_step.setdefault(point["step"], []).append(point["critic"])
    return {
        step: {
            name: seed_interval([c[key] for c in cs if c.get(key) is not None])
            for name, key in CRITIC_SCORES.items()
        }
        for step, cs in sorted(by_step.items())
    }


def summarize_critic(records: list[dict]) -> dict[str, Any]:
    """``summarize_long_horizon``, and per arm and scored step the critic's held-out explained
    variance, the Monte-Carlo value function's, V^π's (free of the Monte-Carlo estimate's noise;
    records from before it was measured have none) and the critic's ratios to them (mean over
    seeds, 95% t-interval)."""
    out = summarize_long_horizon(records)
    for (task, algo), rs in groups(records, "task", "algorithm").items():
        curves = [r["critic_curve"] for r in rs if r.get("critic_curve")]
        if f"{task}/{algo}" in out and curves:
            out[f"{task}/{algo}"]["held_out_critic"] = critic_curve_intervals(curves)
    return out


def plot_long_horizon(records: list[dict], ax_row: list[Any]) -> None:
    _held_out_bars(summarize_long_horizon(records), ax_row[0])
    for (task, algo), rs in groups(records, "task", "algorithm").items():
        if task in ("early", "no-early"):
            _curves(ax_row[1], rs, f"{task} {algo.upper()}")
    ax_row[1].set(title="training success vs episodes", xlabel="episodes trained", ylabel="reward")
    ax_row[1].legend()


def plot_critic(records: list[dict], ax_row: list[Any]) -> None:
    """Left: each critic's held-out explained variance as a fraction of V^π's by step (95% CI
    over seeds; dashed where an arm was scored before V^π's own was measured: a fraction of its
    noisier Monte-Carlo estimate), the 0.8 target dotted. Right: held-out success."""
    summary = summarize_critic(records)
    ax = ax_row[0]
    for i, (arm, s) in enumerate(sorted(summary.items())):
        curve = s.get("held_out_critic") or {}
        steps = sorted(curve)
        exact = all(curve[k]["fraction_of_exact"]["seeds"] for k in steps)
        points = [curve[k]["fraction_of_exact" if exact else "fraction"] for k in steps]
        if not points:
            continue
        ax.errorbar(
            [k + 0.8 * i for k in steps],  # side by side at each step
            [p["mean"] for p in points],
            yerr=[
                [p["mean"] - p["ci95"][0] if p["ci95"] else 0.0 for p in points],
                [p["ci95"][1] - p["mean"] if p["ci95"] else 0.0 for p in points],
            ],
            capsize=3,
            linestyle="-" if exact else "--",
            label=arm.split("/", 1)[1].removeprefix("ppo, "),
        )
    ax.axhline(0.8, color="k", linestyle=":", linewidth=1)
    ax.set(
        title="critic's held-out EV / V^pi's (dashed: / its MC estimate)",
        xlabel="learner step",
        ylabel="fraction",
    )
    ax.legend(fontsize=6)
    _held_out_bars(summary, ax_row[1])


def _held_out_bars(summary: dict[str, Any], ax: Any) -> None:
    """Held-out success of each arm after training (95% CI over seeds) and at the start."""
    arms = sorted(summary)
    x = np.arange(len(arms))
    finals = [summary[a]["held_out_final"] for a in arms]
    err = [(f["mean"] - f["ci95"][0]) if f["ci95"] else 0.0 for f in finals]
    ax.bar(x, [f["mean"] for f in finals], 0.6, yerr=err, capsize=3, label="after training")
    ax.scatter(
        x,
        [summary[a]["held_out_start"]["success"] for a in arms],
        color="k",
        zorder=3,
        label="start (warm model)",
    )
    labels = [textwrap.fill(a.replace("/", " / "), 18) for a in arms]
    ax.set_xticks(x, labels, fontsize=8 if len(arms) <= 4 else 6)
    ax.set(title="held-out success (95% CI over seeds)", ylabel="success rate")
    ax.legend()


def mismatch_runs(base: Run, steps: int, seeds: int) -> list[Run]:
    """`base` once per correction and seed: actors sample in bfloat16, the learner trains in
    float32, and staleness 0 isolates that mismatch."""
    return [
        dataclasses.replace(
            base,
            name=f"{corr}-s{seed}",
            labels={"correction": corr},
            overrides={
                **base.overrides,
                "actor.engine_dtype": "bfloat16",
                "model.dtype": "float32",
                "learner.correction": corr,
                "broker.max_staleness": 0,
                "learner.total_steps": steps,
            },
            seed=seed,
        )
        for corr in ("none", "tis", "icepop")
        for seed in range(seeds)
    ]


def icepop_runs(quick: bool, seeds: int) -> list[Run]:
    """The tiny model on digits."""
    return mismatch_runs(
        Run("", {}, DIGITS, wall_s=60 if quick else 180), 15 if quick else 40, seeds
    )


def icepop_smollm2_runs(quick: bool, seeds: int) -> list[Run]:
    """The natural mismatch of a real model: SmolLM2-135M-Instruct on configs/smollm2-arith.yaml
    (1 actor)."""
    base = Run(
        "",
        {},
        {"model.path": SMOLLM2, "model.builtin": None},
        actors=1,
        wall_s=240 if quick else 480,
        config="configs/smollm2-arith.yaml",
    )
    return mismatch_runs(base, 3 if quick else 8, seeds)


def staleness_runs(quick: bool, seeds: int) -> list[Run]:
    """Decoupled PPO + IcePop vs PPO that ignores μ (w = 1), 4 actors so that staleness is reached."""
    steps = 15 if quick else 40
    return [
        Run(
            f"k{k}-{corr}-s{seed}",
            {"max_staleness": k, "correction": corr},
            {
                **DIGITS,
                "broker.max_staleness": k,
                "learner.correction": corr,
                "learner.total_steps": steps,
            },
            seed,
            actors=4,
            wall_s=60 if quick else 180,
        )
        for k in ((0, 4) if quick else (0, 1, 2, 4, 8))
        for corr in ("icepop", "none")
        for seed in range(seeds)
    ]


# Issue 39: how far actors may run ahead (broker.max_staleness, η) against what corrects for it, on
# the early-termination chain, scored on held-out instances while training runs.
ASYNC_ARMS = {  # label -> learner overrides
    "decoupled + IcePop": {"learner.correction": "icepop"},  # ours
    "decoupled, no behavior weight": {"learner.correction": "none"},
    "naive: clip against mu": {"learner.correction": "none", "learner.proximal": "behavior"},
}
ASYNC_BOUNDS = (0, 4, 8)
ASYNC_EVAL_EVERY = 10  # versions between held-out scores


def asynchrony_runs(quick: bool, seeds: int) -> list[Run]:
    """Every arm at every η > 0, and ours at η = 0 (synchronous: μ is π_prox up to the engine's
    rounding, so the arms coincide there), the same steps and episodes each, 3 actors so that
    they can run ahead of the learner. An evaluator scores every 10th version on held-out
    instances beside training (`eval.every_versions`)."""
    return [
        dataclasses.replace(
            chain_run(
                f"eta{k}-{arm.split(':')[0].split(',')[0].replace(' + ', '-').replace(' ', '-')}-s{seed}",
                {"max_staleness": k, "arm": arm},
                quick,
                seed,
                60,
                **{
                    "actor.env_kwargs": CHAIN_VARIANTS["early"],
                    "broker.max_staleness": k,
                    "eval.every_versions": 5 if quick else ASYNC_EVAL_EVERY,
                    "eval.episodes": 48,
                    **overrides,
                },
            ),
            actors=3,
        )
        for k in ASYNC_BOUNDS
        for arm, overrides in ASYNC_ARMS.items()
        if k or arm == "decoupled + IcePop"
        for seed in range(seeds)
    ]


# Issue 39: what one step of GAE is, on the chain with the critic fitted before step 0 (the
# critic experiment's best arm), so that the advantages are not GAE over a weak baseline.
CREDIT_UNITS = ("token", "turn")


def credit_runs(quick: bool, seeds: int) -> list[Run]:
    """Token- against turn-level GAE (`learner.gae_unit`), the same γ = 1 and λ = 0.95, the same
    steps and episodes, held-out success every 10 versions."""
    _, pretrained = CRITICS["separate, groups of 1, lr 3e-4 x8, pre-trained on the warm policy"]
    return [
        chain_run(
            f"{unit}-s{seed}",
            {"gae_unit": unit},
            quick,
            seed,
            60,
            **{
                "actor.env_kwargs": CHAIN_VARIANTS["early"],
                **pretrained,
                **({"learner.critic_init": QUICK_CRITIC[0]} if quick else {}),
                "learner.gae_unit": unit,
                "eval.every_versions": 5 if quick else ASYNC_EVAL_EVERY,
                "eval.episodes": 48,
            },
        )
        for unit in CREDIT_UNITS
        for seed in range(seeds)
    ]


def summarize_credit(records: list[dict]) -> dict[str, Any]:
    """Per unit: held-out success (start, curve, end) and the critic's explained variance over
    the last 10 steps."""
    return {
        unit: held_out_summary(rs)
        | {
            "explained_variance_last10": seed_interval(
                [float(np.nanmean(r["series"]["explained_variance"][-10:])) for r in rs]
            )
        }
        for (unit,), rs in sorted(groups(records, "gae_unit").items())
    }


def plot_credit(records: list[dict], ax_row: list[Any]) -> None:
    for (unit,), rs in sorted(groups(records, "gae_unit").items()):
        _held_out_curves(ax_row[0], ax_row[1], rs, label=f"{unit}-level GAE (n={len(rs)})")
    ax_row[0].legend()


def held_out_at(curve: list[dict], every: int) -> dict[int, float]:
    """A run's held-out success by version, each evaluated version rounded to the grid of
    `every` (the evaluator scores the newest version when it falls behind)."""
    return {every * round(p["version"] / every): p["success"] for p in curve}


def held_out_summary(rs: list[dict]) -> dict[str, Any]:
    """The seeds of one arm on held-out instances: at the start, at the end (95% t-interval) and
    at every version the evaluator beside training scored on every seed."""
    curves = [held_out_at(r["held_out_curve"], ASYNC_EVAL_EVERY) for r in rs]
    versions = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return {
        "held_out_start": rs[0]["held_out"]["start"]["success"] if rs[0]["held_out"] else None,
        "held_out_final": seed_interval(
            [r["held_out"]["final"]["success"] for r in rs if r["held_out"]]
        ),
        "held_out_curve": {v: seed_interval([c[v] for c in curves]) for v in versions},
    }


def summarize_asynchrony(records: list[dict]) -> dict[str, Any]:
    """Per η and arm: held-out success at the end (95% t-interval over seeds) and along the
    curve, the staleness of the trained tokens, throughput per wall second and per CPU second
    of the roles, and the rates the roles' CPU costs imply on dedicated machines."""
    summary: dict[str, Any] = {}
    for (k, arm), rs in sorted(groups(records, "max_staleness", "arm").items()):
        hist = np.sum([np.pad(r["staleness_histogram"], (0, 16))[:16] for r in rs], axis=0)
        cpu = [r["summary"].get("cpu_seconds", {}) for r in rs]
        episodes = [r["summary"]["episodes_trained"] for r in rs]
        per_episode = {  # role CPU seconds per trained episode, mean over seeds
            role: float(
                np.mean([c.get(role, np.nan) / e for c, e in zip(cpu, episodes, strict=True)])
            )
            for role in ("actors", "learner", "broker")
        }
        summary[f"eta {k} / {arm}"] = {
            "max_staleness": k,
            "arm": arm,
            **held_out_summary(rs),
            "trained_token_staleness": (hist / max(hist.sum(), 1)).round(4).tolist(),
            "mean_staleness": float((np.arange(16) * hist).sum() / max(hist.sum(), 1)),
            "episodes_per_second": mean_std([r["episodes_per_second"] for r in rs]),
            "tokens_per_second": mean_std([r["tokens_per_second"] for r in rs]),
            "learner_idle_fraction": mean_std([r["idle_fraction"] for r in rs]),
            "cpu_seconds_per_episode": per_episode,
            # On machines of their own (actors on their own cores, the learner on its own), an
            # episode costs the actors' CPU once and the learner's once: in lockstep the two add,
            # overlapped the slower one sets the pace.
            "dedicated_episodes_per_second_overlapped": 1
            / max(per_episode["actors"], per_episode["learner"]),
            "dedicated_episodes_per_second_lockstep": 1
            / (per_episode["actors"] + per_episode["learner"]),
            "wall_seconds": mean_std([r["summary"]["wall_seconds"] for r in rs]),
        }
    return summary


def async_runs(quick: bool, seeds: int) -> list[Run]:
    """max_staleness 4 vs 0 on the maze (torch engine) and with the simulated engine (pipeline only)."""
    # a simulated actor process holds ~0.2 GB of its own memory (mostly torch's import, ~150 MB);
    # the rest of its ~0.35 GB RSS is shared libraries: 64 of them fit in 23 GB
    sim_actors = 16 if quick else 64
    runs = []
    for k in (0, 4):
        for seed in range(seeds):
            runs.append(
                Run(
                    f"torch-maze-k{k}-s{seed}",
                    {"engine": "torch", "max_staleness": k},
                    {
                        **maze(10 if quick else 20),
                        "broker.max_staleness": k,
                        "learner.total_steps": 6 if quick else 12,
                    },
                    seed,
                    actors=3,
                    wall_s=90 if quick else 240,
                )
            )
            # simulated: each generate call draws a log-normal per-token latency (median 20 ms, σ = 1)
            runs.append(
                Run(
                    f"simulated-k{k}-s{seed}",
                    {"engine": "simulated", "max_staleness": k},
                    {
                        **DIGITS,
                        "actor.engine": "simulated",
                        "broker.max_staleness": k,
                        "actor.permits_per_request": 4,
                        "learner.batch_size": 64,
                        "learner.total_steps": 12 if quick else 30,
                        "broker.heartbeat_timeout_s": 60.0,
                    },
                    seed,
                    actors=sim_actors,
                    wall_s=120 if quick else 240,
                )
            )
    return runs


def groups(records: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in records:
        out.setdefault(tuple(r["labels"][k] for k in keys), []).append(r)
    return out


def summarize_ppo_vs_grpo(records: list[dict]) -> dict[str, Any]:
    out = {}
    arms = groups(records, "task", "algorithm")
    for (task, algo), rs in arms.items():
        out[f"{task}/{algo}"] = {
            "final_reward": mean_std([r["final_reward"] for r in rs]),
            "mean_reward_over_training": mean_std(
                [float(np.mean(r["series"]["reward_mean"])) for r in rs if r["learner_steps"]]
            ),
            "episodes": mean_std([r["episodes"][-1] for r in rs if r["episodes"]]),
        }
    for task in ("maze", "digits"):
        ppo, grpo = out.get(f"{task}/ppo"), out.get(f"{task}/grpo")
        if not (ppo and grpo and grpo["final_reward"]["mean"] > 0):
            continue
        final = grpo["final_reward"]["mean"]
        out[f"{task}/ppo_over_grpo_final"] = ppo["final_reward"]["mean"] / final
        # The claim's "1.8x sample efficiency": episodes each arm needs to cover 90% of GRPO's
        # gain (start -> final). Undefined when GRPO gained nothing: any curve starts "there".
        arm_runs = arms[(task, "ppo")] + arms[(task, "grpo")]
        start = float(np.mean([np.mean(r["series"]["reward_mean"][:5]) for r in arm_runs]))
        if final <= start:
            out[f"{task}/sample_efficiency_ppo_over_grpo"] = (
                f"undefined: GRPO's final {final:.3f} is not above the start {start:.3f}"
            )
            continue
        level = start + 0.9 * (final - start)
        needed = {a: episodes_to_reach(arms[(task, a)], level) for a in ("ppo", "grpo")}
        out[f"{task}/episodes_to_90pct_of_grpo_gain"] = {"start": start, "level": level, **needed}
        if needed["ppo"] and needed["grpo"]:
            out[f"{task}/sample_efficiency_ppo_over_grpo"] = needed["grpo"] / needed["ppo"]
    return out


def summarize_icepop(records: list[dict]) -> dict[str, Any]:
    return {
        corr: {
            "final_reward": mean_std([r["final_reward"] for r in rs]),
            "kept_fraction": mean_std([v for r in rs for v in r["series"]["icepop_kept_fraction"]]),
            "importance_weight_mean": mean_std(
                [v for r in rs for v in r["series"]["importance_weight_mean"]]
            ),
            "importance_weight_max": max(
                (v for r in rs for v in r["series"]["importance_weight_max"]), default=float("nan")
            ),
        }
        for (corr,), rs in groups(records, "correction").items()
    }


def summarize_staleness(records: list[dict]) -> dict[str, Any]:
    return {
        f"k{k}/{corr}": {
            "final_reward": mean_std([r["final_reward"] for r in rs]),
            "tokens_per_second": mean_std([r["tokens_per_second"] for r in rs]),
            "episodes_per_second": mean_std([r["episodes_per_second"] for r in rs]),
            "max_staleness_seen": max(max(r["series"]["max_staleness"], default=0) for r in rs),
            "kept_fraction": mean_std([v for r in rs for v in r["series"]["icepop_kept_fraction"]]),
        }
        for (k, corr), rs in sorted(groups(records, "max_staleness", "correction").items())
    }


def summarize_async(records: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for (engine, k), rs in groups(records, "engine", "max_staleness").items():
        out[f"{engine}/k{k}"] = {
            m: mean_std([r[m] for r in rs])
            for m in ("tokens_per_second", "episodes_per_second", "idle_fraction")
        }
        out[f"{engine}/k{k}"]["actors"] = rs[0]["actors"]
    for engine in ("torch", "simulated"):
        a, s = out.get(f"{engine}/k4"), out.get(f"{engine}/k0")
        if a and s:
            out[f"{engine}/throughput_ratio_async_over_sync"] = (
                a["tokens_per_second"]["mean"] / s["tokens_per_second"]["mean"]
            )
            out[f"{engine}/idle_ratio_async_over_sync"] = (
                a["idle_fraction"]["mean"] / s["idle_fraction"]["mean"]
            )
    return out


# --------------------------------------------------------------------------------- plots
def _curves(
    ax: Any, rs: list[dict], label: str, x_key: str = "episodes", y_key: str = "reward_mean"
) -> None:
    """Mean over seeds (smoothed) with a min-max band, truncated to the shortest run."""
    rs, ys = seed_curves(rs, y_key, window=3)
    if not rs:
        return
    n = ys.shape[1]
    x = np.asarray(rs[0][x_key][:n]) if x_key == "episodes" else np.arange(1, n + 1)
    (line,) = ax.plot(x, ys.mean(0), label=f"{label} (n={len(rs)})")
    if len(rs) > 1:
        ax.fill_between(x, ys.min(0), ys.max(0), alpha=0.2, color=line.get_color())


def plot_ppo_vs_grpo(records: list[dict], ax_row: list[Any]) -> None:
    for ax, task in zip(ax_row, ("maze", "digits"), strict=True):
        for (t, algo), rs in groups(records, "task", "algorithm").items():
            if t == task:
                _curves(ax, rs, algo.upper())
        ax.set(
            title=f"{task}: {'success rate' if task == 'maze' else 'reward'} vs samples",
            xlabel="episodes trained",
            ylabel="success rate" if task == "maze" else "reward",
        )
        ax.legend()


def plot_icepop(records: list[dict], ax_row: list[Any]) -> None:
    for (corr,), rs in groups(records, "correction").items():
        _curves(ax_row[0], rs, corr)
        _curves(ax_row[1], rs, corr, x_key="step", y_key="icepop_kept_fraction")
        _curves(ax_row[2], rs, corr, x_key="step", y_key="importance_weight_max")
    ax_row[0].set(
        title="reward (bf16 sampling, fp32 training)", xlabel="episodes trained", ylabel="reward"
    )
    ax_row[1].set(title="kept-token fraction", xlabel="learner step", ylabel="fraction")
    ax_row[2].set(title="max importance weight π_prox/μ", xlabel="learner step", ylabel="max w")
    for ax in ax_row:
        ax.legend()


def plot_staleness(records: list[dict], ax_row: list[Any]) -> None:
    summary = summarize_staleness(records)
    for corr in ("icepop", "none"):
        ks = sorted({k for (k, c) in groups(records, "max_staleness", "correction") if c == corr})
        for ax, metric in zip(ax_row, ("final_reward", "tokens_per_second"), strict=True):
            ys = [summary[f"k{k}/{corr}"][metric] for k in ks]
            ax.errorbar(
                ks,
                [y["mean"] for y in ys],
                yerr=[y["std"] for y in ys],
                marker="o",
                capsize=3,
                label="decoupled + IcePop" if corr == "icepop" else "naive (ignores μ)",
            )
    ax_row[0].set(
        title="final reward vs max_staleness", xlabel="max_staleness", ylabel="final reward"
    )
    ax_row[1].set(
        title="trained tokens/s vs max_staleness", xlabel="max_staleness", ylabel="tokens/s"
    )
    for ax in ax_row:
        ax.legend()


def _held_out_curves(by_episodes: Any, by_seconds: Any, rs: list[dict], **kw: Any) -> None:
    """One arm's held-out success (mean over seeds) at every version the evaluator scored on
    every seed, against the episodes trained before it and the seconds since launch."""
    curves = [held_out_at(r["held_out_curve"], ASYNC_EVAL_EVERY) for r in rs]
    versions = sorted(set.intersection(*(set(c) for c in curves)))
    ys = [np.mean([c[v] for c in curves]) for v in versions]
    on_grid = lambda p, v: ASYNC_EVAL_EVERY * round(p["version"] / ASYNC_EVAL_EVERY) == v  # noqa: E731
    seconds = [
        np.mean([p["seconds"] for r in rs for p in r["held_out_curve"] if on_grid(p, v)])
        for v in versions
    ]
    episodes = [  # trained before version v was published, mean over seeds
        np.mean([r["episodes"][min(max(v, 1), len(r["episodes"])) - 1] for r in rs])
        for v in versions
    ]
    by_episodes.plot(episodes, ys, **kw)
    by_seconds.plot(seconds, ys, **kw)
    by_episodes.set(
        title="held-out success vs episodes", xlabel="episodes trained", ylabel="success"
    )
    by_seconds.set(title="held-out success vs wall clock", xlabel="seconds", ylabel="success")


def plot_asynchrony(records: list[dict], ax_row: list[Any]) -> None:
    """Held-out success against episodes and against wall-clock seconds, per η and arm (mean
    over seeds), and the staleness of the trained tokens."""
    styles = {arm: style for arm, style in zip(ASYNC_ARMS, ("-", "--", ":"), strict=True)}
    colours = dict(zip(ASYNC_BOUNDS, ("k", "tab:blue", "tab:red"), strict=False))
    for (k, arm), rs in sorted(groups(records, "max_staleness", "arm").items()):
        kw = {"color": colours.get(k), "linestyle": styles[arm], "label": f"η={k}, {arm}"}
        _held_out_curves(ax_row[0], ax_row[1], rs, **kw)
        hist = np.sum([np.pad(r["staleness_histogram"], (0, 16))[:16] for r in rs], axis=0)
        ax_row[2].plot(np.arange(16), hist / max(hist.sum(), 1), marker="o", **kw)
    ax_row[2].set(
        title="staleness of trained tokens",
        xlabel="versions behind",
        ylabel="share",
        xlim=(-0.5, 9),
    )
    ax_row[0].legend(fontsize=6)


def plot_async(records: list[dict], ax_row: list[Any]) -> None:
    summary = summarize_async(records)
    engines = [e for e in ("torch", "simulated") if f"{e}/k0" in summary]
    x = np.arange(len(engines))
    for ax, metric in zip(ax_row, ("tokens_per_second", "idle_fraction"), strict=True):
        for offset, k in ((-0.2, 0), (0.2, 4)):
            vals = [summary[f"{e}/k{k}"][metric] for e in engines]
            ax.bar(
                x + offset,
                [v["mean"] for v in vals],
                0.4,
                yerr=[v["std"] for v in vals],
                capsize=3,
                label="sync (max_staleness 0)" if k == 0 else "async (max_staleness 4)",
            )
        labels = [
            f"{e} maze\n({summary[f'{e}/k0']['actors']} actors)"
            if e == "torch"
            else f"SIMULATED engine\n({summary[f'{e}/k0']['actors']} actors)"
            for e in engines
        ]
        ax.set_xticks(x, labels)
        ax.legend()
    ax_row[0].set(title="trained tokens/s (relative to sync, per engine)", ylabel="tokens/s")
    ax_row[0].set_yscale("log")
    ax_row[1].set(title="learner idle fraction", ylabel="fraction of wall time")


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


EXPERIMENTS = {
    "long_horizon": Experiment(
        long_horizon_runs,
        summarize_long_horizon,
        plot_long_horizon,
        2,
        3,
        "critic PPO beats GRPO on long horizons without early termination and ties with it "
        "where episodes end early (arXiv 2511.03527); GRPO as good on short tasks",
        model=WARM_CHAIN_MODEL,
        prepare=warm_model("chain", WARM_CHAIN_MODEL),
    ),
    "cut_bootstrap": Experiment(
        cut_bootstrap_runs,
        summarize_long_horizon,
        plot_long_horizon,
        2,
        2,
        "bootstrapping the critic across compaction cuts trains long-horizon agents better than "
        "ending every segment with value 0",
        model=WARM_CHAIN_MODEL,
        prepare=long_context_copy,
    ),
    "critic": Experiment(
        critic_runs,
        summarize_critic,
        plot_critic,
        2,
        2,
        "a learned critic explains the return of long-horizon episodes",
        model=WARM_CHAIN_MODEL,
        prepare=fitted_critic,
    ),
    "ppo_vs_grpo": Experiment(
        ppo_vs_grpo_runs,
        summarize_ppo_vs_grpo,
        plot_ppo_vs_grpo,
        2,
        3,
        "critic PPO: +22% task completion and 1.8x sample efficiency over GRPO on long "
        "horizons; GRPO as good on short tasks",
        prepare=warm_model("maze", WARM_MAZE_MODEL),
    ),
    "icepop": Experiment(
        icepop_runs,
        summarize_icepop,
        plot_icepop,
        3,
        2,
        "IcePop keeps training stable under a train/inference mismatch",
    ),
    "icepop_smollm2": Experiment(
        icepop_smollm2_runs,
        summarize_icepop,
        plot_icepop,
        3,
        1,
        "a real model's bf16 sampling vs fp32 training mismatch: how many tokens IcePop masks",
        model=SMOLLM2,
        prepare=require_smollm2,
    ),
    "staleness": Experiment(
        staleness_runs,
        summarize_staleness,
        plot_staleness,
        2,
        2,
        "with the decoupled correction, stale samples train as well as fresh ones; "
        "without it, staleness hurts",
    ),
    "asynchrony": Experiment(
        asynchrony_runs,
        summarize_asynchrony,
        plot_asynchrony,
        3,
        2,
        "at η = 4 decoupled PPO + IcePop is within 5 points of η = 0 on held-out instances at "
        "equal episodes; the uncorrected arms are measurably worse at η >= 4",
        model=WARM_CHAIN_MODEL,
        prepare=warm_model("chain", WARM_CHAIN_MODEL),
    ),
    "credit": Experiment(
        credit_runs,
        summarize_credit,
        plot_credit,
        2,
        2,
        "turn-level GAE (a turn is one action) learns the chain at least as well as token-level",
        model=WARM_CHAIN_MODEL,
        prepare=lambda quick: fitted_critic(
            quick, {WARM_CHAIN_CRITIC: FITTED_CRITICS[WARM_CHAIN_CRITIC]}
        ),
    ),
    "async": Experiment(
        async_runs,
        summarize_async,
        plot_async,
        2,
        1,
        "asynchronous training raises learner throughput and cuts learner idle time",
    ),
}


def run_key(name: str, seed: int, labels: dict[str, Any], overrides: dict[str, Any]) -> str:
    """What makes two runs the same run: name, seed, labels and overrides, as JSON."""
    return json.dumps([name, seed, labels, overrides], sort_keys=True, default=float)


def reusable_records(json_path: Path) -> dict[str, dict[str, Any]]:
    """The finished runs of an earlier report, by `run_key` (none if there is no report)."""
    if not json_path.exists():
        return {}
    runs = json.loads(json_path.read_text())["runs"]
    return {
        run_key(r["name"], r["seed"], r["labels"], r["overrides"]): r
        for r in runs
        if r["returncode"] == 0
    }


def run_experiment(
    name: str,
    quick: bool,
    seeds: int | None,
    out_dir: Path,
    max_wall: float | None,
    reuse: bool = False,
) -> Path:
    """Run every configuration of one experiment; write `<name>[_quick].json` and `.png`.

    With `reuse`, a run the existing report already holds (same name, seed, labels and
    overrides, exit code 0) is taken from it instead of run again: adding seeds to an
    experiment costs only the new seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exp = EXPERIMENTS[name]
    n_seeds = seeds if seeds is not None else (1 if quick else exp.default_seeds)
    if n_seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {n_seeds}")
    if exp.prepare is not None:
        exp.prepare(quick)
    runs = exp.make_runs(quick, n_seeds)
    if max_wall is not None:
        runs = [dataclasses.replace(r, wall_s=min(r.wall_s, max_wall)) for r in runs]
    stem = f"{name}_quick" if quick else name
    json_path = out_dir / f"{stem}.json"
    earlier = reusable_records(json_path) if reuse else {}
    t0 = time.monotonic()
    records, reused = [], []
    for run in runs:
        record = earlier.get(run_key(run.name, run.seed, run.labels, run.overrides))
        if record is None:
            record = run_record(launch(run, name))
        else:
            reused.append(run.name)
        records.append(record)
    report = {
        "experiment": name,
        "setting": "quick" if quick else "full",
        "claim": exp.claim,
        "seeds": n_seeds,
        "model": exp.model,
        "wall_seconds": round(time.monotonic() - t0, 1),
        "reused_runs": reused,  # taken from the earlier report (--reuse), not run again
        "summary": exp.summarize(records),
        "runs": records,
    }
    write_report(json_path, report)
    fig, axes = plt.subplots(1, exp.panels, figsize=(5.5 * exp.panels, 4.2), squeeze=False)
    exp.plot(records, list(axes[0]))
    fig.suptitle(
        f"{name} ({report['setting']}, {n_seeds} seed(s), {Path(exp.model).name} model on "
        f"{os.cpu_count()} CPU cores)"
    )
    fig.tight_layout()
    fig.savefig(out_dir / f"{stem}.png", dpi=110)
    plt.close(fig)
    print(json.dumps(report["summary"], indent=1, default=float), flush=True)
    return json_path


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("experiment", choices=sorted(EXPERIMENTS))
    ap.add_argument(
        "--quick", action="store_true", help="the few-minute setting (1 seed unless --seeds)"
    )
    ap.add_argument("--seeds", type=int, default=None, help="seeds per configuration")
    ap.add_argument("--out", type=Path, default=SCRATCH, help="where JSON and PNG go")
    ap.add_argument(
        "--max-wall", type=float, default=None, help="cap every run at this many seconds"
    )
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="take runs the existing report already holds from it (add seeds without rerunning)",
    )
    args = ap.parse_args()
    run_experiment(args.experiment, args.quick, args.seeds, args.out, args.max_wall, args.reuse)


if __name__ == "__main__":
    main()
