"""Experiments that reproduce the seed claims at small scale, on real `asyncppo up` runs.

Each experiment starts broker, learner and actors as real processes (one `asyncppo up` per
configuration and seed, its own port and run dir under runs/experiments/), reads the learner's
step log (`learner_steps.jsonl`) and the run summary, and writes JSON and a PNG plot to
runs/bench/ or --out (`<name>.json`/`.png`; `<name>_quick.*` for --quick).

    python -m bench.experiments long_horizon [--quick] [--seeds N]  # PPO vs GRPO on chain, held-out
    python -m bench.experiments long_horizon_curves [--quick] [--seeds N]  # the same, early termination, held-out curves
    python -m bench.experiments cut_bootstrap [--quick] [--seeds N] # compaction cuts: critic vs 0
    python -m bench.experiments critic [--quick] [--seeds N]        # which critic explains the return
    python -m bench.experiments ppo_vs_grpo [--quick] [--seeds N]   # critic PPO vs GRPO, maze + digits
    python -m bench.experiments icepop      [--quick] [--seeds N]   # bf16 sampling, fp32 training
    python -m bench.experiments icepop_smollm2 [--quick]             # the same on SmolLM2-135M (make smollm2)
    python -m bench.experiments staleness   [--quick] [--seeds N]   # max_staleness 0..8, icepop vs none
    python -m bench.experiments async       [--quick] [--seeds N]   # max_staleness 4 vs 0, torch + simulated
    python -m bench.experiments asynchrony  [--quick] [--seeds N]   # η 0/1/4/8 x (ours, no weight, naive) on chain, held out
    python -m bench.experiments credit      [--quick] [--seeds N]   # token- vs turn-level GAE on chain, pre-fitted critic
    python -m bench.experiments mismatch_threshold [--quick]         # perturbed actor weights: none vs IcePop

A Makefile target would be `for e in ppo_vs_grpo icepop staleness async; do $(PY) -m
bench.experiments $$e; done`. --quick finishes in a few minutes per experiment (what the slow
tests run); the full settings take tens of minutes on 2 CPU cores. --max-wall caps every run.
--reuse takes the runs the existing report already holds from it: `--seeds 5 --reuse` after a
3-seed report runs only seeds 3 and 4.

Where things are: this file is the registry (`EXPERIMENTS`: each experiment's runs, summary,
plot and claim) and the driver; `tasks.py` the starting models and task configurations;
`runs.py` one run (`launch`: a real `asyncppo up` and its held-out evaluations) and its record;
`stats.py` the pure numbers; `plots.py` shared plot pieces; one module per family of
experiments: `chain.py` (long horizon, compaction cuts, critics, credit), `ppo_vs_grpo.py` (also the chain's held-out curves),
`mismatch.py` (IcePop under bf16 sampling), `asynchrony.py` (staleness and throughput).

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
import os
import time
from pathlib import Path
from typing import Any

from bench.experiments.asynchrony import (
    async_runs,
    asynchrony_runs,
    plot_async,
    plot_asynchrony,
    plot_staleness,
    staleness_runs,
    summarize_async,
    summarize_asynchrony,
    summarize_staleness,
)
from bench.experiments.chain import (
    credit_runs,
    critic_runs,
    cut_bootstrap_runs,
    long_horizon_runs,
    plot_credit,
    plot_critic,
    plot_long_horizon,
    summarize_credit,
    summarize_critic,
    summarize_long_horizon,
)
from bench.experiments.mismatch import (
    icepop_runs,
    icepop_smollm2_runs,
    mismatch_threshold_runs,
    plot_icepop,
    plot_mismatch_threshold,
    summarize_icepop,
    summarize_mismatch_threshold,
)
from bench.experiments.ppo_vs_grpo import (
    long_horizon_curve_runs,
    plot_long_horizon_curves,
    plot_ppo_vs_grpo,
    ppo_vs_grpo_runs,
    summarize_long_horizon_curves,
    summarize_ppo_vs_grpo,
)
from bench.experiments.runs import (
    Experiment,
    fitted_critic,
    launch,
    long_context_copy,
    require_smollm2,
    run_record,
    warm_model,
)
from bench.experiments.tasks import (
    FITTED_CRITICS,
    SMOLLM2,
    WARM_CHAIN_CRITIC,
    WARM_CHAIN_MODEL,
    WARM_MAZE_MODEL,
)
from bench.record import SCRATCH, write_report
from common.config import current_key

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
    "long_horizon_curves": Experiment(
        long_horizon_curve_runs,
        summarize_long_horizon_curves,
        plot_long_horizon_curves,
        2,
        3,
        "on the early-termination chain critic PPO reaches a held-out level in fewer episodes "
        "than GRPO, or collapses less (Turn-PPO, arXiv 2512.17008)",
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
    "mismatch_threshold": Experiment(
        mismatch_threshold_runs,
        summarize_mismatch_threshold,
        plot_mismatch_threshold,
        3,
        1,
        "without a correction, training degrades once the actors' policy is far enough off the "
        "learner's; IcePop keeps learning there",
        model=WARM_CHAIN_MODEL,
        prepare=warm_model("chain", WARM_CHAIN_MODEL),
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
    """What makes two runs the same run: name, seed, labels and overrides (each key as it is
    spelled today: a record keeps the spelling it ran with), as JSON."""
    current = {current_key(key, value): value for key, value in overrides.items()}
    return json.dumps([name, seed, labels, current], sort_keys=True, default=float)


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
