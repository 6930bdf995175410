"""The DeepSpeed learner on fixed, hand-built batches: no broker, `train_step(batch)` called directly.

Every in-process Learner shares one world-size-1 gloo process group (a process can initialise it
only once); the data-parallel test spawns two fresh processes. Comparisons between two runs look
at the step statistics (losses, gradient norm) *and* the parameters: AdamW's first update is about
lr * sign(g) per coordinate, so parameters alone would hide a wrongly scaled gradient.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port
from deepspeed.runtime.zero import GatheredParameters
from prometheus_client import REGISTRY
from safetensors.torch import load_file, save_file
from structlog.testing import capture_logs
from transformers import AutoModelForCausalLM

from actors.engines import SamplingParams, make_engine
from common.config import ConfigError, load_config
from common.metrics import Health
from common.model import load_causal_lm, state_dict_for_export
from common.trajectory import Segment
from common.transport import TransportError
from common.weights import pack_state_dict, unpack_state_dict
from deploy.cli import build_parser
from learner.algorithms import Targets
from learner.batch import Batch, group_episodes, micro_batches, split_for_rank
from learner.models import Policy, token_logprobs
from learner.step import EV_WINDOW, TrainStep, clip_epsilon
from learner.trainer import Learner
from learner.value import explained_variance, value_sums
from testkit.segments import make_segment

COMPARED = (
    "policy_loss",
    "value_loss",
    "grad_norm",
    "clip_fraction",
    "approx_kl",
    "icepop_kept_fraction",
    "importance_weight_mean",
)
FAR_OFF = -1e30  # a finite but absurd behavior log-prob: pi_prox / mu overflows without the clamp


pytestmark = pytest.mark.usefixtures("single_process_group")


def build_learner(
    model: Path, run_dir: Path, *overrides: str, resume: str | None = None
) -> Learner:
    run_dir.mkdir(parents=True, exist_ok=True)
    return Learner(
        load_config(None, [f"model.path={model}", f"run.out_dir={run_dir}", *overrides]),
        resume=resume,
    )


@pytest.fixture
def new_learner(tmp_path, tiny_model):
    """Learners on the tiny model with config overrides, each in its own run dir, closed at the end."""
    made: list[Learner] = []

    def make(*overrides: str, resume: str | None = None, run_dir: Path | None = None) -> Learner:
        made.append(
            build_learner(
                tiny_model, run_dir or tmp_path / f"run{len(made)}", *overrides, resume=resume
            )
        )
        return made[-1]

    yield make
    for learner in made:
        learner.close()


def fixed_batch() -> list[Segment]:
    """Four episodes of different lengths: one terminal, one compacted into two segments, one
    ended by the turn budget (bootstraps from its end value)."""
    return [
        make_segment("oooaaaoooaa", episode_id="short", rewards={10: 1.0}),
        make_segment(
            "ooaaaaooooaaa", episode_id="long", rewards={5: 0.5}, terminated=False, last=False
        ),
        make_segment("oooooaaaaoa", episode_id="long", index=1, rewards={10: -1.0}),
        make_segment("ooaaoooaaaaoaaa", episode_id="mid", rewards={14: 1.0}),
        make_segment("ooooaaaaaaa", episode_id="budget", rewards={10: 0.5}, terminated=False),
    ]


def on_policy(batch: list[Segment], model: Path) -> list[Segment]:
    """Behavior log-probs set to the starting policy's own: a sampler that matches the learner."""
    policy = Policy(str(model), torch.float32).eval()
    with torch.no_grad():
        for seg in batch:
            ids = torch.from_numpy(seg.tokens.astype("int64"))[None]
            lp = token_logprobs(policy(ids), ids, temperature=1.0)[0].numpy()
            seg.behavior_logprobs = np.where(seg.action_mask == 1, lp, 0.0).astype("<f4")
    return batch


def snapshot(learner: Learner) -> dict[str, torch.Tensor]:
    """Copies of every trainable parameter (policy and critic), gathered under ZeRO-3."""
    out = {}
    for name, engine in (("policy", learner.policy), ("critic", learner.critic)):
        if engine is None:
            continue
        params = list(engine.module.parameters())
        with GatheredParameters(params, enabled=learner.lc.zero_stage == 3):
            out |= {
                f"{name}/{key}": p.detach().clone() for key, p in engine.module.named_parameters()
            }
    return out


def changed(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], prefix: str = ""
) -> bool:
    return any(not torch.equal(before[k], after[k]) for k in before if k.startswith(prefix))


