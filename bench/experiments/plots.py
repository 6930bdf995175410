"""Plot pieces the experiments share."""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np

from bench.experiments.stats import EVAL_EVERY, episodes_behind, held_out_at, seed_curves


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


def _held_out_curves(by_episodes: Any, by_seconds: Any, rs: list[dict], **kw: Any) -> None:
    """One arm's held-out success (mean over seeds) at every version the evaluator scored on
    every seed, against the episodes trained before it and the seconds since launch."""
    curves = [held_out_at(r["held_out_curve"], EVAL_EVERY) for r in rs]
    versions = sorted(set.intersection(*(set(c) for c in curves)))
    ys = [np.mean([c[v] for c in curves]) for v in versions]
    on_grid = lambda p, v: EVAL_EVERY * round(p["version"] / EVAL_EVERY) == v  # noqa: E731
    seconds = [
        np.mean([p["seconds"] for r in rs for p in r["held_out_curve"] if on_grid(p, v)])
        for v in versions
    ]
    episodes = [np.mean([episodes_behind(r, v) for r in rs]) for v in versions]  # over seeds
    by_episodes.plot(episodes, ys, **kw)
    by_seconds.plot(seconds, ys, **kw)
    by_episodes.set(
        title="held-out success vs episodes", xlabel="episodes trained", ylabel="success"
    )
    by_seconds.set(title="held-out success vs wall clock", xlabel="seconds", ylabel="success")
