"""Learner losses: behavior-policy weights (IcePop, TIS), clipped PPO, clipped value loss, k3 KL
penalty and the clip-range schedule.

Pure functions on tensors of any shape `[...]` (typically batch x time): elementwise, summed over
`mask`, divided by `denominator`. The denominator defaults to the mask's token count; pass the
action-token count of the whole global batch instead and the micro-batch losses (and gradients)
add up to the full-batch loss. Masked tokens are zeroed with `torch.where` *before* any math, never
multiplied by the mask, so a non-finite value there reaches neither the loss nor the gradient
(inf * 0 = NaN).
"""

from __future__ import annotations

import torch

LOG_RATIO_LIMIT = 20.0  # |log w| is clamped here before exp: e^20 ~ 4.9e8 is finite in fp32/bf16


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise TypeError/ValueError naming the first argument that is not a tensor shaped like the
    first one, so shape bugs surface at the call, not as a broadcast deep inside a loss."""
    reference_name, reference = None, None
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if reference is None:
            reference_name, reference = name, tensor
        elif tensor.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {tuple(reference.shape)} "
                f"(the shape of {reference_name})"
            )


def as_bool_mask(mask: torch.Tensor, name: str = "mask") -> torch.Tensor:
    """Return a bool or {0, 1} mask as bool; any other value is a ValueError naming `name`."""
    if mask.dtype == torch.bool:
        return mask
    if torch.any((mask != 0) & (mask != 1)):
        raise ValueError(f"{name} must be bool or contain only 0 and 1")
    return mask != 0


def _select(mask: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Zero every tensor outside `mask`, so the formulas after it need no masking at all."""
    return [torch.where(mask, tensor, 0.0) for tensor in tensors]


def _denominator(
    mask: torch.Tensor, denominator: float | torch.Tensor | None
) -> float | torch.Tensor:
    """The loss divisor: the mask's token count (at least 1) unless the caller passes the global
    one, which keeps masked and dropped tokens in the average (as slime and AReaL do)."""
    if denominator is None:
        return mask.sum().clamp(min=1)
    if isinstance(denominator, torch.Tensor) and denominator.ndim != 0:
        raise ValueError(f"denominator must be a number or a 0-dim tensor, got {denominator.shape}")
    if not denominator > 0:
        raise ValueError(f"denominator must be > 0, got {denominator}")
    return denominator


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 KL estimator (Schulman 2020), (r - 1) - log r: unbiased for KL(q||p) on samples from q
    with r = p/q, and never negative."""
    return torch.exp(log_ratio) - 1 - log_ratio


def _behavior_ratio(
    prox_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """w = pi_prox / mu, detached, and where it is finite. A non-finite log-ratio is replaced by 0
    and a finite one clamped to +-LOG_RATIO_LIMIT before exp, so w itself is always finite."""
    check_same_shape(prox_logprobs=prox_logprobs, behavior_logprobs=behavior_logprobs)
    log_ratio = (prox_logprobs - behavior_logprobs).detach()
    finite = torch.isfinite(log_ratio)
    safe_log_ratio = torch.where(finite, log_ratio, 0.0).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(safe_log_ratio), finite


def icepop(
    prox_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    *,
    low: float = 0.5,
    high: float = 5.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """IcePop behavior weights (Ring-1T): w = pi_prox / mu where low <= w <= high, else 0.

    Tokens on which the inference engine and the learner disagree that much carry noise, not
    signal, so their policy gradient is dropped (masked, not clamped). Non-finite inputs or ratios
    are dropped too. Returns `(weights, keep)`: detached weights and the bool mask of kept tokens.
    """
    if not 0 <= low <= high:
        raise ValueError(f"icepop needs 0 <= low <= high, got low={low}, high={high}")
    ratio, finite = _behavior_ratio(prox_logprobs, behavior_logprobs)
    keep = finite & (ratio >= low) & (ratio <= high)
    return torch.where(keep, ratio, 0.0), keep


def truncated_is(
    prox_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    *,
    cap: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling (TIS): w = min(pi_prox / mu, cap).

    The alternative to IcePop: every token keeps a gradient, the cap bounds the variance. Only
    non-finite inputs or ratios are dropped. Returns `(weights, keep)` like `icepop`.
    """
    if not cap > 0:
        raise ValueError(f"truncated_is needs cap > 0, got {cap}")
    ratio, finite = _behavior_ratio(prox_logprobs, behavior_logprobs)
    return torch.where(finite, torch.clamp(ratio, max=cap), 0.0), finite


