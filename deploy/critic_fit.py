"""A separate critic pre-trained on the starting policy's own episodes, for ``learner.critic.init``.

Why: a critic that starts with a zero head explains almost none of a long-horizon return for the
first ~30 steps of RL (docs/results/critic.json), so every GAE advantage and every compaction cut
that bootstraps from it is noise exactly while the policy moves most. The starting policy is
known before RL begins, so its value function can be fitted first, offline:

1. play ``instances`` training instances (seeds 0.., disjoint from the held-out set) ``plays``
   times each with ``model.path``'s policy, the actors' own episode code and engine;
2. regress the learner's ``Critic`` (trunk initialised from ``model.path``, zero head) on every
   turn's Monte-Carlo value: the mean return of the *other* plays of the instance that passed
   through the same state (``learner.value.leave_one_out``; the turn's own return where no
   other play did). That target is V^π itself up to sampling noise, cleaner than the one return
   GAE with lambda 1 gives the learner;
3. score it every 50 steps on the held-out instances (``eval.episodes`` x ``plays``) beside
   V^π's own explained variance (``exact_value_explained``), as ``asyncppo eval --checkpoint``
   does.

    asyncppo critic --config C.yaml --out DIR [--instances 400] [--plays 8] [--steps 300]

DIR holds the trunk (a Hugging Face directory), its value head (``value_head.safetensors``) and
``critic_fit.json`` (the recipe, the held-out curve). A DIR whose ``critic_fit.json`` names the
same recipe is reused. The episodes cost generated tokens the report counts: compare methods at
equal budgets with them included.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from common.config import Config, to_dict
from learner.models import Critic, save_critic
from learner.value import Turns, explained, fit

REPORT = "critic_fit.json"
# Bumped when a report key changes meaning (2: held_out_value_function_ev is V^pi's own, no longer
# its Monte-Carlo estimate's): a directory with an older report is refitted, not reused.
REPORT_FORMAT = 2
LR, SEGMENTS_PER_STEP, SCORE_EVERY = 1e-3, 64, 50


def play(cfg: Config, instances: list[tuple[int, int | None]], plays: int) -> tuple[Turns, int]:
    """``instances`` x ``plays`` episodes of ``model.path``'s policy; their turns and the tokens
    generated."""
    from actors.chat import ChatFormat
    from actors.engines import engine_for
    from actors.evaluation import evaluate
    from common.model import load_tokenizer

    engine = engine_for(cfg, cfg.model.path)
    fmt = ChatFormat(load_tokenizer(cfg.model.path))
    played: list[tuple] = []
    result = evaluate(
        cfg,
        engine,
        fmt,
        instances * plays,
        on_episode=lambda p, ep: played.append((p.seed, p.states, ep.segments)),
    )
    return Turns(played, cfg.learner.gamma), int(result["generated_tokens"])


def recipe(cfg: Config, instances: int, plays: int, steps: int, seed: int) -> dict[str, Any]:
    """What decides the fitted critic: reusing a directory needs all of it to match."""
    keys = ("env", "env_kwargs", "max_turns", "context_budget_tokens", "temperature", "top_p")
    actor = to_dict(cfg)["actor"]
    return {
        "report_format": REPORT_FORMAT,
        "policy": str(Path(cfg.model.path).resolve()),
        "actor": {k: actor[k] for k in keys},
        "gamma": cfg.learner.gamma,
        "held_out_episodes": cfg.eval.episodes,
        "instances": instances,
        "plays": plays,
        "steps": steps,
        "lr": LR,
        "segments_per_step": SEGMENTS_PER_STEP,
        "seed": seed,
    }


def fit_critic(
    cfg: Config,
    out: str | Path,
    *,
    instances: int = 400,
    plays: int = 8,
    steps: int = 300,
    seed: int = 0,
    log: Any = print,
) -> dict[str, Any]:
    """Fit, score and save the critic (module docstring); its report. Reuses ``out`` when its
    report names the same recipe."""
    from actors.evaluation import held_out_instances
    from learner.trainer import DTYPES

    out = Path(out)
    wanted = recipe(cfg, instances, plays, steps, seed)
    if (out / REPORT).is_file():
        report = json.loads((out / REPORT).read_text())
        if report.get("recipe") == wanted:
            log(f"{out} already holds this critic; reusing it")
            return report
    if out.exists() and any(out.iterdir()) and not (out / REPORT).is_file():
        raise FileExistsError(f"--out {out} exists and holds something else than a fitted critic")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    t0 = time.monotonic()
    held, held_tokens = play(cfg, held_out_instances(cfg, cfg.eval.episodes), plays)
    train, train_tokens = play(cfg, [(s, None) for s in range(instances)], plays)
    log(f"played {len(train.rows)} training and {len(held.rows)} held-out turns")
    monte_carlo_ev = explained(
        [held.returns[i] for i in held.scored], [held.monte_carlo[i] for i in held.scored]
    )
    value_function_ev = held.exact_value_ev
    critic = Critic(cfg.model.path, DTYPES[cfg.model.dtype])

    def scored(point: dict) -> None:
        log(
            f"step {point['step']}: held-out critic EV {point['held_out_critic_ev']:.3f} "
            f"(V^pi {value_function_ev:.3f})"
        )

    curve = fit(
        critic, train, held, steps=steps, lr=LR, segments_per_step=SEGMENTS_PER_STEP,
        score_every=SCORE_EVERY, rng=rng, on_score=scored,
    )  # fmt: skip
    final = curve[-1]["held_out_critic_ev"]
    report = {
        "recipe": wanted,
        "held_out_turns": len(held.rows),
        "train_turns": len(train.rows),
        "generated_tokens": {"train": train_tokens, "held_out": held_tokens},
        "held_out_turns_scored": len(held.scored),
        # the Monte-Carlo estimate's own (noisy with few plays), and V^pi's (exact_value_explained)
        "held_out_monte_carlo_ev": monte_carlo_ev,
        "held_out_value_function_ev": value_function_ev,
        "held_out_critic_ev": final,
        "critic_fraction_of_value_function": final / value_function_ev
        if value_function_ev > 0
        else None,
        "curve": curve,
        "wall_s": time.monotonic() - t0,
    }
    save_critic(critic, out)
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report