def assert_same_step(a: dict, b: dict, params_a: dict, params_b: dict, atol: float) -> None:
    assert {k: a[k] for k in COMPARED} == pytest.approx(
        {k: b[k] for k in COMPARED}, rel=atol, abs=atol
    )
    torch.testing.assert_close(params_a, params_b, rtol=0, atol=atol)


def lengths(batch: list[Segment]) -> list[int]:
    return [s.num_tokens for s in batch]


def prox_of(learner: Learner, segs: list[Segment]) -> list[torch.Tensor]:
    """The learner's log π_prox of each segment's tokens, rows in the given order."""
    prox = learner.steps.score(Batch.of(segs)).prox
    return [prox[i, : s.num_tokens] for i, s in enumerate(segs)]


def scored_by(learner: Learner, batch: list[Segment]) -> list[Segment]:
    """Behavior log-probs equal, bit for bit, to ``learner``'s own π_prox on this batch: the same
    forward on the same micro-batches, so π_prox/μ is exactly 1 (a sampler with no mismatch)."""
    prox = prox_of(learner, batch)
    for seg, lp in zip(batch, prox, strict=True):
        seg.behavior_logprobs = np.where(seg.action_mask == 1, lp.numpy(), 0.0).astype("<f4")
    return batch


def test_icepop_without_mismatch_equals_no_correction(new_learner, tiny_model):
    """With μ = π_prox exactly, IcePop's weights are exactly 1 and its step is the uncorrected
    one. (Scoring μ with another forward, say batch size 1, gives weights of 1 ± 1e-7, and after
    Adam the parameters then differ by up to ~lr on elements whose gradient is near 0: that
    compares fp32 rounding, not IcePop.)"""
    icepop, plain = new_learner("learner.correction=icepop"), new_learner("learner.correction=none")
    batch = scored_by(icepop, fixed_batch())
    before = snapshot(icepop)
    stats_icepop, stats_plain = icepop.train_step(batch), plain.train_step(batch)
    assert stats_icepop["icepop_kept_fraction"] == 1.0
    assert stats_icepop["importance_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert changed(before, snapshot(icepop), "policy/")
    assert_same_step(stats_icepop, stats_plain, snapshot(icepop), snapshot(plain), atol=0.0)


def test_naive_ppo_clips_against_mu_and_equals_decoupled_ppo_when_mu_is_pi_prox(new_learner):
    """`learner.proximal: behavior` anchors the clipped ratio at μ. With μ = π_prox exactly its
    step is decoupled PPO's without a correction; with μ two nats below π_prox every ratio is
    e^2, beyond the clip, where decoupled PPO's ratio is 1 and clips nothing."""
    naive = new_learner("learner.proximal=behavior", "learner.correction=none")
    plain = new_learner("learner.correction=none")
    batch = scored_by(naive, fixed_batch())
    stats_naive, stats_plain = naive.train_step(batch), plain.train_step(batch)
    assert_same_step(stats_naive, stats_plain, snapshot(naive), snapshot(plain), atol=0.0)

    naive = new_learner("learner.proximal=behavior", "learner.correction=none")
    plain = new_learner("learner.correction=none")
    batch = scored_by(naive, fixed_batch())
    for seg in batch:
        seg.behavior_logprobs[seg.action_mask == 1] -= 2.0
    stats_naive, stats_plain = naive.train_step(batch), plain.train_step(batch)
    assert stats_plain["clip_fraction"] == 0.0
    assert stats_naive["clip_fraction"] > 0.2, stats_naive


def test_naive_ppo_has_no_behavior_weight_to_correct_with():
    with pytest.raises(ConfigError, match="learner.proximal.*correction=none"):
        load_config(None, ["learner.proximal=behavior"])


def test_mismatched_tokens_are_masked_without_nan(new_learner, tiny_model):
    batch = on_policy(fixed_batch(), tiny_model)
    # w = pi_prox / mu: e^10 (too high), e^-1 (too low), and e^(1e30) clamped to e^20 before exp.
    for seg, pos, shift in ((batch[0], 4, -10.0), (batch[3], 8, 1.0)):
        seg.behavior_logprobs[pos] += shift
    batch[1].behavior_logprobs[3] = FAR_OFF
    learner = new_learner()
    stats = learner.train_step(batch)
    n = sum(s.num_action_tokens for s in batch)
    assert stats["icepop_kept_fraction"] == pytest.approx((n - 3) / n)
    assert stats["importance_weight_max"] == pytest.approx(math.exp(20.0), rel=1e-5)
    assert all(math.isfinite(stats[k]) for k in COMPARED)
    assert all(torch.isfinite(p).all() for p in snapshot(learner).values())


def test_fully_mismatched_batch_leaves_the_policy_untouched(new_learner):
    batch = fixed_batch()
    for seg in batch:
        seg.behavior_logprobs[seg.action_mask == 1] = FAR_OFF
    learner = new_learner()
    before = snapshot(learner)
    stats = learner.train_step(batch)
    after = snapshot(learner)
    assert stats["icepop_kept_fraction"] == 0.0 and stats["policy_loss"] == 0.0
    assert not changed(before, after, "policy/")  # every policy gradient is exactly zero
    assert changed(before, after, "critic/")  # the critic still learns from the batch


def test_micro_batches_do_not_change_the_update(new_learner):
    batch = fixed_batch()
    assert (
        len(micro_batches(lengths(batch), 16)) == len(batch)
        and len(micro_batches(lengths(batch), 4096)) == 1
    )
    one, many = (
        new_learner("learner.micro_batch_tokens=4096"),
        new_learner("learner.micro_batch_tokens=16"),
    )
    stats_one, stats_many = one.train_step(batch), many.train_step(batch)
    assert_same_step(stats_one, stats_many, snapshot(one), snapshot(many), atol=1e-5)


DP_OVERRIDES = ("learner.micro_batch_tokens=16",)  # ranks end up with 3 and 2 micro-batches


def train_one_rank(
    rank: int, world: int, port: int, model: Path, out: Path, zero_stage: int, batch: list[Segment]
) -> None:
    """One data-parallel rank (run by torch.multiprocessing.spawn): a step, then rank 0 saves.

    Then only rank 1 is signalled: rank 0 must agree to stop at the same step boundary."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    learner = build_learner(model, out / "run", *DP_OVERRIDES, f"learner.zero_stage={zero_stage}")
    stats = learner.train_step(batch)
    params, exported = snapshot(learner), learner.export_weights()  # collectives: every rank calls
    learner._stop = rank == 1
    stopped = learner._stop_agreed()
    if rank == 0:
        save_file(params, out / "params.safetensors")
        save_file(exported, out / "exported.safetensors")
        (out / "stats.json").write_text(
            json.dumps({k: stats[k] for k in COMPARED} | {"stopped": stopped})
        )
    learner.close()


@pytest.mark.parametrize("zero_stage", [1, 3])
@pytest.mark.system
def test_two_ranks_take_the_same_step_and_stop_together(
    new_learner, tiny_model, tmp_path, zero_stage
):
    batch = fixed_batch()
    shares = [split_for_rank(group_episodes(batch), r, 2) for r in range(2)]
    assert all(shares), "both ranks must get episodes"
    mp.spawn(
        train_one_rank, args=(2, free_port(), tiny_model, tmp_path, zero_stage, batch), nprocs=2
    )
    single = new_learner(*DP_OVERRIDES, f"learner.zero_stage={zero_stage}")
    stats = single.train_step(batch)
    two_ranks = json.loads((tmp_path / "stats.json").read_text())
    assert two_ranks["stopped"], "a signal on rank 1 stops rank 0 after the same step"
    assert_same_step(
        two_ranks, stats, load_file(tmp_path / "params.safetensors"), snapshot(single), atol=1e-5
    )
    torch.testing.assert_close(
        load_file(tmp_path / "exported.safetensors"), single.export_weights(), rtol=0, atol=1e-5
    )


@pytest.fixture(scope="module")
def stepped(tmp_path_factory, tiny_model):
    """One learner per ZeRO stage after one step on the same on-policy batch (built on first use)."""
    cache: dict[int, tuple[Learner, dict, dict]] = {}
    batch = on_policy(fixed_batch(), tiny_model)

    def get(stage: int) -> tuple[Learner, dict, dict]:
        if stage not in cache:
            learner = build_learner(
                tiny_model, tmp_path_factory.mktemp(f"zero{stage}"), f"learner.zero_stage={stage}"
            )
            before = snapshot(learner)
            cache[stage] = learner, before, learner.train_step(batch)
        return cache[stage]

    yield get
    for learner, _, _ in cache.values():
        learner.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_takes_the_same_step(stepped, stage):
    learner, before, stats = stepped(stage)
    reference, _, reference_stats = stepped(0)
    after = snapshot(learner)
    assert changed(before, after, "policy/") and changed(before, after, "critic/")
    assert_same_step(stats, reference_stats, after, snapshot(reference), atol=1e-5)


@pytest.mark.parametrize("stage", [1, 3])
def test_published_weights_equal_the_training_parameters(stepped, stage):
    learner = stepped(stage)[0]
    params = {
        k.removeprefix("policy/policy."): v
        for k, v in snapshot(learner).items()
        if k.startswith("policy/")
    }
    exported = learner.export_weights()
    assert set(exported) == set(params) - {"lm_head.weight"}  # tied to the embedding: sent once
    manifest, chunks = pack_state_dict(exported, version=1, chunk_bytes=4096)
    received = unpack_state_dict(manifest, [bytes(c) for c in chunks])
    for name, tensor in params.items():
        if name in exported:
            assert torch.equal(exported[name], tensor), name
            assert torch.equal(received[name], tensor), name


@pytest.mark.parametrize("stage", [1, 3])
def test_export_directory_loads_with_from_pretrained(stepped, stage, tmp_path):
    learner = stepped(stage)[0]
    learner.export(str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    params = {
        k.removeprefix("policy/policy."): v
        for k, v in snapshot(learner).items()
        if k.startswith("policy/")
    }
    loaded = dict(model.named_parameters())
    assert set(loaded) == set(params)
    assert all(torch.equal(loaded[name], params[name]) for name in params)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def optimizer_state(learner: Learner) -> dict[str, torch.Tensor]:
    """AdamW's moments and step counts of both engines (the torch optimizer inside ZeRO's)."""
    out = {}
    for name, engine in (("policy", learner.policy), ("critic", learner.critic)):
        for index, state in engine.optimizer.optimizer.state_dict()["state"].items():
            out |= {f"{name}/{index}/{key}": torch.as_tensor(value) for key, value in state.items()}
    return out


def test_checkpoint_resume_restores_everything(new_learner, tmp_path, tiny_model):
    batch = on_policy(fixed_batch(), tiny_model)
    first = new_learner(run_dir=tmp_path / "run")
    for _ in range(2):  # what Learner.run does around a step, minus the broker
        first.train_step(batch)
        first.step += 1
        first.version += 1
    first.save_checkpoint()
    params, moments = snapshot(first), optimizer_state(first)
    resumed = new_learner(run_dir=tmp_path / "run", resume="require")
    assert (resumed.step, resumed.version) == (2, 2)
    assert all(torch.equal(params[k], v) for k, v in snapshot(resumed).items())
    restored = optimizer_state(resumed)
    assert set(restored) == set(moments) and all(
        torch.equal(moments[k], v) for k, v in restored.items()
    )
    # The next step continues exactly where the uninterrupted run goes.
    assert first.train_step(batch)["clip"] == resumed.train_step(batch)["clip"]
    assert all(
        torch.equal(a, b)
        for a, b in zip(snapshot(first).values(), snapshot(resumed).values(), strict=True)
    )


def test_resume_without_checkpoint_names_the_directory(new_learner, tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint under"):
        new_learner(run_dir=tmp_path / "empty", resume="require")


def test_resume_auto_starts_fresh_or_resumes_and_says_which(new_learner, tmp_path, tiny_model):
    with capture_logs() as logs:
        fresh = new_learner(run_dir=tmp_path / "run", resume="auto")
    assert (fresh.step, fresh.version) == (0, 0)
    assert "no checkpoint: starting fresh" in [e["event"] for e in logs]
    fresh.train_step(on_policy(fixed_batch(), tiny_model))
    fresh.step, fresh.version = 1, 1
    fresh.save_checkpoint()
    with capture_logs() as logs:
        resumed = new_learner(run_dir=tmp_path / "run", resume="auto")
    assert (resumed.step, resumed.version) == (1, 1)
    params = snapshot(resumed)
    assert all(torch.equal(params[k], v) for k, v in snapshot(fresh).items())
    assert "resumed from checkpoint" in [e["event"] for e in logs]


def test_resume_flag_is_strict_alone_and_lenient_with_auto():
    parse = lambda *argv: build_parser().parse_args(["learner", *argv]).resume  # noqa: E731
    assert (parse(), parse("--resume"), parse("--resume", "auto")) == (None, "require", "auto")


def grpo_batch(rewards: list[float]) -> list[Segment]:
    """Four single-segment episodes, two per group, with the given episode rewards."""
    layouts = ["oooaaaa", "ooaaaaaaa", "oooooaaa", "ooaaaoaa"]
    return [
        make_segment(
            layout, episode_id=f"e{i}", rewards={len(layout) - 1: r}, group_id=f"g{i // 2}"
        )
        for i, (layout, r) in enumerate(zip(layouts, rewards, strict=True))
    ]


def test_grpo_trains_on_group_advantages_without_a_critic(new_learner, tiny_model):
    learner = new_learner("learner.algorithm=grpo", "actor.group_size=2")
    assert learner.critic is None
    before = snapshot(learner)
    stats = learner.train_step(on_policy(grpo_batch([1.0, 1.0, 0.0, 0.0]), tiny_model))
    assert not changed(before, snapshot(learner)), "equal rewards within each group carry no signal"
    stats = learner.train_step(on_policy(grpo_batch([1.0, 0.0, 0.0, 1.0]), tiny_model))
    assert changed(before, snapshot(learner))
    assert stats["value_loss"] == 0.0 and stats["grad_norm"] > 0
    assert stats["policy_updated"] == 1.0 and stats["update_kl"] > 0
    # Ties again: the gradient is 0, and Adam's momentum from the last step must not move it.
    moved = snapshot(learner)
    stats = learner.train_step(on_policy(grpo_batch([1.0, 1.0, 0.0, 0.0]), tiny_model))
    assert not changed(moved, snapshot(learner)), "a step with no signal moved the policy"
    assert stats["policy_updated"] == 0.0 and stats["update_kl"] == 0.0
    assert stats["zero_advantage_fraction"] == 1.0


def test_the_entropy_bonus_alone_moves_the_policy_towards_more_entropy(new_learner, tiny_model):
    """Tied groups carry no policy gradient; with entropy_coef > 0 the bonus still does, and the
    policy's entropy on the batch rises (the step reports pi_prox's, so the next step's shows it)."""
    tied = on_policy(grpo_batch([1.0, 1.0, 0.0, 0.0]), tiny_model)
    learner = new_learner("learner.algorithm=grpo", "actor.group_size=2", "learner.entropy_coef=1")
    before = snapshot(learner)
    first = learner.train_step(tied)
    assert first["policy_updated"] == 1.0 and changed(before, snapshot(learner))
    assert learner.train_step(tied)["entropy"] > first["entropy"]


