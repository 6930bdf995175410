"""From a batch to training targets: the bootstrap value at every kind of segment end, turn spans,
micro-batch packing, the rank split and GRPO targets, on hand-built segments.

With gamma = lam = 1 GAE has a closed form, A_t = (rewards from t on) + V_boot - V_t, so the
expected advantages below are written from that formula, not from the recursion under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import load_config
from common.trajectory import Segment
from learner.advantages import Targets, gae, segment_targets
from learner.algorithms import ESTIMATORS, Scores
from learner.batch import Batch, group_episodes, micro_batches, split_for_rank
from learner.step import build_models
from learner.value import turn_starts
from testkit.segments import make_segment


def closed_form(seg: Segment, values: torch.Tensor, boot: float) -> tuple[list[float], list[float]]:
    """gamma = lam = 1: A_t = sum_{k >= t} r_k + V_boot - V_t and R_t = A_t + V_t, 0 off actions."""
    mask = seg.action_mask.astype(bool)
    to_go = np.cumsum(seg.rewards[::-1])[::-1]
    adv = np.where(mask, to_go + boot - values.numpy(), 0.0)
    ret = np.where(mask, to_go + boot, 0.0)
    return adv.tolist(), ret.tolist()


def row(seg: Segment) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A segment's (mask, rewards, terminated), as ``segment_targets`` reads them."""
    return torch.from_numpy(seg.action_mask), torch.from_numpy(seg.rewards), seg.terminated


def targets(
    seg: Segment,
    values: torch.Tensor,
    *,
    end_value: float,
    next_value: float | None,
    gamma: float = 1.0,
    lam: float = 1.0,
    max_segment_steps: int = 50,
):
    return segment_targets(
        *row(seg),
        values,
        end_value,
        next_value,
        gamma=gamma,
        lam=lam,
        critic_lam=1.0,
        adaptive_alpha=None,
        max_segment_steps=max_segment_steps,
    )


LAYOUT = "ooaaoaa"  # two turns; dyadic values keep float32 exact
VALUES = torch.tensor([0.0, 0.0, 0.5, 0.25, 9.0, -0.5, 0.75])
NEXT_VALUE, END_VALUE = 0.75, -3.0


@pytest.mark.parametrize(
    ("terminated", "next_value", "boot"),
    [
        pytest.param(False, NEXT_VALUE, NEXT_VALUE, id="compaction-bootstraps-from-next-segment"),
        pytest.param(False, None, END_VALUE, id="truncated-without-next-bootstraps-from-end-value"),
        pytest.param(True, None, 0.0, id="terminal-bootstraps-from-zero"),
    ],
)
def test_segment_end_bootstrap(terminated, next_value, boot):
    seg = make_segment(LAYOUT, rewards={3: 0.5, 6: 1.0}, terminated=terminated, last=terminated)
    t = targets(seg, VALUES, end_value=END_VALUE, next_value=next_value)
    adv, ret = closed_form(seg, VALUES, boot)
    assert t.advantages.tolist() == pytest.approx(adv)
    assert t.returns.tolist() == pytest.approx(ret)
    # With gamma, lam < 1 the last action still sees exactly r + gamma * V_boot - V (one-step TD).
    t = targets(seg, VALUES, end_value=END_VALUE, next_value=next_value, gamma=0.5, lam=0.5)
    assert float(t.advantages[6]) == pytest.approx(1.0 + 0.5 * boot - 0.75)


def test_dynamic_truncation_cuts_and_bootstraps_at_the_cut():
    # Four one-token turns at 1, 3, 5, 7; max 2 turns per piece cuts before position 5.
    seg = make_segment("oaoaoaoa", rewards={1: 1.0, 3: 2.0, 5: 4.0, 7: 8.0}, terminated=True)
    values = torch.tensor([0.0, 0.5, 0.0, -0.25, 0.0, 1.5, 0.0, 0.125])
    t = targets(seg, values, end_value=END_VALUE, next_value=None, max_segment_steps=2)
    first = make_segment("oaoao", rewards={1: 1.0, 3: 2.0})
    second = make_segment("aoa", rewards={0: 4.0, 2: 8.0})
    adv_first, ret_first = closed_form(first, values[:5], boot=float(values[5]))
    adv_second, ret_second = closed_form(second, values[5:], boot=0.0)
    assert t.advantages.tolist() == pytest.approx(adv_first + adv_second)
    assert t.returns.tolist() == pytest.approx(ret_first + ret_second)
    # Without a cut the first turns see every later reward.
    uncut = targets(seg, values, end_value=END_VALUE, next_value=None, max_segment_steps=4)
    assert uncut.advantages.tolist() == pytest.approx(closed_form(seg, values, boot=0.0)[0])


