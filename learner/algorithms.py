"""The choices inside a learner step, as registries (the verl ``core_algos`` way): the trainer
looks ``learner.algorithm`` and ``learner.correction`` up here and never branches on them.

* **Estimators** turn scored segments into per-token targets: ``ppo`` is GAE per segment,
  bootstrapped across compaction cuts from the critic's value at the next segment's first action
  (docs/architecture.md, Learner step); ``grpo`` is the group-relative baseline over whole
  episodes, the same advantage on every action token, and no critic targets.
* **Anchors** are π_old of the clipped ratio π_θ/π_old: ``recompute`` is decoupled PPO's π_prox,
  ``behavior`` the actors' μ (naive PPO: staleness then moves the trust region itself).
* **Corrections** weight each action token by the behavior ratio w = π_prox/μ of decoupled PPO:
  ``icepop`` masks tokens whose w leaves [low, high], ``tis`` truncates w at a cap, ``none`` keeps 1.

Every function here is pure: tensors in, tensors out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from common.config import LearnerConfig
from common.trajectory import Segment
from learner.advantages import Targets, grpo_advantages, segment_targets
from learner.batch import Batch
from learner.losses import icepop, truncated_is
from learner.value import turn_starts


class Scores(NamedTuple):
    """The no-grad pass over a ``Batch``: [B, T] tensors aligned to its tokens (0 on padding)."""

    prox: torch.Tensor  # log π_prox(token_t)
    values: torch.Tensor  # V_t, the value of the state in which token t is chosen
    end_values: torch.Tensor  # [B] the critic's value after each row's last token
    ref: torch.Tensor | None  # reference-policy log-probs (KL penalty), None without one
    entropy: torch.Tensor  # H_t of π_prox's distribution at token t (a statistic, not a loss)


Estimator = Callable[[Batch, Scores, list[list[Segment]], LearnerConfig], Targets]


def gae_targets(
    batch: Batch, scores: Scores, episodes: list[list[Segment]], lc: LearnerConfig
) -> Targets:
    """GAE per row; a segment cut by compaction bootstraps from the value at the first action
    of the episode's next segment, one cut by the turn budget from its own end value (or, with
    ``cut_bootstrap: zero``, every cut from 0)."""
    advantages, returns = torch.zeros_like(scores.prox), torch.zeros_like(scores.prox)
    for i, (n, nxt) in enumerate(zip(batch.lengths.tolist(), batch.next_row.tolist(), strict=True)):
        next_value = (
            float(scores.values[nxt][turn_starts(batch.action_mask[nxt])[0]]) if nxt >= 0 else None
        )
        end_value = float(scores.end_values[i])
        if lc.cut_bootstrap == "zero":  # the ablation: a cut ends its segment's return at 0
            next_value, end_value = 0.0, 0.0
        t = segment_targets(
            batch.action_mask[i, :n],
            batch.rewards[i, :n],
            bool(batch.terminated[i]),
            scores.values[i, :n],
            end_value,
            next_value,
            gamma=lc.gamma,
            lam=lc.lam,
            critic_lam=lc.critic.lam,
            adaptive_alpha=lc.adaptive_lambda_alpha or None,
            max_segment_steps=lc.max_segment_steps,
            unit=lc.gae_unit,
        )
        advantages[i, :n], returns[i, :n] = t.advantages, t.returns
    return Targets(advantages, returns)


def grpo_targets(
    batch: Batch, scores: Scores, episodes: list[list[Segment]], lc: LearnerConfig
) -> Targets:
    """Group-relative advantages over every episode of the batch (all ranks' groups), on the
    action tokens of this rank's rows."""
    by_episode = grpo_episode_advantages(episodes)
    per_row = torch.tensor([by_episode[s.episode_id] for s in batch.segments])
    return Targets(batch.action_mask * per_row[:, None], torch.zeros_like(scores.prox))


ESTIMATORS: dict[str, Estimator] = {"ppo": gae_targets, "grpo": grpo_targets}


def episode_rewards(episodes: list[list[Segment]]) -> list[float]:
    return [sum(s.reward for s in ep) for ep in episodes]


def grpo_episode_advantages(episodes: list[list[Segment]]) -> dict[str, float]:
    """GRPO: each episode's group-normalised reward, by episode id (every action token of the
    episode gets it)."""
    rewards = torch.tensor(episode_rewards(episodes))
    groups = [ep[0].group_id or ep[0].episode_id for ep in episodes]
    adv = grpo_advantages(rewards, groups)
    return {ep[0].episode_id: a for ep, a in zip(episodes, adv.tolist(), strict=True)}


# Advantage normalisation over the global batch's action tokens, from their mean and standard
# deviation (all ranks). Under Adam a step's size hardly depends on the advantages' scale, but a
# negative mean pushes mass to tokens never sampled (issue 14: junk-token mass 0.008 -> 0.98 in
# 20 steps at a constant A = -0.5); centring removes that drift.
AdvantageNorm = Callable[[torch.Tensor, float, float], torch.Tensor]
ADVANTAGE_NORMS: dict[str, AdvantageNorm] = {
    "none": lambda adv, mean, std: adv,
    "centre": lambda adv, mean, std: adv - mean,
    "whiten": lambda adv, mean, std: (adv - mean) / (std + 1e-8),
}

# π_old of the clipped ratio ρ = π_θ/π_old (losses.ppo_policy_loss). Decoupled PPO (Hilton et al.
# 2022) recomputes π_prox just before the step and corrects the stale μ with w = π_prox/μ; naive
# PPO clips against μ itself, AReaL's baseline for asynchronous training.
ANCHORS: dict[str, Callable[[Batch, Scores], torch.Tensor]] = {
    "recompute": lambda batch, scores: scores.prox,
    "behavior": lambda batch, scores: batch.behavior_logprobs,
}

Correction = Callable[
    [torch.Tensor, torch.Tensor, LearnerConfig], tuple[torch.Tensor, torch.Tensor]
]
CORRECTIONS: dict[str, Correction] = {
    "icepop": lambda prox, mu, lc: icepop(prox, mu, low=lc.icepop_low, high=lc.icepop_high),
    "tis": lambda prox, mu, lc: truncated_is(prox, mu, cap=lc.tis_cap),
    "none": lambda prox, mu, lc: (torch.ones_like(prox), torch.ones_like(prox, dtype=torch.bool)),
}


def behavior_weights(
    batch: Batch, prox: torch.Tensor, lc: LearnerConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T]: the correction's weight on action tokens (0 elsewhere), and which action tokens
    it kept."""
    w, keep = CORRECTIONS[lc.correction](prox, batch.behavior_logprobs, lc)
    return torch.where(batch.action_mask, w, 0.0), keep & batch.action_mask
