"""`asyncppo plot`: one PNG of a run directory, from what the roles wrote there.

Reads `learner_steps.jsonl` (one line per learner step) and, when the run had an evaluator
(`eval.every_versions`), `eval.jsonl` (one line per evaluated version). Three panels: the
training reward and the held-out success (95% intervals) against the policy version, the held-out
success per horizon bucket, and how each update moved the policy and the critic (explained
variance, update KL, entropy).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deploy.launcher import read_jsonl


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's plot (default `<run dir>/run.png`); ValueError when there is nothing to plot."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ValueError("asyncppo plot needs matplotlib: pip install 'asyncppo[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    steps, evals = read_jsonl(run_dir / "learner_steps.jsonl"), read_jsonl(run_dir / "eval.jsonl")
    if not steps and not evals:
        raise ValueError(f"{run_dir}: no learner_steps.jsonl or eval.jsonl to plot")
    fig, (reward, buckets, moves) = plt.subplots(1, 3, figsize=(16, 4.2))
    if steps:
        reward.plot(
            [s["version"] for s in steps], [s["reward_mean"] for s in steps], label="training batch"
        )
    _with_interval(reward, evals, lambda e: e, "held-out success", "k")
    reward.set(title="reward and held-out success", xlabel="policy version", ylabel="rate")
    reward.legend()
    for name in evals[-1]["buckets"] if evals else []:
        _with_interval(buckets, evals, lambda e, n=name: e["buckets"].get(n), f"horizon {name}")
    buckets.set(title="held-out success by horizon", xlabel="policy version", ylabel="success")
    if evals:
        buckets.legend()
    for key in ("explained_variance", "update_kl", "entropy"):
        points = [(s["step"], s[key]) for s in steps if s.get(key) is not None]
        if points:
            moves.plot(*zip(*points, strict=True), label=key)
    moves.set(title="the updates (EV below -1 clipped)", xlabel="learner step")
    moves.set_ylim(bottom=max(moves.get_ylim()[0], -1.0))
    moves.legend()
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out = Path(out) if out else run_dir / "run.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _with_interval(ax: Any, evals: list[dict], pick: Any, label: str, color: Any = None) -> None:
    """Success against version with its 95% interval as a band."""
    rows = [(e["version"], pick(e)) for e in evals if pick(e) is not None]
    if not rows:
        return
    versions = [v for v, _ in rows]
    line = ax.plot(versions, [r["success"] for _, r in rows], "o-", label=label, color=color)[0]
    ax.fill_between(
        versions,
        [r["success_ci95"][0] for _, r in rows],
        [r["success_ci95"][1] for _, r in rows],
        color=line.get_color(),
        alpha=0.2,
    )