def turn_targets(layout: str, rewards: dict[int, float], values: list[float], **kw) -> Targets:
    seg = make_segment(layout, rewards=rewards)
    mask, r, terminated = row(seg)
    return segment_targets(
        mask, r, terminated, torch.tensor(values), 0.0, None, critic_lam=1.0,
        adaptive_alpha=None, max_segment_steps=50, unit="turn", **kw,
    )  # fmt: skip


def test_turn_level_gae_is_token_level_gae_when_a_turn_is_one_token():
    seg = make_segment("oaoaoa", rewards={3: 0.5, 5: 1.0})
    mask, r, terminated = row(seg)
    values = torch.tensor([0.0, 0.2, 0.0, 0.4, 0.0, 0.7])
    kw = dict(gamma=0.9, lam=0.8, critic_lam=1.0, adaptive_alpha=None, max_segment_steps=50)
    token = segment_targets(mask, r, terminated, values, 0.0, None, **kw)
    turn = segment_targets(mask, r, terminated, values, 0.0, None, unit="turn", **kw)
    assert torch.equal(token.advantages, turn.advantages)
    assert torch.equal(token.returns, turn.returns)


def test_turn_level_gae_steps_once_a_turn_from_the_value_where_the_turn_starts():
    """Turns of 3, 2 and 1 tokens with rewards 0, 0.5, 1 on their last tokens; the recursion
    runs over the turns' first tokens (values 0.2, 0.4, 0.7), at gamma 0.9 and lambda 0.8:
    delta = (0 + 0.9*0.4 - 0.2, 0.5 + 0.9*0.7 - 0.4, 1 - 0.7) = (0.16, 0.73, 0.3),
    A = (0.16 + 0.72*(0.73 + 0.72*0.3), 0.73 + 0.72*0.3, 0.3)."""
    values = [0.0, 0.2, 9.0, 9.0, 0.0, 0.4, 9.0, 0.0, 0.7]  # 9: never read
    t = turn_targets("oaaaoaaoa", {6: 0.5, 8: 1.0}, values, gamma=0.9, lam=0.8)
    a3, a2 = 0.3, 0.73 + 0.72 * 0.3
    a1 = 0.16 + 0.72 * a2
    expected = [0, a1, a1, a1, 0, a2, a2, 0, a3]
    assert t.advantages.tolist() == pytest.approx(expected, abs=1e-6)
    # the critic's returns (critic_lam 1): the discounted rewards from each turn on, per turn
    turn_returns = [0.9 * 0.5 + 0.81 * 1.0, 0.5 + 0.9 * 1.0, 1.0]
    expected_returns = [0, *[turn_returns[0]] * 3, 0, *[turn_returns[1]] * 2, 0, turn_returns[2]]
    assert t.returns.tolist() == pytest.approx(expected_returns, abs=1e-6)


def test_adaptive_lambda_depends_on_the_segment_length():
    """With alpha 0.5 and 10 action tokens GAE runs at lambda = 1 - 1 / (alpha * L) = 0.8,
    whatever lam says: the advantages are GAE's at 0.8, not at 0.95."""
    seg = make_segment("o" + "a" * 10, rewards={10: 1.0})
    mask, rewards, _ = row(seg)
    values = torch.linspace(0.0, 0.9, 11)
    t = segment_targets(
        mask, rewards, True, values, 0.0, None, gamma=1.0, lam=0.95, critic_lam=1.0,
        adaptive_alpha=0.5, max_segment_steps=50,
    )  # fmt: skip
    at = {lam: gae(rewards, values, mask.bool(), gamma=1.0, lam=lam, terminated=True)[0]
          for lam in (0.8, 0.95)}  # fmt: skip
    assert t.advantages.tolist() == pytest.approx(at[0.8].tolist())
    assert t.advantages.tolist() != pytest.approx(at[0.95].tolist())


