"""IcePop under a sampling/training mismatch: bf16 actors and an fp32 learner, and a mismatch
of a chosen size (perturbed actor weights) to find where an uncorrected arm degrades."""

from __future__ import annotations

import dataclasses
from typing import Any

from bench.experiments.plots import _curves, _held_out_curves
from bench.experiments.runs import Run, chain_run
from bench.experiments.stats import EVAL_EVERY, groups, held_out_summary, mean_std
from bench.experiments.tasks import CHAIN_VARIANTS, DIGITS, SMOLLM2


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


def mismatch_seen(rs: list[dict]) -> dict[str, Any]:
    """The training reward at the end and the mismatch the learner saw over every step of the
    runs `rs`: IcePop's kept fraction and the behavior weights π_prox/μ (whatever the correction
    then did with them)."""
    return {
        "final_reward": mean_std([r["final_reward"] for r in rs]),
        "kept_fraction": mean_std([v for r in rs for v in r["series"]["icepop_kept_fraction"]]),
        "importance_weight_mean": mean_std(
            [v for r in rs for v in r["series"]["importance_weight_mean"]]
        ),
        "importance_weight_max": max(
            (v for r in rs for v in r["series"]["importance_weight_max"]), default=float("nan")
        ),
    }


def summarize_icepop(records: list[dict]) -> dict[str, Any]:
    return {corr: mismatch_seen(rs) for (corr,), rs in groups(records, "correction").items()}


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


# Issue 39: the mismatch size at which an uncorrected arm degrades. The tiny model's bf16/fp32
# mismatch is too small to matter (max π_prox/μ ~1.04), so the actors' weights are perturbed
# (`actor.weight_noise_std`): they sample from, and report μ of, a policy off the learner's.
MISMATCH_NOISE = (0.0, 0.6, 1.0)
MISMATCH_CORRECTIONS = ("none", "icepop")


def mismatch_threshold_runs(quick: bool, seeds: int) -> list[Run]:
    """The early-termination chain at η = 0 (the mismatch alone), every correction at every
    noise size (IcePop only at 0, the reference: with fp32 on both sides the arms coincide there),
    held-out success every 10 versions."""
    return [
        chain_run(
            f"noise{noise}-{corr}-s{seed}",
            {"weight_noise_std": noise, "correction": corr},
            quick,
            seed,
            40,
            **{
                "actor.env_kwargs": CHAIN_VARIANTS["early"],
                "actor.weight_noise_std": noise,
                "broker.max_staleness": 0,  # no stale samples: the mismatch alone
                "learner.correction": corr,
                "eval.every_versions": 5 if quick else EVAL_EVERY,
                "eval.episodes": 48,
            },
        )
        for noise in MISMATCH_NOISE
        for corr in MISMATCH_CORRECTIONS
        if noise or corr == "icepop"
        for seed in range(seeds)
    ]


def summarize_mismatch_threshold(records: list[dict]) -> dict[str, Any]:
    """Per noise size and correction: held-out success, the mismatch the learner saw (IcePop's
    kept fraction and the behavior weights π_prox/μ, whatever the correction did with them) and
    the training reward."""
    return {
        f"noise {noise} / {corr}": held_out_summary(rs) | mismatch_seen(rs)
        for (noise, corr), rs in sorted(groups(records, "weight_noise_std", "correction").items())
    }


def plot_mismatch_threshold(records: list[dict], ax_row: list[Any]) -> None:
    styles = {"none": "--", "icepop": "-"}
    colours = dict(zip(MISMATCH_NOISE, ("k", "tab:blue", "tab:red"), strict=True))
    for (noise, corr), rs in sorted(groups(records, "weight_noise_std", "correction").items()):
        kw = {"color": colours[noise], "linestyle": styles[corr], "label": f"noise {noise}, {corr}"}
        _held_out_curves(ax_row[0], ax_row[1], rs, **kw)
        _curves(ax_row[2], rs, f"noise {noise}, {corr}", x_key="step", y_key="icepop_kept_fraction")
    ax_row[2].set(title="tokens IcePop's band keeps", xlabel="learner step", ylabel="fraction")
    ax_row[0].legend(fontsize=7)
