"""The numbers the experiments report, as pure functions of run records (no processes)."""

from __future__ import annotations

from typing import Any

import numpy as np


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


def seed_interval(values: list[float]) -> dict[str, Any]:
    """Mean over seeds with a 95% t-interval (none from one seed)."""
    t95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365}
    n, mean = len(values), float(np.mean(values)) if values else float("nan")
    if n < 2:
        return {"mean": mean, "ci95": None, "seeds": n, "values": values}
    half = t95.get(n, 1.96) * float(np.std(values, ddof=1)) / np.sqrt(n)
    return {"mean": mean, "ci95": [mean - half, mean + half], "seeds": n, "values": values}


def groups(records: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in records:
        out.setdefault(tuple(r["labels"][k] for k in keys), []).append(r)
    return out


EVAL_EVERY = 10  # versions between the held-out scores of an evaluator beside training


def held_out_at(curve: list[dict], every: int) -> dict[int, float]:
    """A run's held-out success by version, each evaluated version rounded to the grid of
    `every` (the evaluator scores the newest version when it falls behind)."""
    return {every * round(p["version"] / every): p["success"] for p in curve}


def episodes_behind(run: dict, version: int) -> int:
    """Episodes trained before ``version`` was published (version v follows step v)."""
    steps = run["episodes"]  # cumulative, one entry per step
    return steps[min(version, len(steps)) - 1] if version > 0 else 0


def held_out_at_episodes(run: dict, episodes: int) -> float:
    """A run's held-out success at ``episodes`` trained: its evaluator's scores against the
    episodes the scored versions had trained on, linearly interpolated. At η > 0 a step trains
    more than a batch (admission rule 2), so arms are compared at equal samples, not steps."""
    xs = [episodes_behind(run, p["version"]) for p in run["held_out_curve"]]
    return float(np.interp(episodes, xs, [p["success"] for p in run["held_out_curve"]]))


def held_out_reaches(run: dict, level: float) -> int | None:
    """Episodes trained behind the first version the evaluator scored at ``level`` or above on
    the held-out set; None if none did."""
    return next(
        (
            episodes_behind(run, p["version"])
            for p in run["held_out_curve"]
            if p["success"] >= level
        ),
        None,
    )


def collapsed(run: dict, drop: float = 0.2) -> bool:
    """A collapse: the held-out score falls ``drop`` or more below its best and ends there (it
    does not recover by the last score). With one score of 48 instances (±0.13 at 95%) a
    ``drop`` of 0.2 can still be a bad draw: read it with the curve."""
    scores = [p["success"] for p in run["held_out_curve"]]
    return bool(scores) and scores[-1] <= max(scores) - drop


def held_out_summary(rs: list[dict]) -> dict[str, Any]:
    """The seeds of one arm on held-out instances: at the start, at the end (95% t-interval) and
    at every version the evaluator beside training scored on every seed."""
    curves = [held_out_at(r["held_out_curve"], EVAL_EVERY) for r in rs]
    versions = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return {
        "held_out_start": rs[0]["held_out"]["start"]["success"] if rs[0]["held_out"] else None,
        "held_out_final": seed_interval(
            [r["held_out"]["final"]["success"] for r in rs if r["held_out"]]
        ),
        "held_out_curve": {v: seed_interval([c[v] for c in curves]) for v in versions},
    }