@pytest.mark.parametrize("norm", ["none", "centre", "whiten"])
def test_advantage_normalisation_uses_the_action_tokens_only(norm):
    """Centred: mean 0 over action tokens; whitened: also std 1; observations and padding stay 0."""
    lc = load_config(None, [f"learner.advantage_norm={norm}"]).learner
    batch = Batch.of([s for ep in group_episodes(fixed_batch()) for s in ep])
    mask = batch.action_mask
    raw = torch.where(mask, torch.linspace(-1.0, 3.0, mask.numel()).reshape(mask.shape), 0.0)
    zeros = torch.zeros(mask.shape)
    targets, moments = TrainStep(lc, None, device="cpu")._normalised(batch, Targets(raw, zeros))
    adv = targets.advantages
    assert moments["advantage_mean"] == pytest.approx(float(raw[mask].double().mean()), abs=1e-6)
    assert moments["advantage_std"] == pytest.approx(
        float(raw[mask].double().std(unbiased=False)), abs=1e-6
    )
    assert adv[~mask].abs().max() == 0.0
    if norm == "none":
        assert torch.equal(adv, raw)
    else:
        assert float(adv[mask].double().mean()) == pytest.approx(0.0, abs=1e-5)
        spread = float(adv[mask].double().std(unbiased=False))
        expected = 1.0 if norm == "whiten" else moments["advantage_std"]
        assert spread == pytest.approx(expected, rel=1e-5)


