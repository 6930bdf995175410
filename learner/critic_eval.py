"""A learner checkpoint's critic, scored on held-out episodes beside the value function itself.

The critic's explained variance in the step log is measured on the batch it is about to train on.
Whether it predicts returns on states it never saw, and how much of the predictable part it has
found, is measured here: ``asyncppo eval --checkpoint DIR`` plays every held-out instance
``eval.value_samples`` times with the checkpoint's policy, and scores every turn's state with

* the critic: V(s) at the state in which the turn's first action token is chosen, computed by the
  learner's own scoring pass (``TrainStep.score``), as GAE reads it;
* the Monte-Carlo value function V^π(s): the mean return of the *other* episodes of the same
  instance that passed through the same state (leave-one-out, so an episode's return never
  predicts itself). A state is the instance and what the environment's ``info`` said before the
  turn (chain: turns played, wrong answers): there the estimate converges to the exact V^π of the
  policy being evaluated, the best predictor of the return from a state; its sampling noise
  lowers its explained variance by about 1/K, so a critic can come out slightly above it.

Both against the realised return-to-go R_t = Σ_{t' ≥ t} γ^{t'-t} r_{t'} of every turn (population
variances, as the learner's explained variance): EV = 1 − Var(R − V) / Var(R).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import torch

from common.config import Config
from common.model import state_dict_for_export
from common.trajectory import Segment
from learner.batch import Batch
from learner.step import Models, TrainStep, build_models
from learner.trainer import DTYPES
from learner.value import exact_value_explained, explained, leave_one_out, turn_returns, turn_starts

MODEL_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's file of the (unpartitioned) module


def checkpoint_file(ckpt_dir: Path, model: str, tag: str | None) -> Path:
    """``<ckpt_dir>/<model>/<tag>/mp_rank_00_model_states.pt``; the tag from ``latest`` unless
    given. Errors name the directory that lacks what."""
    root = Path(ckpt_dir) / model
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            raise FileNotFoundError(
                f"checkpoint {root}: no 'latest' file (not a learner checkpoint)"
            )
        tag = latest.read_text().strip()
    path = root / tag / MODEL_STATES
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {root}: no {tag}/{MODEL_STATES}")
    return path


def load_models(cfg: Config, ckpt_dir: Path, tag: str | None = None) -> tuple[Models, int]:
    """The policy and critic of a learner checkpoint, as plain modules in eval mode, and the
    policy version it holds.

    ZeRO-3 checkpoints hold partitions, and LoRA ones adapters the engine would have to merge:
    both are refused with a message rather than loaded wrong.
    """
    lc = cfg.learner
    if lc.algorithm != "ppo":
        raise ValueError(f"learner.algorithm={lc.algorithm!r} trains no critic to score")
    if lc.zero_stage == 3:
        raise ValueError("a ZeRO-3 checkpoint is partitioned: score one from zero_stage 0-2")
    if lc.lora.rank:
        raise ValueError("scoring a LoRA checkpoint's critic is not supported yet")
    models = build_models(lc, cfg.model.path, DTYPES[cfg.model.dtype], lambda module, lr: module)
    version = -1
    parts = [("policy", models.policy)] + ([("critic", models.critic)] if models.critic else [])
    for name, module in parts:
        path = checkpoint_file(ckpt_dir, name, tag)
        # DeepSpeed's file holds its config and client state beside the tensors: not weights-only
        saved = torch.load(path, map_location="cpu", weights_only=False)
        try:
            module.load_state_dict(saved["module"])
        except (KeyError, RuntimeError) as exc:
            raise ValueError(f"checkpoint {path} does not fit the learner config: {exc}") from exc
        module.eval().requires_grad_(False)
        if name == "policy":
            version = int(saved.get("version", -1))
    return models, version


def policy_weights(models: Models) -> dict[str, torch.Tensor]:
    """The checkpoint's policy as the weights an actor's engine loads (``load_weights``)."""
    return state_dict_for_export(models.policy.policy)


def critic_values(
    cfg: Config, models: Models, episodes: Sequence[Sequence[Segment]]
) -> list[list[float]]:
    """V(s) of every turn of every episode, by the learner's scoring pass."""
    segments = [seg for ep in episodes for seg in ep]
    values = TrainStep(cfg.learner, models, device="cpu").score(Batch.of(segments)).values
    per_segment = [
        [float(values[row, start]) for start in turn_starts(seg.action_mask)]
        for row, seg in enumerate(segments)
    ]
    out, row = [], 0
    for ep in episodes:
        out.append([v for seg_values in per_segment[row : row + len(ep)] for v in seg_values])
        row += len(ep)
    return out


def score_critic(
    cfg: Config,
    models: Models,
    played: Sequence[tuple[Hashable, Sequence[Hashable], Sequence[Segment]]],
) -> dict[str, Any]:
    """The critic's, the Monte-Carlo value function's and V^π's (``exact_value_explained``)
    explained variance of the return, on the turns whose state another episode also reached
    (all on the same turns)."""
    instances, states, episodes = zip(*played, strict=True) if played else ((), (), ())
    values = critic_values(cfg, models, episodes) if episodes else []
    keys, returns, critic, episode = [], [], [], []
    skipped = 0
    for index, (instance, trail, segs, vals) in enumerate(
        zip(instances, states, episodes, values, strict=True)
    ):
        rets = turn_returns(segs, cfg.learner.gamma)
        if not len(trail) == len(rets) == len(vals):  # a turn that sampled no token
            skipped += 1
            continue
        keys += [(instance, s) for s in trail]
        returns += rets
        critic += vals
        episode += [index] * len(rets)
    mc = leave_one_out(keys, returns, episode)
    kept = [i for i, v in enumerate(mc) if v is not None]
    r = [returns[i] for i in kept]
    critic_ev = explained(r, [critic[i] for i in kept])
    value_ev = explained(r, [mc[i] for i in kept])
    exact_ev = exact_value_explained(keys, returns, episode)
    return {
        "turns": len(returns),
        "turns_scored": len(kept),
        "episodes_skipped": skipped,  # turns and action runs disagree: not scorable
        "samples_per_instance": cfg.eval.value_samples,
        "critic_explained_variance": critic_ev,
        "value_function_explained_variance": value_ev,
        "critic_fraction_of_value_function": critic_ev / value_ev if value_ev > 0 else None,
        # V^π's own, free of the Monte-Carlo estimate's noise (exact_value_explained)
        "exact_value_function_explained_variance": exact_ev,
        "critic_fraction_of_exact_value_function": critic_ev / exact_ev if exact_ev > 0 else None,
        "critic_explained_variance_all_turns": explained(returns, critic),
    }