@pytest.mark.parametrize(
    ("mask", "starts"),
    [
        ([0, 1, 1, 0, 0, 1, 0, 1, 1], [1, 5, 7]),
        ([1, 1, 0, 1], [0, 3]),
        ([0, 0, 0], []),
    ],
)
def test_turn_starts(mask, starts):
    assert turn_starts(torch.tensor(mask, dtype=torch.uint8)) == starts


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 40), min_size=1, max_size=12), max_tokens=st.integers(1, 120)
)
def test_micro_batches_respect_the_token_limit(lengths, max_tokens):
    batches = micro_batches(lengths, max_tokens)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:  # padded size = longest x count; only a lone segment may exceed the limit
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= max_tokens


def test_micro_batches_pack_equal_segments_together():
    batches = micro_batches([10] * 7, max_tokens=35)
    assert [len(b) for b in batches] == [3, 3, 1]


@settings(max_examples=60, deadline=None)
@given(
    episode_lengths=st.lists(
        st.lists(st.integers(2, 30), min_size=1, max_size=3), min_size=1, max_size=10
    ),
    world=st.integers(1, 4),
)
def test_split_for_rank_covers_every_episode_once_and_whole(episode_lengths, world):
    segs = [
        make_segment("o" + "a" * (n - 1), episode_id=f"ep{e}", index=k)
        for e, lengths in enumerate(episode_lengths)
        for k, n in enumerate(lengths)
    ]
    episodes = group_episodes(segs)
    shares = [split_for_rank(episodes, rank, world) for rank in range(world)]
    assigned = [ep for share in shares for ep in share]
    assert sorted(id(ep) for ep in assigned) == sorted(id(ep) for ep in episodes)
    assert sorted(s.traj_id for ep in assigned for s in ep) == sorted(s.traj_id for s in segs)
    # Greedy balance: loads differ by at most the largest episode.
    loads = [sum(s.num_tokens for ep in share for s in ep) for share in shares]
    assert max(loads) - min(loads) <= max(sum(lengths) for lengths in episode_lengths)
    assert shares == [
        split_for_rank(episodes, rank, world) for rank in range(world)
    ]  # deterministic


def test_group_episodes_orders_segments_by_index():
    late, early = (
        make_segment("oa", episode_id="e", index=1),
        make_segment("oa", episode_id="e", index=0),
    )
    other = make_segment("oa", episode_id="f")
    assert group_episodes([late, other, early]) == [[early, late], [other]]


def test_grpo_targets_broadcast_the_group_advantage_to_action_tokens():
    # Group g1: episode a (two segments, reward 0.5 + 0.5) vs episode b (reward 0): A = +1 / -1.
    # Group g2: equal rewards, A = 0. Episode c has no group: a group of its own, A = 0.
    a0 = make_segment(
        "oaao", episode_id="a", rewards={2: 0.5}, terminated=False, last=False, group_id="g1"
    )
    a1 = make_segment("oooaa", episode_id="a", index=1, rewards={4: 0.5}, group_id="g1")
    b = make_segment("oao", episode_id="b", rewards={}, group_id="g1")
    d, e = (make_segment("oa", episode_id=name, rewards={1: 2.0}, group_id="g2") for name in "de")
    c = make_segment("oaa", episode_id="c")
    episodes = group_episodes([a0, a1, b, d, e, c])
    segs = [s for ep in episodes for s in ep]
    batch = Batch.of(segs)
    zeros = torch.zeros(batch.tokens.shape)
    scores = Scores(zeros, zeros, torch.zeros(len(segs)), None, zeros)
    lc = load_config(None, ["learner.algorithm=grpo", "actor.group_size=2"]).learner
    adv = ESTIMATORS["grpo"](batch, scores, episodes, lc).advantages
    expected = {"a": 1.0, "b": -1.0, "d": 0.0, "e": 0.0, "c": 0.0}
    for i, seg in enumerate(segs):
        on = batch.action_mask[i]
        assert adv[i][on].tolist() == pytest.approx(
            [expected[seg.episode_id]] * seg.num_action_tokens, abs=1e-5
        )
    assert adv[~batch.action_mask].abs().max() == 0.0  # observations and padding