def test_learning_rate_warms_up_linearly_over_optimiser_steps(new_learner, tiny_model):
    learner = new_learner("learner.optimizer.warmup_steps=4", "learner.optimizer.lr=1e-3")
    assert learner.policy.get_lr()[0] == pytest.approx(0.25e-3)
    assert learner.critic.get_lr()[0] == pytest.approx(0.25 * learner.lc.critic.lr)
    stats = learner.train_step(on_policy(fixed_batch(), tiny_model))
    assert stats["lr"] == pytest.approx(0.5e-3)  # what the next step uses
    for _ in range(3):
        stats = learner.train_step(on_policy(fixed_batch(), tiny_model))
    assert stats["lr"] == pytest.approx(1e-3)


def test_the_step_reports_the_entropy_of_pi_prox_on_action_tokens(new_learner, tiny_model):
    learner = new_learner()
    batch = on_policy(fixed_batch(), tiny_model)
    policy = Policy(str(tiny_model), torch.float32).eval()
    entropies = []
    with torch.no_grad():
        for seg in batch:
            ids = torch.from_numpy(seg.tokens.astype("int64"))[None]
            p = torch.softmax(policy(ids)[0, :-1], dim=-1)
            h = -(p * p.log()).sum(-1)  # H of the distribution token t+1 was chosen from
            entropies.append(h[torch.from_numpy(seg.action_mask[1:].astype(bool))])
    stats = learner.train_step(batch)
    assert stats["entropy"] == pytest.approx(float(torch.cat(entropies).mean()), rel=1e-4)
    assert stats["update_kl"] > 0 and stats["policy_updated"] == 1.0


