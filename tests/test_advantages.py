"""GAE over action tokens and GRPO group baselines, on hand-computed vectors."""

import pytest
import torch

from learner.advantages import adaptive_lambda, gae, grpo_advantages

# Three action tokens, reward on the last; dyadic numbers so float32 results are exact.
REWARDS = torch.tensor([0.0, 0.0, 1.0])
VALUES = torch.tensor([0.5, 0.25, 0.5])
ALL_ACTIONS = torch.ones(3, dtype=torch.bool)


def test_gae_terminal():
    # gamma = lam = 0.5, V_next after the last action = 0:
    # delta = [0 + .5*.25 - .5, 0 + .5*.5 - .25, 1 + .5*0 - .5] = [-.375, 0, .5]
    # A2 = .5; A1 = 0 + .25*.5 = .125; A0 = -.375 + .25*.125 = -.34375; R = A + V
    adv, ret = gae(REWARDS, VALUES, ALL_ACTIONS, gamma=0.5, lam=0.5, terminated=True)
    assert adv.tolist() == [-0.34375, 0.125, 0.5]
    assert ret.tolist() == [0.15625, 0.375, 1.0]


@pytest.mark.parametrize("bootstrap", [0.5, torch.tensor(0.5)])
def test_gae_truncated_bootstraps(bootstrap):
    # Same as terminal, but V_next after the last action = 0.5:
    # delta2 = 1 + .5*.5 - .5 = .75; A2 = .75; A1 = .25*.75 = .1875; A0 = -.375 + .25*.1875
    adv, ret = gae(
        REWARDS,
        VALUES,
        ALL_ACTIONS,
        gamma=0.5,
        lam=0.5,
        terminated=False,
        bootstrap_value=bootstrap,
    )
    assert adv.tolist() == [-0.328125, 0.1875, 0.75]
    assert ret.tolist() == [0.171875, 0.4375, 1.25]


def test_gae_truncated_without_bootstrap_is_an_error():
    with pytest.raises(ValueError, match="bootstrap_value"):
        gae(REWARDS, VALUES, ALL_ACTIONS, gamma=0.5, lam=0.5, terminated=False)


def test_gae_skips_observation_tokens():
    # Layout a o o a o a: observations carry arbitrary values and no reward; the action
    # positions must get exactly the compressed action-only result, the rest 0.
    mask = torch.tensor([1, 0, 0, 1, 0, 1], dtype=torch.uint8)
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    values = torch.tensor([0.5, 9.0, -7.0, 0.25, 3.0, 0.5])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5, terminated=False, bootstrap_value=0.5)
    assert adv.tolist() == [-0.328125, 0.0, 0.0, 0.1875, 0.0, 0.75]
    assert ret.tolist() == [0.171875, 0.0, 0.0, 0.4375, 0.0, 1.25]


def test_gae_gamma_lambda_one_returns_reward_to_go():
    # gamma = lam = 1 telescopes: A_t = sum_{k>=t} r_k - V_t, so R_t = reward-to-go [3.5, 2.5, 2.5, .5]
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5])
    values = torch.tensor([0.25, -1.0, 2.0, 0.75])
    adv, ret = gae(rewards, values, torch.ones(4), gamma=1.0, lam=1.0, terminated=True)
    assert ret.tolist() == [3.5, 2.5, 2.5, 0.5]
    assert adv.tolist() == [3.25, 3.5, 0.5, -0.25]


def test_gae_values_are_not_trained_through():
    values = VALUES.clone().requires_grad_()
    adv, ret = gae(REWARDS, values, ALL_ACTIONS, gamma=0.5, lam=0.5, terminated=True)
    assert not adv.requires_grad and not ret.requires_grad


def test_gae_reward_on_observation_names_position():
    mask = torch.tensor([1, 0, 1])
    with pytest.raises(ValueError, match=r"rewards\[1\]"):
        gae(torch.tensor([0.0, 1.0, 0.0]), VALUES, mask, gamma=1.0, lam=1.0, terminated=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"values": torch.zeros(4)}, "values has shape"),
        ({"action_mask": torch.ones(2)}, "action_mask has shape"),
        ({"action_mask": torch.tensor([1, 2, 1])}, "action_mask must be bool"),
        (
            {
                "rewards": torch.zeros(1, 3),
                "values": torch.zeros(1, 3),
                "action_mask": torch.ones(1, 3),
            },
            "1-D",
        ),
        ({"values": torch.tensor([0.0, float("nan"), 0.0])}, r"values\[1\]"),
        ({"gamma": 1.5}, "gamma"),
    ],
)
def test_gae_rejects_bad_input(kwargs, match):
    args = {
        "rewards": REWARDS,
        "values": VALUES,
        "action_mask": ALL_ACTIONS,
        "gamma": 1.0,
        "lam": 1.0,
        "terminated": True,
    } | kwargs
    with pytest.raises(ValueError, match=match):
        gae(**args)


def test_gae_non_tensor_is_type_error():
    with pytest.raises(TypeError, match="values must be a torch.Tensor"):
        gae(REWARDS, [0.5, 0.25, 0.5], ALL_ACTIONS, gamma=1.0, lam=1.0, terminated=True)


def test_adaptive_lambda():
    assert adaptive_lambda(100, 0.05) == pytest.approx(0.8)  # 1 - 1/(0.05 * 100) = 1 - 1/5
    assert adaptive_lambda(1000, 1.0) == pytest.approx(0.999)  # 1 - 1/1000
    assert adaptive_lambda(10, 0.05) == 0.0  # 1 - 1/0.5 = -1, clamped
    assert adaptive_lambda(0, 0.05) == 0.0  # L = 0: -inf, clamped
    with pytest.raises(ValueError, match="alpha"):
        adaptive_lambda(10, 0.0)
    with pytest.raises(ValueError, match="length"):
        adaptive_lambda(-1, 1.0)


def test_grpo_two_groups():
    # group a: [1, 0], mean .5, population std .5 -> [1, -1]
    # group b: [0, 4], mean 2,  population std 2  -> [-1, 1]
    rewards = torch.tensor([1.0, 0.0, 0.0, 4.0])
    groups = ["a", "b", "a", "b"]
    assert grpo_advantages(rewards, groups, eps=0.0).tolist() == [1.0, -1.0, -1.0, 1.0]
    assert grpo_advantages(rewards, groups, normalize_std=False).tolist() == [0.5, -2.0, -0.5, 2.0]
    # default eps = 1e-6: 0.5 / (0.5 + 1e-6) = 0.999998
    assert grpo_advantages(rewards, groups)[0].item() == pytest.approx(0.999998, rel=1e-6)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_all_equal_groups_are_exactly_zero(normalize_std):
    # 0.1 is not exact in binary: the group mean has rounding residue, the advantage must not.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7])
    groups = ["x", "x", "x", "y", "y"]
    adv = grpo_advantages(rewards, groups, eps=0.0, normalize_std=normalize_std)
    assert torch.equal(adv, torch.zeros(5))


def test_grpo_rejects_bad_input():
    with pytest.raises(ValueError, match="length 2"):
        grpo_advantages(torch.zeros(3), ["a", "b"])
    with pytest.raises(ValueError, match=r"group_ids\[1\] is None"):
        grpo_advantages(torch.zeros(2), ["a", None])
    with pytest.raises(TypeError, match="group_ids"):
        grpo_advantages(torch.zeros(2), "ab")
