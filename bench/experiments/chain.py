"""Long-horizon comparisons on the chain, scored on held-out instances: critic PPO against GRPO,
compaction cuts bootstrapped or not, which critic, and token- against turn-level credit."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from bench.experiments.plots import _curves, _held_out_bars, _held_out_curves
from bench.experiments.runs import Run, chain_run
from bench.experiments.stats import EVAL_EVERY, groups, held_out_summary, seed_interval
from bench.experiments.tasks import (
    CHAIN_VARIANTS,
    QUICK_CRITIC,
    WARM_CHAIN_2K_MODEL,
    WARM_CHAIN_CRITIC,
    WARM_CHAIN_CRITIC_12K,
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


FAST_CRITIC_G1 = {"actor.group_size": 1, "learner.critic.lr": 3e-3, "learner.critic.updates": 8}


CRITICS = {  # label -> (run name prefix, learner overrides); "separate" is long_horizon's PPO
    "separate": ("separate", {}),
    "shared": ("shared", {"learner.critic.kind": "shared"}),
    # 4 updates a step at a higher lr, after 10 steps that train only the critic (the name is the
    # one docs/results/critic.json records)
    "separate, lr 3e-3 x4, 10 critic-only steps": (
        "separate-fast",
        {
            "learner.critic.lr": 3e-3,
            "learner.critic.updates": 4,
            "learner.critic.warmup_steps": 10,
        },
    ),
    # 32 instances a step instead of 4 x 8 plays (a 30-step probe: the critic generalises from
    # more instances), 8 updates a step, and a warm-up of 20 critic-only steps ...
    "separate, groups of 1, lr 3e-3 x8, 20 critic-only steps": (
        "separate-g1",
        {**FAST_CRITIC_G1, "learner.critic.warmup_steps": 20},
    ),
    # ... or one that ends once the critic's explained variance on fresh batches averages 0.25
    # over 5 steps (at most 30 steps) ...
    "separate, groups of 1, lr 3e-3 x8, critic-only until EV 0.25": (
        "separate-g1-ev",
        {**FAST_CRITIC_G1, "learner.critic.warmup_steps": 30, "learner.critic.warmup_ev": 0.25},
    ),
    # ... or none: the critic starts fitted to the warm policy's own episodes (`asyncppo critic`,
    # 400 instances x 8 plays: 3,200 episodes, 29k generated tokens, before step 0; a run trains on
    # 3,840 episodes), and a lower lr keeps that fit (at 3e-3 x8 one seed fell to 0.51 / 0.25 / 0.31
    # of the value function at steps 10 / 20 / 30)
    "separate, groups of 1, lr 3e-4 x8, pre-trained on the warm policy": (
        "separate-g1-init",
        {
            **FAST_CRITIC_G1,
            "learner.critic.lr": 3e-4,
            "learner.critic.init": WARM_CHAIN_CRITIC,
        },
    ),
    # ... fitted to 4x the episodes (12,800: the fit's held-out EV still rose at 3,200), and with
    # its 8 updates a step drawn from the last 8 batches instead of repeating this step's one
    "separate, groups of 1, lr 3e-4 x8 over the last 8 batches, pre-trained on 12,800 episodes": (
        "separate-g1-init12k-replay8",
        {
            **FAST_CRITIC_G1,
            "learner.critic.lr": 3e-4,
            "learner.critic.replay": 8,
            "learner.critic.init": WARM_CHAIN_CRITIC_12K,
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
                        {"learner.critic.init": QUICK_CRITIC[0]}
                        if quick and "learner.critic.init" in extra
                        else {}
                    ),
                },
            ),
            critic_steps=(5, 10, 15) if quick else CRITIC_STEPS,
        )
        for label, (prefix, extra) in CRITICS.items()
        for seed in range(seeds)
    ]


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
                **({"learner.critic.init": QUICK_CRITIC[0]} if quick else {}),
                "learner.gae_unit": unit,
                "eval.every_versions": 5 if quick else EVAL_EVERY,
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