def test_shared_critic_trains_the_value_head_on_the_policy_trunk(new_learner, tiny_model):
    learner = new_learner("learner.critic.kind=shared")
    assert learner.critic is None
    before = snapshot(learner)
    stats = learner.train_step(on_policy(fixed_batch(), tiny_model))
    after = snapshot(learner)
    assert stats["value_loss"] > 0 and math.isfinite(stats["policy_loss"])
    assert changed(before, after, "policy/head.") and changed(before, after, "policy/policy.")
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    assert set(learner.export_weights()) == set(
        state_dict_for_export(plain)
    )  # the value head stays home


def test_critic_warmup_steps_leave_the_policy_untouched(new_learner, tiny_model):
    learner = new_learner("learner.critic.warmup_steps=1")
    before = snapshot(learner)
    learner.train_step(on_policy(fixed_batch(), tiny_model))
    after = snapshot(learner)
    assert not changed(before, after, "policy/") and changed(before, after, "critic/")


def test_an_ev_gated_warmup_starts_the_policy_once_the_critic_fits_fresh_batches(
    new_learner, tiny_model, tmp_path
):
    """The gate reads the explained variance each batch gets before the critic trains on it (the
    step log's): policy updates start at the first step whose last EV_WINDOW values average at
    least critic.warmup_ev, stay on, and stay on after a resume."""
    overrides = (
        "learner.critic.warmup_steps=60",
        "learner.critic.warmup_ev=0.8",
        "learner.critic.updates=4",
        "learner.critic.lr=1e-2",
    )
    learner = new_learner(*overrides, run_dir=tmp_path / "gated")
    batch = on_policy(fixed_batch(), tiny_model)
    evs, updated = [], []
    for index in range(60):
        learner.step = index
        stats = learner.train_step(batch)
        evs.append(stats["explained_variance"])
        updated.append(stats["policy_updated"])
        if 1.0 in updated and len(updated) - updated.index(1.0) == 3:
            break  # started, and stayed on for two more steps
    assert 1.0 in updated, f"the critic never fitted: {evs}"
    start = updated.index(1.0)
    means = [np.mean(evs[i + 1 - EV_WINDOW : i + 1]) for i in range(EV_WINDOW - 1, start + 1)]
    assert means[-1] >= 0.8 and means[:-1] and all(m < 0.8 for m in means[:-1]), (evs, start)
    assert updated[start:] == [1.0] * len(updated[start:])
    learner.save_checkpoint()
    resumed = new_learner(*overrides, run_dir=tmp_path / "gated", resume="require")
    assert resumed.steps.policy_started and resumed.step < 60


