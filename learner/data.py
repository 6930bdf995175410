"""From a broker batch to per-token training targets: rank split, micro-batches, advantages.

A batch holds whole episodes (each a list of segments in order). Every rank trains whole
episodes, so a compaction boundary can always bootstrap from the critic's value at the first
action of the episode's next segment; only a segment that ends truncated with no next segment
(turn budget) bootstraps from the value at the end of its own context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.trajectory import Segment
from learner.advantages import adaptive_lambda, gae, grpo_advantages


def group_episodes(segments: list[Segment]) -> list[list[Segment]]:
    """Segments in broker order -> episodes (lists of segments ordered by index)."""
    episodes: dict[str, list[Segment]] = {}
    for seg in segments:
        episodes.setdefault(seg.episode_id, []).append(seg)
    return [sorted(segs, key=lambda s: s.segment) for segs in episodes.values()]


def split_for_rank(episodes: list[list[Segment]], rank: int, world: int) -> list[list[Segment]]:
    """Greedy token balance (longest first); every rank computes the same assignment."""
    loads = [0] * world
    owner: dict[int, int] = {}
    order = sorted(range(len(episodes)), key=lambda i: -sum(s.num_tokens for s in episodes[i]))
    for i in order:
        r = loads.index(min(loads))
        owner[i] = r
        loads[r] += sum(s.num_tokens for s in episodes[i])
    return [ep for i, ep in enumerate(episodes) if owner[i] == rank]


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices packed so that (longest × count) stays under ``max_tokens`` per micro-batch."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def turn_starts(mask: torch.Tensor) -> list[int]:
    """First position of each action span (one span = one turn's sampled tokens)."""
    m = mask.bool()
    prev = torch.nn.functional.pad(m[:-1], (1, 0))
    return torch.nonzero(m & ~prev).flatten().tolist()


@dataclass
class Targets:
    advantages: torch.Tensor  # [T] policy advantages (0 off actions)
    returns: torch.Tensor  # [T] critic targets
    lam: float  # the policy lambda used (length-adaptive or fixed)


def segment_targets(
    mask: torch.Tensor,
    rewards: torch.Tensor,
    terminated: bool,
    values: torch.Tensor,
    end_value: float,
    next_value: float | None,
    *,
    gamma: float,
    lam: float,
    critic_lam: float,
    adaptive_alpha: float | None,
    max_segment_steps: int,
) -> Targets:
    """GAE for one segment, cut every ``max_segment_steps`` turns (each piece bootstrapped at its cut).

    ``mask``, ``rewards`` and ``values`` (V[t]) are the segment's tokens (no padding);
    ``terminated`` whether the episode ended in it; ``end_value`` the critic's value after its last
    token; ``next_value`` V at the first action of the episode's next segment, if the batch has it.
    """
    mask = mask.bool()
    if adaptive_alpha is not None:
        lam = adaptive_lambda(int(mask.sum()), adaptive_alpha)
    starts = turn_starts(mask)
    cuts = starts[max_segment_steps::max_segment_steps]  # dynamic truncation points
    bounds = [0, *cuts, len(mask)]
    adv, ret = torch.zeros(len(mask)), torch.zeros(len(mask))
    for piece, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        last_piece = piece == len(bounds) - 2
        if not last_piece:
            ends, boot = False, float(values[hi])
        else:
            ends = terminated
            boot = 0.0 if ends else (next_value if next_value is not None else end_value)
        sl = slice(lo, hi)
        adv[sl], _ = gae(
            rewards[sl],
            values[sl],
            mask[sl],
            gamma=gamma,
            lam=lam,
            terminated=ends,
            bootstrap_value=boot,
        )
        _, ret[sl] = gae(
            rewards[sl],
            values[sl],
            mask[sl],
            gamma=gamma,
            lam=critic_lam,
            terminated=ends,
            bootstrap_value=boot,
        )
    return Targets(adv, ret, lam)


def episode_rewards(episodes: list[list[Segment]]) -> list[float]:
    return [sum(s.reward for s in ep) for ep in episodes]


def grpo_episode_advantages(episodes: list[list[Segment]]) -> dict[str, float]:
    """GRPO: each episode's group-normalised reward, by episode id (every action token of the
    episode gets it)."""
    rewards = torch.tensor(episode_rewards(episodes))
    groups = [ep[0].group_id or ep[0].episode_id for ep in episodes]
    adv = grpo_advantages(rewards, groups)
    return {ep[0].episode_id: a for ep, a in zip(episodes, adv.tolist(), strict=True)}