def test_a_batch_lays_segments_out_as_padded_rows_and_links_each_to_its_next_segment():
    a0 = make_segment("oaao", episode_id="a", terminated=False, last=False)
    a1 = make_segment("oooaa", episode_id="a", index=1)
    b = make_segment("oa", episode_id="b")
    batch = Batch.of([a0, a1, b])
    assert batch.tokens.shape == (3, 5) and batch.lengths.tolist() == [4, 5, 2]
    assert batch.next_row.tolist() == [1, -1, -1]
    assert batch.terminated.tolist() == [False, True, True]
    assert batch.num_action_tokens == 5
    for i, seg in enumerate([a0, a1, b]):
        n = seg.num_tokens
        assert batch.tokens[i, :n].tolist() == seg.tokens.tolist()
        assert batch.behavior_logprobs[i, :n].tolist() == seg.behavior_logprobs.tolist()
        assert not batch.action_mask[i, n:].any() and (batch.versions[i, n:] == -1).all()
    # A micro-batch is cut to its longest row.
    ids, temps = batch.inputs([0, 2])
    assert ids.shape == (2, 4) and ids[1, 2:].tolist() == [0, 0]
    assert temps.tolist() == [1.0, 1.0]
    assert batch.take(batch.rewards, [2]).shape == (1, 2)


@pytest.mark.parametrize("kind", ["separate", "shared"])
def test_right_padded_rows_score_as_if_each_were_alone(tiny_model, kind):
    """``Batch.inputs`` gives the models no attention mask: under a causal model a row's tokens
    never attend to the padding after it, so a padded row's logits and values equal its own,
    unpadded (up to float32 summation order)."""
    lc = load_config(None, [f"learner.critic.kind={kind}"]).learner
    models = build_models(lc, str(tiny_model), torch.float32, lambda module, lr: module)
    torch.nn.init.normal_((models.policy if kind == "shared" else models.critic).head.proj.weight)

    def score(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if kind == "shared":
            return models.policy(ids)
        return models.policy(ids), models.critic(ids)

    batch = Batch.of([make_segment("oaaoaaao"), make_segment("oaa"), make_segment("ooaaa")])
    ids, _ = batch.inputs([0, 1, 2])
    with torch.no_grad():
        logits, values = score(ids)
        assert values.abs().max() > 0  # a head off its zero init: a real comparison
        for row, n in enumerate(batch.lengths.tolist()):
            alone_logits, alone_values = score(ids[row : row + 1, :n])
            assert torch.allclose(logits[row, :n], alone_logits[0], atol=1e-5)
            assert torch.allclose(values[row, :n], alone_values[0], atol=1e-5)


@pytest.mark.parametrize(("mode", "boot"), [("critic", NEXT_VALUE), ("zero", 0.0)])
def test_gae_estimator_bootstraps_a_compaction_cut_from_the_next_segment_or_zero(mode, boot):
    """The registry's GAE on a Batch: the first segment of a compacted episode ends with the
    critic's value at the next segment's first action (ours) or with 0 (the ablation)."""
    first = make_segment(LAYOUT, episode_id="c", rewards={3: 0.5}, terminated=False, last=False)
    second = make_segment("oaa", episode_id="c", index=1, rewards={2: 1.0})
    batch = Batch.of([first, second])
    values = torch.zeros(batch.tokens.shape)
    values[0, : len(LAYOUT)] = VALUES
    values[1, 1] = NEXT_VALUE  # V at the next segment's first action
    scores = Scores(values, values, torch.tensor([END_VALUE, 0.0]), None, torch.zeros_like(values))
    lc = load_config(
        None, ["learner.gamma=1", "learner.lam=1", f"learner.cut_bootstrap={mode}"]
    ).learner
    adv = ESTIMATORS["ppo"](batch, scores, [[first, second]], lc).advantages
    expected, _ = closed_form(first, VALUES, boot)
    assert adv[0, : len(LAYOUT)].tolist() == pytest.approx(expected)
