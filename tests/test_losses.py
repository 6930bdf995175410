"""Importance weights, PPO/value/KL losses and the clip schedule, on hand-computed vectors."""

import math

import pytest
import torch

from learner.losses import (
    clip_schedule,
    entropy_bonus,
    icepop,
    kl_penalty,
    ppo_policy_loss,
    truncated_is,
    value_loss,
)

NAN, INF = float("nan"), float("inf")


def log(*xs: float) -> torch.Tensor:
    return torch.tensor([math.log(x) for x in xs])


def test_icepop_keeps_ratios_inside_bounds():
    # behavior = 0, so w = exp(prox) = [1, 2, 0.25, 6] against [0.5, 5]
    weights, keep = icepop(log(1.0, 2.0, 0.25, 6.0), torch.zeros(4))
    assert keep.tolist() == [True, True, False, False]
    assert weights.tolist() == pytest.approx([1.0, 2.0, 0.0, 0.0])


def test_icepop_bounds_are_inclusive():
    # w = exp(log 0.5) and exp(log 5) computed as icepop does, equal to low/high bit for bit
    prox = torch.tensor([math.log(0.5), math.log(5.0)])
    low, high = torch.exp(prox).tolist()
    weights, keep = icepop(prox, torch.zeros(2), low=low, high=high)
    assert keep.tolist() == [True, True]
    assert weights.tolist() == [low, high]
    # one ulp outside either bound is dropped
    nudged = torch.nextafter(prox, torch.tensor([-INF, INF]))
    assert icepop(nudged, torch.zeros(2), low=low, high=high)[1].tolist() == [False, False]


def test_importance_weights_drop_non_finite_inputs():
    prox = torch.tensor([0.0, 0.0, 0.0, -INF, INF, 0.0])
    behavior = torch.tensor([NAN, INF, -INF, 0.0, INF, 0.0])
    for weights, keep in (icepop(prox, behavior), truncated_is(prox, behavior)):
        assert keep.tolist() == [False] * 5 + [True]
        assert weights.tolist() == [0.0] * 5 + [1.0]


def test_importance_weights_are_detached():
    prox = torch.zeros(3, requires_grad=True)
    for weights, _ in (icepop(prox, torch.zeros(3)), truncated_is(prox, torch.zeros(3))):
        assert not weights.requires_grad


def test_huge_log_ratio_is_clamped_not_inf():
    # log w = 100 is clamped to 20 before exp: finite, above IcePop's high, capped by TIS
    prox = torch.tensor([100.0])
    weights, keep = icepop(prox, torch.zeros(1))
    assert weights.tolist() == [0.0] and keep.tolist() == [False]
    assert truncated_is(prox, torch.zeros(1), cap=2.0)[0].tolist() == [2.0]


def test_truncated_is_caps():
    # w = [0.25, 1, 3] -> min(w, 2) = [0.25, 1, 2]; every finite token kept
    weights, keep = truncated_is(log(0.25, 1.0, 3.0), torch.zeros(3), cap=2.0)
    assert weights.tolist() == pytest.approx([0.25, 1.0, 2.0])
    assert keep.all()


# rho = [1.5, 0.5, 0.5, 1.5] against clip [0.8, 1.2], A = [+1, +1, -1, -1]:
#   t0: min(1.5, 1.2) = 1.2 clipped   t1: min(0.5, 0.8) = 0.5 unclipped
#   t2: min(-0.5, -0.8) = -0.8 clipped   t3: min(-1.5, -1.2) = -1.5 unclipped
RHO = (1.5, 0.5, 0.5, 1.5)
ADV = torch.tensor([1.0, 1.0, -1.0, -1.0])


def test_ppo_clips_both_signs_of_advantage():
    logprobs = log(*RHO).requires_grad_()
    loss, stats = ppo_policy_loss(logprobs, torch.zeros(4), ADV, torch.ones(4), torch.ones(4))
    loss.backward()
    # loss = -(1.2 + 0.5 - 0.8 - 1.5) / 4 = 0.15
    assert loss.item() == pytest.approx(0.15)
    # d/dlogp of -rho*A/4 where unclipped, 0 where clipped: [0, -0.5/4, 0, 1.5/4]
    assert logprobs.grad.tolist() == pytest.approx([0.0, -0.125, 0.0, 0.375])
    assert stats["clip_fraction"].item() == 0.5
    # k3 mean: ((0.5 - ln 1.5) * 2 + (ln 2 - 0.5) * 2) / 4 = 0.1438410
    assert stats["approx_kl"].item() == pytest.approx(0.1438410, rel=1e-6)
    assert all(v.ndim == 0 and not v.requires_grad for v in stats.values())