def ppo_policy_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO clipped surrogate (Hilton et al. 2022) with behavior weights w:

        loss = -sum_mask w * min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A) / denominator,
        rho = exp(logprobs - prox_logprobs) = pi_theta / pi_prox.

    The trust region is around the proximal policy; w (IcePop or TIS, detached) corrects for the
    stale behavior policy. Tokens with weight 0 are zeroed before exp, so their log-probs may be
    non-finite, but they stay in the default denominator `mask.sum()`.

    Returns the loss and a dict of detached 0-dim tensors, divided by the same denominator so that,
    like the loss, they add up over micro-batches and can be all-reduced:
      clip_fraction: share of tokens where the clipped branch was active (no gradient there);
      approx_kl: k3 estimate of KL(pi_prox || pi_theta), (rho - 1) - log rho.
    """
    check_same_shape(
        logprobs=logprobs,
        prox_logprobs=prox_logprobs,
        advantages=advantages,
        weights=weights,
        mask=mask,
    )
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    mask = as_bool_mask(mask)
    in_loss = mask & (weights != 0)
    logprobs, prox_logprobs, advantages, weights = _select(
        in_loss, logprobs, prox_logprobs.detach(), advantages.detach(), weights.detach()
    )
    log_ratio = logprobs - prox_logprobs
    ratio = torch.exp(log_ratio)
    surrogate = ratio * advantages
    clipped_surrogate = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    per_token = -weights * torch.minimum(surrogate, clipped_surrogate)

    denominator = _denominator(mask, denominator)
    loss = per_token.sum() / denominator
    with torch.no_grad():
        stats = {
            "clip_fraction": (clipped_surrogate < surrogate).sum() / denominator,
            "approx_kl": _k3(log_ratio).sum() / denominator,
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float = 0.2,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Clipped value loss (PPO2):

        0.5 * sum_mask max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2) / denominator.

    The max keeps one update from moving the critic far from the values the advantages came from.
    `old_values` and `returns` are targets and are detached.
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    if not clip >= 0:
        raise ValueError(f"value_loss needs clip >= 0, got {clip}")
    mask = as_bool_mask(mask)
    values, old_values, returns = _select(mask, values, old_values.detach(), returns.detach())
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped_values - returns) ** 2)
    return per_token.sum() / _denominator(mask, denominator)


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    *,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean entropy H_t of pi_theta over the action tokens, sum_mask H_t / denominator; the loss
    subtracts entropy_coef times it, so a policy cannot collapse onto one answer before the
    reward has told it which (off by default, as in the recipes this project follows)."""
    check_same_shape(entropy=entropy, mask=mask)
    mask = as_bool_mask(mask)
    (entropy,) = _select(mask, entropy)
    return entropy.sum() / _denominator(mask, denominator)


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """k3 estimate of KL(pi_theta || pi_ref) on the sampled tokens, (r - 1) - log r with
    r = pi_ref / pi_theta, summed over `mask` / denominator. An optional regularizer toward a
    frozen reference (off by default: Ring-1T and GLM-5 trained without it)."""
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    mask = as_bool_mask(mask)
    logprobs, ref_logprobs = _select(mask, logprobs, ref_logprobs.detach())
    return _k3(ref_logprobs - logprobs).sum() / _denominator(mask, denominator)


def clip_schedule(step: int, total_steps: int, *, start: float = 0.2, end: float = 0.05) -> float:
    """PPO clip range at `step`: linear from `start` to `end` over `total_steps`, then held at
    `end`; a shrinking range tightens the trust region as the policy sharpens."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be > 0, got {total_steps}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    progress = min(step / total_steps, 1.0)
    return start + (end - start) * progress  # eps = start + (end - start) * min(step / total, 1)
