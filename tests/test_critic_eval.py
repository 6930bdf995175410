"""Scoring a checkpoint's critic on held-out episodes: the per-turn bookkeeping, the Monte-Carlo
value function, and `asyncppo eval --checkpoint` on a real learner checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_learner import build_learner, fixed_batch, on_policy

from deploy.cli import main
from learner.batch import Batch
from learner.critic_eval import load_models
from learner.value import (
    exact_value_explained,
    explained,
    leave_one_out,
    turn_returns,
    turn_starts,
)
from testkit.segments import make_segment

pytestmark = pytest.mark.usefixtures("single_process_group")


def test_turns_start_where_a_run_of_action_tokens_begins():
    mask = np.array([c == "a" for c in "ooaaoaooaaa"], dtype="|u1")
    assert turn_starts(mask) == [2, 5, 8]
    assert turn_starts(np.array([1, 1, 0, 1], dtype="|u1")) == [0, 3]


def test_turn_returns_discount_the_rewards_of_later_turns_across_segments():
    # turns: (2-3) reward 0.5, (6) none, then a cut; next segment (2-3) reward 1
    first = make_segment("ooaaooao", rewards={3: 0.5}, terminated=False, last=False)
    second = make_segment("ooaa", index=1, rewards={3: 1.0})
    assert turn_returns([first, second], gamma=1.0) == [1.5, 1.0, 1.0]
    assert turn_returns([first, second], gamma=0.5) == pytest.approx([0.5 + 0.25, 0.5, 1.0])


def test_the_monte_carlo_value_leaves_the_episode_itself_out():
    # Three plays of one instance through state "s0"; two reach "s1".
    states = ["s0", "s1", "s0", "s1", "s0"]
    returns = [1.0, 1.0, 0.0, 0.0, 1.0]
    episode = [0, 0, 1, 1, 2]
    assert leave_one_out(states, returns, episode) == [0.5, 0.0, 1.0, 1.0, 0.5]
    assert leave_one_out(["only"], [1.0], [0]) == [None]


def test_the_value_functions_explained_variance_is_measured_without_its_estimates_noise():
    # 3,000 states with a known V^pi, each played 4 times: a 0/1 return of mean V. The explained
    # variance of V itself is Var(V) / Var(R) = (1/12) / (1/4) = 1/3; the leave-one-out mean of
    # the 3 other plays adds Var(R|s)/3 to every residual and explains only ~1/9.
    rng = np.random.default_rng(0)
    truth = rng.uniform(size=3000)
    states = np.repeat(np.arange(3000), 4)
    returns = (rng.uniform(size=states.size) < truth[states]).astype(float).tolist()
    episode = list(range(states.size))  # every play its own episode
    mc = leave_one_out(states.tolist(), returns, episode)
    of_truth = explained(returns, truth[states].tolist())
    assert abs(of_truth - 1 / 3) < 0.05  # the sample's own
    assert explained(returns, mc) < of_truth - 0.15
    assert abs(exact_value_explained(states.tolist(), returns, episode) - of_truth) < 0.05
    # No other play anywhere: nothing to measure.
    assert exact_value_explained(["a", "b"], [0.0, 1.0], [0, 1]) == 0.0


def test_explained_variance_is_one_for_the_returns_and_zero_for_their_mean():
    r = [0.0, 1.0, 1.0, 0.0, 1.0]
    assert explained(r, r) == pytest.approx(1.0, abs=1e-12)
    assert explained(r, [0.6] * 5) == pytest.approx(0.0, abs=1e-12)


def test_eval_checkpoint_scores_the_learners_own_critic(tmp_path, tiny_model, capfd):
    run = tmp_path / "run"
    learner = build_learner(tiny_model, run)
    learner.train_step(on_policy(fixed_batch(), tiny_model))
    learner.step, learner.version = 1, 1
    learner.save_checkpoint()
    overrides = [
        f"model.path={tiny_model}",
        "actor.env=chain",
        "actor.env_kwargs={max_turns: 6}",
        "eval.episodes=4",
        "eval.horizon_buckets=[3, 6]",
        "eval.value_samples=3",
        f"run.out_dir={run}",
    ]
    cfg_args = [a for o in overrides for a in ("--set", o)]
    from common.config import load_config

    models, version = load_models(load_config(None, overrides), run / "checkpoints")
    assert version == 1
    # The loaded critic is the learner's: the same values on a batch.
    batch = Batch.of(fixed_batch())
    ids, _ = batch.inputs(list(range(len(batch))), "cpu")
    with torch.no_grad():
        values = models.critic(ids)
        assert values.abs().max() > 0  # the head trained off its zero init: a real comparison
        assert torch.equal(values, learner.critic.module(ids))
    learner.close()

    out = tmp_path / "eval.json"
    ckpt = ["--checkpoint", str(run / "checkpoints"), "--tag", "step1"]
    assert main(["eval", *cfg_args, *ckpt, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["version"] == 1 and result["episodes"] == 4 * 3
    critic = result["critic"]
    assert critic["samples_per_instance"] == 3
    assert (
        0 < critic["turns_scored"] <= critic["turns"] == sum(r["turns"] for r in result["records"])
    )
    assert critic["value_function_explained_variance"] <= 1.0
    assert critic["exact_value_function_explained_variance"] <= 1.0
    assert "critic: explained variance" in capfd.readouterr().out


def test_eval_checkpoint_names_a_directory_that_holds_none(tmp_path, tiny_model, capfd):
    code = main(
        ["eval", "--set", f"model.path={tiny_model}", "--checkpoint", str(tmp_path / "nothing")]
    )
    assert code == 2
    assert "no 'latest' file" in capfd.readouterr().err