def test_ppo_asymmetric_clip_and_weights():
    # clip_high = 0.28: t0 -> min(1.5, 1.28) = 1.28; weights [2, 1, 1, 0.5]
    # loss = -(2*1.28 + 0.5 - 0.8 - 0.5*1.5) / 4 = -(1.51) / 4 = -0.3775
    weights = torch.tensor([2.0, 1.0, 1.0, 0.5])
    loss, _ = ppo_policy_loss(
        log(*RHO), torch.zeros(4), ADV, weights, torch.ones(4), clip_high=0.28
    )
    assert loss.item() == pytest.approx(-0.3775)


def test_ppo_masked_and_dropped_tokens_stay_out_but_count_in_denominator():
    # t1 masked out with a NaN log-prob, t2 dropped (weight 0) with -inf log-probs; t0, t3 as above
    logprobs = torch.tensor([math.log(1.5), NAN, -INF, math.log(1.5)], requires_grad=True)
    prox = torch.tensor([0.0, 0.0, -INF, 0.0])
    mask = torch.tensor([True, False, True, True])
    weights = torch.tensor([1.0, 1.0, 0.0, 1.0])
    loss, stats = ppo_policy_loss(logprobs, prox, ADV, weights, mask)
    loss.backward()
    # denominator = mask.sum() = 3: loss = -(1.2 - 1.5) / 3 = 0.1
    assert loss.item() == pytest.approx(0.1)
    assert logprobs.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.5])  # -rho*A/3 = 1.5/3
    assert stats["clip_fraction"].item() == pytest.approx(1 / 3)


def test_icepop_with_non_finite_behavior_gives_finite_loss_and_grad():
    logprobs = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    prox = torch.tensor([-1.0, -2.0, -0.5])
    behavior = torch.tensor([NAN, INF, -1.0])
    weights, _ = icepop(prox, behavior)
    loss, stats = ppo_policy_loss(logprobs, prox, torch.ones(3), weights, torch.ones(3))
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[:2].tolist() == [0.0, 0.0]
    assert all(torch.isfinite(v) for v in stats.values())


