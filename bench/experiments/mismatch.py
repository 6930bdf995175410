"""IcePop under a real sampling/training mismatch: bf16 actors, an fp32 learner."""

from __future__ import annotations

import dataclasses
from typing import Any

from bench.experiments.plots import _curves
from bench.experiments.runs import Run
from bench.experiments.stats import groups, mean_std
from bench.experiments.tasks import DIGITS, SMOLLM2


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
