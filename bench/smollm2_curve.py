"""The learning curve of SmolLM2-135M-Instruct on `arith`: reward per learner step, plotted.

Reads the learner's step log of a finished run and writes the per-step series (JSON) and a
plot (PNG). The run itself (about 20 minutes on 2 cores):

    asyncppo model prepare smollm2-135m-instruct        # or: make smollm2
    asyncppo up --config configs/smollm2-arith.yaml --summary runs/smollm2-arith/summary.json
    python -m bench.smollm2_curve --run runs/smollm2-arith

``--beside OTHER.json`` draws the moving average of a series this script wrote before (the
full-model run beside a LoRA run, say) on the same axes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bench.record import SCRATCH, write_report


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` values at each step (fewer at the start)."""
    return [float(np.mean(values[max(0, i + 1 - window) : i + 1])) for i in range(len(values))]


def curve(steps: list[dict], window: int) -> dict:
    """Per step: mean reward, the fraction of exact bare answers (reward 1) and of right numbers."""
    rewards = [s["episode_rewards"] for s in steps]
    mean = [float(np.mean(r)) for r in rewards]
    return {
        "step": [s["step"] for s in steps],
        "seconds": [s["time"] - steps[0]["time"] for s in steps],
        "reward_mean": mean,
        "reward_moving_average": moving_average(mean, window),
        "exact_fraction": [float(np.mean([x == 1.0 for x in r])) for r in rewards],
        "correct_fraction": [float(np.mean([x > 0.0 for x in r])) for r in rewards],
        "icepop_kept_fraction": [s["icepop_kept_fraction"] for s in steps],
        "max_staleness": [s["max_staleness"] for s in steps],
        "window": window,
    }


def plot(series: dict, out: Path, title: str, beside: tuple[str, dict] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(series["step"], series["reward_mean"], ".", alpha=0.4, label="mean reward of the batch")
    ax.plot(
        series["step"],
        series["reward_moving_average"],
        "-",
        lw=2,
        label=f"moving average ({series['window']} steps)",
    )
    ax.plot(series["step"], series["exact_fraction"], "--", label="fraction answered exactly")
    if beside is not None:
        name, other = beside
        ax.plot(
            other["step"],
            other["reward_moving_average"],
            ":",
            lw=2,
            color="grey",
            label=f"{name}: moving average ({other['window']} steps)",
        )
    ax.set_xlabel("learner step")
    ax.set_ylabel("reward / fraction")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=Path("runs/smollm2-arith"), help="run.out_dir")
    parser.add_argument(
        "--out",
        type=Path,
        default=SCRATCH / "smollm2_arith",
        help="writes OUT.json and OUT.png",
    )
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--beside", type=Path, help="a series JSON this script wrote, drawn beside")
    parser.add_argument("--label", default="critic PPO", help="what this run is, for the title")
    args = parser.parse_args()
    log = args.run / "learner_steps.jsonl"
    if not log.is_file():
        raise SystemExit(f"{log} does not exist: run the training first (see --help)")
    steps = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    if not steps:
        raise SystemExit(f"{log} holds no steps")
    series = curve(steps, args.window)
    summary_path = args.run / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    write_report(args.out.with_suffix(".json"), {"summary": summary, "series": series})
    beside = (
        (args.beside.stem, json.loads(args.beside.read_text())["series"]) if args.beside else None
    )
    plot(
        series,
        args.out.with_suffix(".png"),
        f"SmolLM2-135M-Instruct, {args.label} on arith (CPU)",
        beside,
    )
    w, rewards = args.window, series["reward_mean"]
    print(
        f"{len(steps)} steps: mean reward of the first {w} steps {np.mean(rewards[:w]):.3f}, "
        f"of the last {w} {np.mean(rewards[-w:]):.3f}; wrote {args.out}.json/.png"
    )


if __name__ == "__main__":
    main()