def test_critic_replay_cycles_its_updates_through_the_last_batches(new_learner, tiny_model):
    """Update j of the critic trains on the j-th newest batch of the window, this step's first;
    without replay every update sees this step's batch."""
    episodes = fixed_batch()
    batches = [on_policy(b, tiny_model) for b in (episodes[:1], episodes[1:3], episodes[3:4])]
    for replay, expected in (
        (2, [[0, 0, 0], [1, 0, 1], [2, 1, 2]]),
        (1, [[0] * 3, [1] * 3, [2] * 3]),
    ):
        learner = new_learner("learner.critic.updates=3", f"learner.critic.replay={replay}")
        fit, seen = learner.steps._critic_loss, []
        learner.steps._critic_loss = lambda step, rows, fit=fit, seen=seen: (
            seen.append(step.batch) or fit(step, rows)
        )
        for batch in batches:
            learner.train_step(batch)
        order = list(dict.fromkeys(map(id, seen)))  # each step's batch first appears at its step
        assert [order.index(id(b)) for b in seen] == sum(expected, [])


def test_critic_replay_needs_a_critic_of_its_own():
    for other in ("learner.critic.kind=shared", "learner.algorithm=grpo"):
        with pytest.raises(ConfigError, match="learner.critic.replay"):
            load_config(None, ["learner.critic.replay=2", other])


def test_clip_stays_at_clip_start_without_a_horizon():
    run_until_stopped = load_config(None, ["learner.total_steps=0"]).learner
    assert [clip_epsilon(step, run_until_stopped) for step in (0, 1, 1000)] == [0.2] * 3
    scheduled = load_config(None, ["learner.total_steps=10"]).learner
    assert [clip_epsilon(step, scheduled) for step in (0, 5, 10, 20)] == pytest.approx(
        [0.2, 0.125, 0.05, 0.05]
    )


