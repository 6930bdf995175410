"""Advantage estimators: GAE over the action tokens of a segment (critic-based PPO) and the
group-relative baseline of GRPO (critic-free, for comparison on the same data)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from functools import partial
from typing import NamedTuple

import torch

from learner.losses import as_bool_mask, check_same_shape
from learner.value import turn_starts


class Targets(NamedTuple):
    """Per-token training targets, for a segment ([T]) or a batch ([B, T])."""

    advantages: torch.Tensor  # policy advantages, 0 off action tokens
    returns: torch.Tensor  # the critic's targets (zeros when nothing learns a value)


def adaptive_lambda(length: int, alpha: float) -> float:
    """Length-adaptive GAE lambda (VAPO): lambda = 1 - 1 / (alpha * L), clamped to [0, 1].

    A long response needs lambda near 1 so that a sparse final reward still reaches its first
    tokens; a short one can trade that bias for lower variance. `length` is L, the number of
    action tokens.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be an int >= 0, got {length!r}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if alpha * length <= 1:  # 1 - 1/(alpha * L) <= 0, including L = 0
        return 0.0
    return 1.0 - 1.0 / (alpha * length)


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    terminated: bool,
    bootstrap_value: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) for one segment, all `[T]`.

    The recursion runs over the action positions in order; observation tokens are skipped, not
    steps, so "next" is the next action position:

        delta_t = r_t + gamma * V_next - V_t,    A_t = delta_t + gamma * lam * A_next.

    The value after the last action is 0 when the segment `terminated`, else `bootstrap_value`
    (the critic's value at the cut: treating a compaction or truncation boundary as terminal
    would flip the sign of the last advantages). Returns `(advantages, returns)` with
    returns = advantages + values, both 0 at observation positions. Values are targets here and
    are detached; the recursion runs in float64.
    """
    check_same_shape(rewards=rewards, values=values, action_mask=action_mask)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [T] (one segment), got shape {tuple(rewards.shape)}")
    if not (0 <= gamma <= 1 and 0 <= lam <= 1):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    mask = as_bool_mask(action_mask, "action_mask")
    off_action = ~mask & (rewards != 0)
    if off_action.any():
        pos = int(off_action.nonzero()[0])
        raise ValueError(
            f"rewards[{pos}] = {rewards[pos].item()} is on an observation position "
            f"(action_mask[{pos}] = 0); a reward belongs on the last action token of its step"
        )
    for name, tensor in (("rewards", rewards), ("values", values)):
        bad = mask & ~torch.isfinite(tensor)
        if bad.any():
            pos = int(bad.nonzero()[0])
            raise ValueError(f"{name}[{pos}] = {tensor[pos].item()} at an action position")
    last_value = 0.0 if terminated else _bootstrap_float(bootstrap_value)

    action_positions = mask.nonzero().squeeze(1)
    r = rewards[action_positions].tolist()
    v = values[action_positions].detach().tolist()
    next_v = v[1:] + [last_value]
    adv = [0.0] * len(v)
    running = 0.0
    for i in reversed(range(len(v))):
        delta = r[i] + gamma * next_v[i] - v[i]  # delta_t = r_t + gamma * V_next - V_t
        running = delta + gamma * lam * running  # A_t = delta_t + gamma * lam * A_next
        adv[i] = running

    dtype = torch.promote_types(rewards.dtype, values.dtype)
    advantages = torch.zeros(values.shape, dtype=dtype, device=values.device)
    advantages[action_positions] = torch.tensor(adv, dtype=dtype, device=values.device)
    returns = torch.where(mask, advantages + values.detach(), 0.0)  # R_t = A_t + V_t
    return advantages, returns


def _bootstrap_float(bootstrap_value: float | torch.Tensor | None) -> float:
    """The value after a truncated segment's last action, as a finite float."""
    if bootstrap_value is None:
        raise ValueError("bootstrap_value is required when the segment is not terminated")
    if isinstance(bootstrap_value, torch.Tensor) and bootstrap_value.ndim != 0:
        raise ValueError(
            f"bootstrap_value must be a float or 0-dim tensor, got {tuple(bootstrap_value.shape)}"
        )
    value = float(bootstrap_value)
    if not math.isfinite(value):
        raise ValueError(f"bootstrap_value must be finite, got {value}")
    return value


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable],
    *,
    eps: float = 1e-6,
    normalize_std: bool = True,
) -> torch.Tensor:
    """Group-relative advantage (GRPO, Shao et al. 2024), `[N]`:

        A_i = (r_i - mean_g) / (std_g + eps),   g the group of sample i, std the population std.

    With `normalize_std=False` only the group mean is subtracted (Dr. GRPO). A group whose rewards
    are all equal carries no signal and gets exactly 0, not rounding residue divided by eps.
    """
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if isinstance(group_ids, (str, bytes)) or not isinstance(group_ids, Sequence):
        raise TypeError(f"group_ids must be a sequence of ids, got {type(group_ids).__name__}")
    if len(group_ids) != len(rewards):
        raise ValueError(f"group_ids has length {len(group_ids)}, rewards has {len(rewards)}")
    if not torch.isfinite(rewards).all():
        raise ValueError(f"rewards must be finite, got {rewards.tolist()}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    index_of: dict[Hashable, int] = {}
    for i, group_id in enumerate(group_ids):
        if group_id is None:
            raise ValueError(f"group_ids[{i}] is None; GRPO needs a group for every sample")
        index_of.setdefault(group_id, len(index_of))
    group = torch.tensor([index_of[g] for g in group_ids], dtype=torch.long, device=rewards.device)

    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    zeros = r.new_zeros(len(index_of))
    count = torch.bincount(group, minlength=len(index_of)).to(r.dtype)
    mean = zeros.index_add(0, group, r) / count
    advantages = r - mean[group]
    if normalize_std:
        std = torch.sqrt(zeros.index_add(0, group, advantages**2) / count)  # population std
        advantages = advantages / (std[group] + eps)
    lowest = zeros.scatter_reduce(0, group, r, reduce="amin", include_self=False)
    highest = zeros.scatter_reduce(0, group, r, reduce="amax", include_self=False)
    all_equal = (lowest == highest)[group]
    return torch.where(all_equal, 0.0, advantages)


def per_turn(mask: torch.Tensor, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A segment seen turn by turn: the mask keeps each turn's first action token only and the
    turn's rewards sit there, so GAE's recursion steps once per turn, from the value of the
    state the turn starts in (turn-level credit: AReaL's ``gae_timestep_unit=turn``, Turn-PPO).
    """
    starts = turn_starts(mask)
    turn_mask = torch.zeros_like(mask, dtype=torch.bool)
    turn_mask[starts] = True
    turn_rewards = torch.zeros_like(rewards)
    for lo, hi in zip(starts, [*starts[1:], len(mask)], strict=True):
        turn_rewards[lo] = rewards[lo:hi].sum()
    return turn_mask, turn_rewards


def every_token_of_its_turn(mask: torch.Tensor, at_starts: torch.Tensor) -> torch.Tensor:
    """``at_starts`` (a value on each turn's first action token) on every action token of the
    turn, 0 elsewhere."""
    starts = torch.tensor(turn_starts(mask), dtype=torch.long)
    if not len(starts):
        return torch.zeros_like(at_starts)
    turn = torch.searchsorted(starts, torch.arange(len(mask)), right=True) - 1
    return torch.where(mask & (turn >= 0), at_starts[starts[turn.clamp(min=0)]], 0.0)


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
    unit: str = "token",
) -> Targets:
    """GAE for one segment, cut every ``max_segment_steps`` turns (each piece bootstrapped at its cut).

    ``mask``, ``rewards`` and ``values`` (V[t]) are the segment's tokens (no padding);
    ``terminated`` whether the episode ended in it; ``end_value`` the critic's value after its last
    token; ``next_value`` V at the first action of the episode's next segment, if the batch has it.
    ``unit`` ``turn`` makes a turn one step of the recursion (``per_turn``); every token of a turn
    then has the turn's advantage and return.
    """
    mask = mask.bool()
    if unit == "turn":
        turn_mask, turn_rewards = per_turn(mask, rewards)
        t = segment_targets(
            turn_mask, turn_rewards, terminated, values, end_value, next_value, gamma=gamma,
            lam=lam, critic_lam=critic_lam, adaptive_alpha=adaptive_alpha,
            max_segment_steps=max_segment_steps,
        )  # fmt: skip
        return Targets(*(every_token_of_its_turn(mask, x) for x in t))
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
        piece_gae = partial(
            gae, rewards[sl], values[sl], mask[sl], gamma=gamma, terminated=ends,
            bootstrap_value=boot,
        )  # fmt: skip
        adv[sl] = piece_gae(lam=lam)[0]  # the policy's advantages at its lambda
        ret[sl] = piece_gae(lam=critic_lam)[1]  # the critic's returns at its own
    return Targets(adv, ret)
