"""The choices inside a learner step, as registries (the verl ``core_algos`` way): the trainer
looks ``learner.algorithm`` and ``learner.correction`` up here and never branches on them.

* **Estimators** turn scored segments into per-token targets: ``ppo`` is GAE per segment,
  bootstrapped across compaction cuts from the critic's value at the next segment's first action
  (docs/architecture.md, Learner step); ``grpo`` is the group-relative baseline over whole
  episodes, the same advantage on every action token, and no critic targets.
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
from learner import data
from learner.losses import icepop, truncated_is


class Scores(NamedTuple):
    """The no-grad pass, one 1-D tensor per segment (aligned to its tokens)."""

    prox: list[torch.Tensor]  # log π_prox(token_t)
    values: list[torch.Tensor]  # V_t, the value of the state in which token t is chosen
    end_values: list[float]  # the critic's value after the segment's last token
    ref: list[torch.Tensor] | None  # reference-policy log-probs (KL penalty), None without one


class Targets(NamedTuple):
    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]  # the critic's targets (zeros when nothing learns a value)


Estimator = Callable[[list[list[Segment]], list[Segment], Scores, LearnerConfig], Targets]


def gae_targets(
    episodes: list[list[Segment]], segs: list[Segment], scores: Scores, lc: LearnerConfig
) -> Targets:
    """GAE per segment; a segment cut by compaction bootstraps from the value at the first
    action of the episode's next segment, one cut by the turn budget from its own end value."""
    advantages, returns = [], []
    for i, seg in enumerate(segs):
        nxt = (
            segs[i + 1] if i + 1 < len(segs) and segs[i + 1].episode_id == seg.episode_id else None
        )
        next_value = (
            float(scores.values[i + 1][data.turn_starts(torch.from_numpy(nxt.action_mask))[0]])
            if nxt
            else None
        )
        t = data.segment_targets(
            seg,
            scores.values[i],
            scores.end_values[i],
            next_value,
            gamma=lc.gamma,
            lam=lc.lam,
            critic_lam=lc.critic_lam,
            adaptive_alpha=lc.adaptive_lambda_alpha,
            max_segment_steps=lc.max_segment_steps,
        )
        advantages.append(t.advantages)
        returns.append(t.returns)
    return Targets(advantages, returns)


def grpo_targets(
    episodes: list[list[Segment]], segs: list[Segment], scores: Scores, lc: LearnerConfig
) -> Targets:
    """Group-relative advantages over every episode of the batch (all ranks' groups), then the
    ones of this rank's segments."""
    everything = [s for ep in episodes for s in ep]
    by_id = dict(zip((s.traj_id for s in everything), data.grpo_targets(episodes), strict=True))
    return Targets([by_id[s.traj_id] for s in segs], [torch.zeros(s.num_tokens) for s in segs])


ESTIMATORS: dict[str, Estimator] = {"ppo": gae_targets, "grpo": grpo_targets}

Correction = Callable[
    [torch.Tensor, torch.Tensor, LearnerConfig], tuple[torch.Tensor, torch.Tensor]
]
CORRECTIONS: dict[str, Correction] = {
    "icepop": lambda prox, mu, lc: icepop(prox, mu, low=lc.icepop_low, high=lc.icepop_high),
    "tis": lambda prox, mu, lc: truncated_is(prox, mu, cap=lc.tis_cap),
    "none": lambda prox, mu, lc: (torch.ones_like(prox), torch.ones_like(prox, dtype=torch.bool)),
}


def behavior_weights(
    segs: list[Segment], prox: list[torch.Tensor], masks: list[torch.Tensor], lc: LearnerConfig
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per segment: the correction's weight on action tokens (``masks``; 0 elsewhere), and which
    action tokens it kept."""
    weights, keeps = [], []
    for seg, p, mask in zip(segs, prox, masks, strict=True):
        mu = torch.from_numpy(seg.behavior_logprobs.astype("float32"))
        w, keep = CORRECTIONS[lc.correction](p, mu, lc)
        weights.append(torch.where(mask, w, 0.0))
        keeps.append(keep & mask)
    return weights, keeps
