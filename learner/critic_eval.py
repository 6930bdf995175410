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

from collections import defaultdict
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.config import Config
from common.model import state_dict_for_export
from common.trajectory import Segment
from learner.batch import Batch
from learner.step import Models, TrainStep, build_models, explained_variance, value_sums
from learner.trainer import DTYPES

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


def turn_starts(action_mask: np.ndarray) -> list[int]:
    """Index of each turn's first action token: where a run of action tokens begins."""
    mask = np.asarray(action_mask, dtype=bool)
    return [int(i) for i in np.flatnonzero(mask & ~np.r_[False, mask[:-1]])]


def turn_returns(segments: Sequence[Segment], gamma: float) -> list[float]:
    """R_t = r_t + γ R_{t+1} per turn of an episode (its segments in order): r_t is the reward
    on the turn's action tokens."""
    rewards = [
        float(seg.rewards[start:end].sum())
        for seg in segments
        for start, end in _turn_spans(seg.action_mask)
    ]
    returns, ahead = [], 0.0
    for r in reversed(rewards):
        ahead = r + gamma * ahead
        returns.append(ahead)
    return returns[::-1]


def _turn_spans(action_mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each turn's action tokens and the observation after them: a turn's
    reward sits on its action tokens (``SegmentBuilder.act``)."""
    starts = turn_starts(action_mask)
    return list(zip(starts, [*starts[1:], len(action_mask)], strict=True))


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


def _others(
    states: Sequence[Hashable], returns: Sequence[float], episode: Sequence[int]
) -> list[tuple[float, int]]:
    """For each turn, the sum and the count of the returns of the turns of *other* episodes in
    the same state. (An episode visits a state at most once where the state counts turns; where
    it can revisit one, its own visits are all left out.)"""
    total: dict[Hashable, float] = defaultdict(float)
    count: dict[Hashable, int] = defaultdict(int)
    own: dict[tuple[Hashable, int], tuple[float, int]] = defaultdict(lambda: (0.0, 0))
    for s, r, e in zip(states, returns, episode, strict=True):
        total[s] += r
        count[s] += 1
        t, c = own[s, e]
        own[s, e] = (t + r, c + 1)
    return [
        (total[s] - own[s, e][0], count[s] - own[s, e][1])
        for s, e in zip(states, episode, strict=True)
    ]


def leave_one_out(
    states: Sequence[Hashable], returns: Sequence[float], episode: Sequence[int]
) -> list[float | None]:
    """For each turn, the mean return of the turns of other episodes in the same state (the
    Monte-Carlo value of the state); None where no other episode reached it."""
    return [t / n if n else None for t, n in _others(states, returns, episode)]


def exact_value_explained(
    states: Sequence[Hashable], returns: Sequence[float], episode: Sequence[int]
) -> float:
    """The explained variance of V^π itself on the turns another episode also reached,
    estimated without the sampling noise of its Monte-Carlo estimate m (the mean of the n other
    plays' returns), which ``explained(R, m)`` counts against the value function.

    Given the state, R and the n other returns are independent draws of one distribution with
    variance σ²_s, so E[(R − m)² | s] = σ²_s (1 + 1/n) while E[(R − V^π)² | s] = σ²_s: each
    squared residual weighted by n/(n+1) estimates V^π's, and V^π's residual has mean 0, so
    EV = 1 − Σ (R − m)² n/(n+1) / Σ (R − R̄)². With few plays m is noisy enough that a critic
    can "beat" it; this is the figure a critic is compared with."""
    others = _others(states, returns, episode)
    kept = [(r, t / n, n) for r, (t, n) in zip(returns, others, strict=True) if n]
    if not kept:
        return 0.0
    r, m, n = (np.array(x, dtype=np.float64) for x in zip(*kept, strict=True))
    var_r = float(np.var(r))
    if var_r <= 1e-12:
        return 0.0
    return 1.0 - float(np.mean((r - m) ** 2 * n / (n + 1))) / var_r


def explained(returns: Sequence[float], predictions: Sequence[float]) -> float:
    """1 − Var(R − V) / Var(R), the learner's formula."""
    r, v = (
        torch.tensor(returns, dtype=torch.float64),
        torch.tensor(predictions, dtype=torch.float64),
    )
    return explained_variance(value_sums(r, v))


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