def test_explained_variance_is_one_minus_the_variance_ratio():
    returns = torch.tensor([1.0, 2.0, 3.0, 6.0])
    # A critic off by a constant explains every bit of the variance (the mean square would not).
    assert explained_variance(value_sums(returns, returns - 0.5)) == pytest.approx(1.0)
    values = torch.tensor([1.5, 1.0, 3.5, 4.0])
    expected = 1 - torch.var(returns - values, correction=0) / torch.var(returns, correction=0)
    assert explained_variance(value_sums(returns, values)) == pytest.approx(float(expected))
    halves = [value_sums(returns[i : i + 2], values[i : i + 2]) for i in (0, 2)]  # two ranks
    assert explained_variance([a + b for a, b in zip(*halves, strict=True)]) == pytest.approx(
        float(expected)
    )
    assert explained_variance(value_sums(torch.ones(3), torch.zeros(3))) == 0.0  # Var(R) = 0
    assert explained_variance(value_sums(torch.zeros(0), torch.zeros(0))) == 0.0


class RecordingHealth(Health):
    """What the learner said it was doing at each liveness beat."""

    def __init__(self) -> None:
        super().__init__()
        self.beats: list[str | None] = []

    def beat(self, waiting_for: str | None = None) -> None:
        super().beat(waiting_for)
        self.beats.append(waiting_for)


class FakeBroker:
    """Stands in for the socket client of the learner's broker link: answers every request, records what was sent
    and whether the learner was ready (``/readyz``) at that moment."""

    def __init__(self, learner: Learner, latest_version: int, fail_first: int = 0) -> None:
        self.learner, self.latest, self.fail_first = learner, latest_version, fail_first
        self.sent: list[tuple[str, int, bool]] = []  # (kind, version or chunk count, ready)

    def request(self, kind: str, header: dict | None = None, tensors=None, **kw):
        header = header or {}
        if kind == "HEARTBEAT":  # the link's heartbeat thread: answered, not recorded
            return SimpleNamespace(kind="HEARTBEAT_ACK", header={"latest_version": self.latest})
        self.sent.append((kind, header.get("version", -2), self.learner.health.ready))
        if self.fail_first:
            self.fail_first -= 1
            raise TransportError(f"{kind}: no reply in time")
        if kind == "PUBLISH":
            self.sent[-1] = (kind, header["manifest"]["version"], self.learner.health.ready)
            self.latest = header["manifest"]["version"]
        return SimpleNamespace(
            kind="WELCOME", header={"latest_version": self.latest, "heartbeat_s": 5.0}
        )

    def close(self) -> None:
        pass


def test_long_phases_keep_the_liveness_watchdog_fed(new_learner, tiny_model):
    learner = new_learner("learner.micro_batch_tokens=16", "learner.weight_chunk_bytes=4096")
    learner.health = learner.link.health = health = RecordingHealth()
    batch = on_policy(fixed_batch(), tiny_model)
    n_micro = len(micro_batches(lengths(batch), 16))
    learner.train_step(batch)
    assert health.beats.count("scoring the batch") == n_micro
    assert health.beats.count("training") == 2 * n_micro  # critic, then policy
    learner.link.client = FakeBroker(learner, latest_version=-1)
    learner.publish()  # the chunks stay here, served to fetchers: one message to the broker
    assert [kind for kind, _, _ in learner.link.client.sent] == ["PUBLISH"]
    assert health.beats.count("publishing weights") == 1
    health.beats.clear()
    learner.save_checkpoint()
    assert health.beats[:2] == ["saving the policy checkpoint", "saving the critic checkpoint"]


def test_stall_threshold_comes_from_the_config(monkeypatch):
    import common.log
    from deploy.cli import _serve_role

    monkeypatch.setattr(common.log, "setup_logging", lambda *a, **kw: None)
    args = build_parser().parse_args(["learner"])
    _, health = _serve_role("learner", args, load_config(None, ["run.stall_timeout_s=900"]))
    assert health.stall_s == 900


def test_ready_only_after_the_broker_welcomed_the_learner(new_learner):
    learner = new_learner()
    learner.link.client = broker = FakeBroker(learner, latest_version=-1, fail_first=1)
    learner.connect()
    assert [(kind, ready) for kind, _, ready in broker.sent[:2]] == [
        ("HELLO", False),  # no reply: not ready
        ("HELLO", False),
    ]
    assert learner.health.ready and learner.version == 0


