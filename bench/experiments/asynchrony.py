"""How far actors may run ahead of the learner, and what corrects for it: the staleness bound
against the behavior correction on the chain (held out), and the historical digits-era staleness
and async-throughput experiments."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from bench.experiments.plots import _held_out_curves
from bench.experiments.runs import Run, chain_run
from bench.experiments.stats import (
    EVAL_EVERY,
    groups,
    held_out_at_episodes,
    held_out_summary,
    mean_std,
    seed_interval,
)
from bench.experiments.tasks import CHAIN_VARIANTS, DIGITS, maze

# Issue 39: how far actors may run ahead (broker.max_staleness, η) against what corrects for it, on
# the early-termination chain, scored on held-out instances while training runs.
ASYNC_ARMS = {  # label -> learner overrides
    "decoupled + IcePop": {"learner.correction": "icepop"},  # ours
    "decoupled, no behavior weight": {"learner.correction": "none"},
    "naive: clip against mu": {"learner.correction": "none", "learner.proximal": "behavior"},
}


ASYNC_BOUNDS = (0, 1, 4, 8)
QUICK_BOUNDS = (0, 4, 8)  # the slow test's ten minutes hold seven runs, not ten


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
                    "eval.every_versions": 5 if quick else EVAL_EVERY,
                    "eval.episodes": 48,
                    **overrides,
                },
            ),
            actors=3,
        )
        for k in (QUICK_BOUNDS if quick else ASYNC_BOUNDS)
        for arm, overrides in ASYNC_ARMS.items()
        if k or arm == "decoupled + IcePop"
        for seed in range(seeds)
    ]


def dedicated_rates(rs: list[dict]) -> dict[str, float]:
    """Episodes per second that the roles' measured CPU seconds per episode imply on machines of
    their own: each actor on a core of its own, the learner on another. In lockstep (η = 0) an
    episode waits for the actors, then for the learner: their times add. Overlapped (η > 0) the
    slower side alone sets the pace. Neither counts waiting, which costs no CPU."""
    per_episode = {
        role: float(
            np.mean(
                [r["summary"]["cpu_seconds"][role] / r["summary"]["episodes_trained"] for r in rs]
            )
        )
        for role in ("actors", "learner")
    }
    actors = per_episode["actors"] / rs[0]["actors"]  # the actors play in parallel
    return {
        "actors_cpu_seconds_per_episode": per_episode["actors"],
        "learner_cpu_seconds_per_episode": per_episode["learner"],
        "lockstep": 1 / (actors + per_episode["learner"]),
        "overlapped": 1 / max(actors, per_episode["learner"]),
    }


def summarize_asynchrony(records: list[dict]) -> dict[str, Any]:
    """Per η and arm: held-out success at the start, along the curve and at the end (95%
    t-interval over seeds), the staleness of the trained tokens, episodes trained, throughput
    per wall second, and the rates the roles' CPU seconds imply on dedicated machines; then each
    arm's async/sync ratios against ours at η = 0, measured here and implied there."""
    summary: dict[str, Any] = {}
    equal = min(r["episodes"][-1] for r in records)  # what every run trained on at least
    for (k, arm), rs in sorted(groups(records, "max_staleness", "arm").items()):
        hist = np.sum([np.pad(r["staleness_histogram"], (0, 16))[:16] for r in rs], axis=0)
        summary[f"eta {k} / {arm}"] = {
            "max_staleness": k,
            "arm": arm,
            **held_out_summary(rs),
            "held_out_at_equal_episodes": {
                "episodes": equal,
                **seed_interval([held_out_at_episodes(r, equal) for r in rs]),
            },
            "trained_token_staleness": (hist / max(hist.sum(), 1)).round(4).tolist(),
            "mean_staleness": float((np.arange(16) * hist).sum() / max(hist.sum(), 1)),
            "episodes_trained": mean_std([r["summary"]["episodes_trained"] for r in rs]),
            "episodes_per_second": mean_std([r["episodes_per_second"] for r in rs]),
            "tokens_per_second": mean_std([r["tokens_per_second"] for r in rs]),
            "learner_idle_fraction": mean_std([r["idle_fraction"] for r in rs]),
            "dedicated_episodes_per_second": dedicated_rates(rs),
            "wall_seconds": mean_std([r["summary"]["wall_seconds"] for r in rs]),
        }
    sync = summary.get(f"eta 0 / {next(iter(ASYNC_ARMS))}")
    for arm in summary.values():
        if sync is not None:
            arm["async_over_sync"] = {
                "measured_here": arm["episodes_per_second"]["mean"]
                / sync["episodes_per_second"]["mean"],
                "dedicated_machines": arm["dedicated_episodes_per_second"][
                    "overlapped" if arm["max_staleness"] else "lockstep"
                ]
                / sync["dedicated_episodes_per_second"]["lockstep"],
            }
    return summary


def plot_asynchrony(records: list[dict], ax_row: list[Any]) -> None:
    """Held-out success against episodes and against wall-clock seconds, per η and arm (mean
    over seeds), and the staleness of the trained tokens."""
    styles = {arm: style for arm, style in zip(ASYNC_ARMS, ("-", "--", ":"), strict=True)}
    colours = dict(zip(ASYNC_BOUNDS, ("k", "tab:green", "tab:blue", "tab:red"), strict=True))
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