def test_icepop_without_mismatch_equals_plain_ppo():
    torch.manual_seed(0)
    logprobs = -torch.rand(3, 5)
    prox = logprobs + 0.3 * torch.randn(3, 5)
    advantages = torch.randn(3, 5)
    mask = torch.rand(3, 5) > 0.3
    weights, keep = icepop(prox, prox.clone())
    assert keep.all()

    def loss_and_grad(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lp = logprobs.clone().requires_grad_()
        loss, _ = ppo_policy_loss(lp, prox, advantages, w, mask)
        loss.backward()
        return loss, lp.grad

    loss_icepop, grad_icepop = loss_and_grad(weights)
    loss_plain, grad_plain = loss_and_grad(torch.ones(3, 5))
    assert torch.equal(loss_icepop, loss_plain)
    assert torch.equal(grad_icepop, grad_plain)


def test_value_loss_clips_both_directions():
    # clip 0.2, V_old = 1 except where noted:
    #   t0: V 1.5,  R 2: max(.25, (1.2-2)^2 = .64)  = .64 clipped (no grad)
    #   t1: V 1.5,  R 1: max(.25, (1.2-1)^2 = .04)  = .25 unclipped, grad (V-R)/4 = .125
    #   t2: V 1.125, R 2: inside the clip range      = .765625, grad (V-R)/4 = -.21875
    #   t3: V 0.5,  R 0: max(.25, (0.8-0)^2 = .64)  = .64 clipped (no grad)
    # loss = 0.5 * (.64 + .25 + .765625 + .64) / 4 = 0.286953125
    values = torch.tensor([1.5, 1.5, 1.125, 0.5], requires_grad=True)
    returns = torch.tensor([2.0, 1.0, 2.0, 0.0])
    loss = value_loss(values, torch.ones(4), returns, torch.ones(4, dtype=torch.bool))
    loss.backward()
    assert loss.item() == pytest.approx(0.286953125)
    assert values.grad.tolist() == pytest.approx([0.0, 0.125, -0.21875, 0.0])


def test_kl_penalty_k3():
    # r = pi_ref/pi = [2, 1, masked]: k3 = [(2 - 1) - ln 2, 0] -> mean over 2 tokens = 0.1534264
    logprobs = torch.tensor([0.0, -1.0, NAN], requires_grad=True)
    ref = torch.tensor([math.log(2.0), -1.0, 0.0])
    loss = kl_penalty(logprobs, ref, torch.tensor([1, 1, 0]))
    loss.backward()
    assert loss.item() == pytest.approx(0.1534264, rel=1e-6)
    # d/dlogp [(r - 1) - log r] = 1 - r: [(1 - 2)/2, 0, 0]
    assert logprobs.grad.tolist() == pytest.approx([-0.5, 0.0, 0.0])


def test_entropy_bonus_is_the_mean_over_action_tokens():
    # H = [1.5, 0.5, masked]: the mean over the 2 action tokens is 1.0; a denominator of 4 counts
    # tokens of other micro-batches too
    entropy = torch.tensor([1.5, 0.5, NAN], requires_grad=True)
    bonus = entropy_bonus(entropy, torch.tensor([1, 1, 0]))
    bonus.backward()
    assert bonus.item() == pytest.approx(1.0)
    assert entropy.grad.tolist() == pytest.approx([0.5, 0.5, 0.0])
    assert entropy_bonus(entropy.detach(), torch.tensor([1, 1, 0]), denominator=4).item() == 0.5


LOSSES = {
    "ppo": lambda x, y, z, m, d: ppo_policy_loss(x, y, z, torch.ones_like(x), m, denominator=d)[0],
    "value": lambda x, y, z, m, d: value_loss(x, y, z, m, denominator=d),
    "kl": lambda x, y, z, m, d: kl_penalty(x, y, m, denominator=d),
    "entropy": lambda x, y, z, m, d: entropy_bonus(x, m, denominator=d),
}


@pytest.mark.parametrize("name", LOSSES)
def test_micro_batches_with_global_denominator_sum_to_full_batch(name):
    torch.manual_seed(1)
    x = -torch.rand(4, 6)
    y = x + 0.5 * torch.randn(4, 6)
    z = torch.randn(4, 6)
    mask = torch.rand(4, 6) > 0.4
    global_denominator = mask.sum()
    loss_fn = LOSSES[name]

    full = x.clone().requires_grad_()
    full_loss = loss_fn(full, y, z, mask, None)  # default denominator = mask.sum() of the batch
    full_loss.backward()

    parts = x.clone().requires_grad_()
    micro_loss = sum(
        loss_fn(parts[rows], y[rows], z[rows], mask[rows], global_denominator)
        for rows in (slice(0, 1), slice(1, 4))
    )
    micro_loss.backward()

    torch.testing.assert_close(micro_loss, full_loss)
    torch.testing.assert_close(parts.grad, full.grad)


def test_losses_reject_bad_input():
    ones = torch.ones(4)
    with pytest.raises(ValueError, match="advantages has shape"):
        ppo_policy_loss(ones, ones, torch.ones(3), ones, ones)
    with pytest.raises(ValueError, match="mask must be bool"):
        value_loss(ones, ones, ones, torch.tensor([0, 1, 2, 1]))
    with pytest.raises(TypeError, match="ref_logprobs must be a torch.Tensor"):
        kl_penalty(ones, [0.0] * 4, ones)
    with pytest.raises(ValueError, match="denominator"):
        kl_penalty(ones, ones, ones, denominator=0)
    with pytest.raises(ValueError, match="low"):
        icepop(ones, ones, low=2.0, high=1.0)


def test_clip_schedule():
    assert clip_schedule(0, 100) == 0.2
    assert clip_schedule(50, 100) == pytest.approx(0.125)  # 0.2 + (0.05 - 0.2) * 0.5
    assert clip_schedule(100, 100) == pytest.approx(0.05)
    assert clip_schedule(150, 100) == pytest.approx(0.05)  # clamped past the end
    assert clip_schedule(37, 100, start=0.2, end=0.2) == 0.2
    with pytest.raises(ValueError, match="total_steps"):
        clip_schedule(0, 0)