def test_a_broker_that_lost_the_weights_gets_the_current_version_again(new_learner):
    learner = new_learner()
    learner.link.client = broker = FakeBroker(learner, latest_version=4)
    learner.connect()  # starts above the broker's newest version
    assert learner.version == 5 and broker.latest == 5
    broker.sent.clear()
    learner.link.reconnect()  # the same broker: it has version 5, nothing to send
    assert [kind for kind, _, _ in broker.sent] == ["HELLO"]
    broker.latest = -1  # restarted without a spool
    learner.link.reconnect()
    begins = [version for kind, version, _ in broker.sent if kind == "PUBLISH"]
    assert begins == [5] and broker.latest == 5 and learner.version == 5


def test_a_publish_retries_until_the_broker_answers_unless_the_learner_is_stopping(new_learner):
    learner = new_learner()
    learner.link.client = broker = FakeBroker(learner, latest_version=-1, fail_first=2)
    learner.publish()  # two timeouts, then the broker answers: the version gets there
    assert broker.latest == 0
    broker.sent.clear()
    learner.version, broker.fail_first = 1, 1000  # the broker is gone for good
    learner._stop = True  # SIGTERM: on to the final checkpoint after one failed try
    learner.publish()
    assert [kind for kind, _, _ in broker.sent] == ["PUBLISH"] and broker.latest == 0


def sampled_segments(model: Path, params: SamplingParams) -> list[Segment]:
    """Segments as an actor makes them: the torch engine samples from ``model`` and reports μ;
    each segment carries the temperature and top-p its tokens were drawn with."""
    engine = make_engine("torch", str(model))
    engine.load_weights(0, state_dict_for_export(load_causal_lm(model)))
    prompts = [[5, 6, 7, 8], [40, 41, 42], [100, 101, 102, 103, 104, 105]]
    segs = []
    for i, (prompt, gen) in enumerate(zip(prompts, engine.generate(prompts, params), strict=True)):
        n, k = len(prompt), len(gen.token_ids)
        segs.append(
            make_segment(
                "o" * n + "a" * k,
                episode_id=f"t{i}",
                temperature=gen.temperature,
                top_p=gen.top_p,
                tokens=np.array(prompt + gen.token_ids, "<i4"),
                behavior_logprobs=np.array([0.0] * n + gen.logprobs, "<f4"),
                versions=np.array([-1] * n + gen.versions, "<i4"),
            )
        )
    return segs


def test_the_learner_scores_each_segment_at_the_temperature_it_was_sampled_with(
    new_learner, tiny_model
):
    """An actor samples at 0.7 while the learner's YAML says 1.0: the learner scores with the
    segment's 0.7, so π_prox equals the actor's μ at zero staleness, and the step sees weights of 1."""
    learner = new_learner("actor.temperature=1.0")
    batch = sampled_segments(tiny_model, SamplingParams(max_new_tokens=10, temperature=0.7, seed=3))
    assert {s.temperature for s in batch} == {0.7}
    prox = prox_of(learner, batch)
    for seg, lp in zip(batch, prox, strict=True):
        act = seg.action_mask == 1
        np.testing.assert_allclose(lp.numpy()[act], seg.behavior_logprobs[act], rtol=0, atol=1e-4)
    # The same tokens claimed at 1.0 score differently: the temperature in the data is what counts.
    at_one = [dataclasses.replace(s, temperature=1.0) for s in batch]
    gap = max(
        float((lp - torch.from_numpy(s.behavior_logprobs)).abs()[s.action_mask == 1].max())
        for s, lp in zip(at_one, prox_of(learner, at_one), strict=True)
    )
    assert gap > 0.05
    stats = learner.train_step(batch)
    assert stats["icepop_kept_fraction"] == 1.0
    assert stats["importance_weight_mean"] == pytest.approx(1.0, abs=1e-3)


def test_nucleus_sampled_episodes_are_refused_and_counted(new_learner, tiny_model):
    learner = new_learner()
    batch = fixed_batch()
    batch[1] = dataclasses.replace(batch[1], top_p=0.9)  # one segment of the two-segment episode
    before = REGISTRY.get_sample_value(
        "asyncppo_learner_segments_rejected_total", {"reason": "top_p"}
    )
    with capture_logs() as logs:
        kept = learner._trainable(batch)
    assert [s.episode_id for s in kept] == ["short", "mid", "budget"]  # the whole episode went
    after = REGISTRY.get_sample_value(
        "asyncppo_learner_segments_rejected_total", {"reason": "top_p"}
    )
    assert after - (before or 0.0) == 2
    assert any(log.get("actors") == ["actor-0"] for log in logs), logs
