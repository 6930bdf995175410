"""The first steps of one arm of the critic experiment: does its critic reach >= 0.8 of V^π's
held-out explained variance before step 30?

The full experiment (``python -m bench.experiments critic``) runs every arm for 120 steps (~16 min a
seed); the target concerns steps 10-30. This runs one arm of ``experiments.CRITICS``, with
``--set`` overrides on top, for ``--steps`` steps per seed, with the same config and the same
held-out scoring of its checkpoints (``asyncppo eval --checkpoint``, 96 instances x 16 plays),
~5 min a seed on 2 cores:

    python -m bench.critic_probe separate-g1-init --seeds 1 \
        --set learner.critic.lam=0.95 --out docs/results/critic_probe_lam0.95.json

A probe's clip schedule runs over its own steps (faster than in a 120-step run), so its figures
are close to, not the same as, the full experiment's at the same step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from bench.experiments import chain, runs, tasks
from bench.record import SCRATCH, write_report
from common.config import parse_override


def main() -> None:
    arms = {prefix: (label, extra) for label, (prefix, extra) in chain.CRITICS.items()}
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("arm", choices=sorted(arms))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--set", type=parse_override, action="append", default=[], dest="sets")
    ap.add_argument("--out", type=Path, default=SCRATCH / "critic_probe.json", help="the report")
    args = ap.parse_args()
    label, extra = arms[args.arm]
    extra = {**extra, **dict(args.sets)}
    runs.fitted_critic(False)
    # the run's name says its overrides (a path's last part only: a run name is a directory)
    tag = "".join(f"-{k.rsplit('.', 1)[-1]}{str(v).rsplit('/', 1)[-1]}" for k, v in args.sets)
    per_seed = []
    for seed in range(args.seeds):
        run = runs.chain_run(
            f"{args.arm}{tag}-{args.steps}steps-s{seed}",
            {"task": "early", "algorithm": f"ppo, {label}"},
            False,
            seed,
            args.steps,
            **{
                "actor.env_kwargs": tasks.CHAIN_VARIANTS["early"],
                "learner.algorithm": "ppo",
                **extra,
            },
        )
        run = dataclasses.replace(
            run, critic_steps=tuple(s for s in chain.CRITIC_STEPS if s <= args.steps)
        )
        per_seed.append(runs.launch(run, "critic_probe").critic_curve)
    fractions = {
        name: {step: scores[key] for step, scores in chain.critic_curve_intervals(per_seed).items()}
        for name, key in (
            ("of_value_function", "fraction_of_exact"),
            ("of_monte_carlo_estimate", "fraction"),
        )
    }
    report = {
        "arm": label,
        "overrides": extra,
        "critic_fraction": fractions,
        "curves": per_seed,
    }
    write_report(args.out, report)
    print(json.dumps(fractions, indent=1, default=float))


if __name__ == "__main__":
    main()
