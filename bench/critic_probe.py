"""The first steps of one arm of the critic experiment: does its critic reach >= 0.8 of the value
function's held-out explained variance before step 30?

The full experiment (``bench/experiments.py critic``) runs every arm for 120 steps (~15 min a
seed); the target concerns steps 10-30. This runs one arm of ``experiments.CRITICS`` for
``--steps`` steps per seed, with the same config and the same held-out scoring of its checkpoints
(``asyncppo eval --checkpoint``, 96 instances x 16 plays), ~5 min a seed on 2 cores:

    python bench/critic_probe.py separate-g1-init --seeds 3   # -> docs/results/critic_probe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import experiments as X  # noqa: E402


def main() -> None:
    arms = {prefix: (label, extra) for label, (prefix, extra) in X.CRITICS.items()}
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("arm", choices=sorted(arms))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=ROOT / "docs/results/critic_probe.json")
    args = ap.parse_args()
    label, extra = arms[args.arm]
    X.fitted_critic(False)
    per_seed = []
    for seed in range(args.seeds):
        run = X.chain_run(
            f"{args.arm}-{args.steps}steps-s{seed}",
            {"task": "early", "algorithm": f"ppo, {label}"},
            False,
            seed,
            args.steps,
            **{"actor.env_kwargs": X.CHAIN_VARIANTS["early"], "learner.algorithm": "ppo", **extra},
        )
        run = dataclasses.replace(
            run, critic_steps=tuple(s for s in X.CRITIC_STEPS if s <= args.steps)
        )
        per_seed.append(X.launch(run, "critic_probe").critic_curve)
    steps = [p["step"] for p in per_seed[0]]
    fraction = {
        step: X.seed_interval(
            [
                p["critic"]["critic_fraction_of_value_function"]
                for curve in per_seed
                for p in curve
                if p["step"] == step
            ]
        )
        for step in steps
    }
    report = {
        "command": f"python bench/critic_probe.py {args.arm} --seeds {args.seeds} --steps {args.steps}",
        "arm": label,
        "overrides": extra,
        "critic_fraction_of_value_function": fraction,
        "curves": per_seed,
    }
    args.out.write_text(json.dumps(report, indent=1, default=float) + "\n")
    print(json.dumps(fraction, indent=1, default=float))


if __name__ == "__main__":
    main()
