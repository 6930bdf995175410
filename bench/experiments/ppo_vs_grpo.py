"""Critic PPO against GRPO: on the maze (long horizon) and single-turn digits (short), and on the
early-termination chain with held-out curves (how soon each reaches a level, and collapses)."""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.experiments.plots import _curves, _held_out_curves
from bench.experiments.runs import Run, chain_run
from bench.experiments.stats import (
    EVAL_EVERY,
    collapsed,
    episodes_to_reach,
    groups,
    held_out_reaches,
    held_out_summary,
    mean_std,
)
from bench.experiments.tasks import CHAIN_VARIANTS, DIGITS, MAZE_LEARNING

CURVE_LEVELS = (0.6, 0.8)  # held-out success levels whose episodes-to-reach are reported


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


def long_horizon_curve_runs(quick: bool, seeds: int) -> list[Run]:
    """long_horizon's early-termination arms (120 steps) with an evaluator beside training that
    scores every 10th version on 48 held-out instances: a curve per seed, not two points."""
    return [
        chain_run(
            f"curve-early-{algo}-s{seed}",
            {"task": "early", "algorithm": algo},
            quick,
            seed,
            120,
            **{
                "actor.env_kwargs": CHAIN_VARIANTS["early"],
                "learner.algorithm": algo,
                "eval.every_versions": 5 if quick else EVAL_EVERY,
                "eval.episodes": 48,
            },
        )
        for algo in ("ppo", "grpo")
        for seed in range(seeds)
    ]


def summarize_long_horizon_curves(records: list[dict]) -> dict[str, Any]:
    """Per method: held-out success (start, curve, end), the episodes each seed trained before
    it first scored each of CURVE_LEVELS, and how many seeds collapsed (``stats.collapsed``)."""
    return {
        f"{task}/{algo}": held_out_summary(rs)
        | {
            "episodes_to_reach": {
                str(level): [held_out_reaches(r, level) for r in rs] for level in CURVE_LEVELS
            },
            "collapses": sum(collapsed(r) for r in rs),
            "seeds": len(rs),
        }
        for (task, algo), rs in sorted(groups(records, "task", "algorithm").items())
    }


def plot_long_horizon_curves(records: list[dict], ax_row: list[Any]) -> None:
    for (task, algo), rs in sorted(groups(records, "task", "algorithm").items()):
        _held_out_curves(ax_row[0], ax_row[1], rs, label=f"{algo} ({task}, n={len(rs)})")
    for ax in ax_row:
        for level in CURVE_LEVELS:
            ax.axhline(level, color="grey", linewidth=0.5)
    ax_row[0].legend()
