"""The learner: DeepSpeed training of the policy (and critic) on batches from the broker.

One step, top to bottom (docs/architecture.md, "Learner step"):

1. rank 0 asks the broker for a batch of whole episodes and broadcasts its raw frames; every rank
   decodes and validates them with the same wire decoder, then takes its share of episodes;
2. no-grad pass with the current weights: proximal log-probs log π_prox and values V;
3. advantages per segment (GAE, bootstrapped at compaction/truncation cuts) or GRPO's group ones,
   from the registry ``learner.algorithms.ESTIMATORS``;
4. behavior weights w = π_prox/μ masked by IcePop (or truncated, or none), detached
   (``learner.algorithms.CORRECTIONS``);
5. token-level PPO loss −w·min(ρA, clip(ρ)A), ρ = π_θ/π_prox, divided by the number of action
   tokens of the *global* batch (all ranks, all micro-batches), and the clipped value loss;
6. publish the new weights as version v+1 every ``publish_every`` steps; checkpoint.

DeepSpeed averages gradients over ranks; the losses are multiplied by the world size so that the
global-token denominator is exact: a long segment weighs the same on rank 0 or rank 1, in one
micro-batch or two.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
from prometheus_client import Counter, Gauge, Histogram

from common.config import Config, LearnerConfig
from common.log import bind_version
from common.metrics import Health
from common.model import state_dict_for_export, tied_keys
from common.trajectory import Segment
from common.weights import pack_state_dict
from learner import data
from learner.algorithms import ESTIMATORS, Scores, Targets, behavior_weights
from learner.distributed import all_reduce, any_rank, init_distributed
from learner.link import BrokerLink, share_batch
from learner.losses import (
    clip_schedule,
    kl_penalty,
    ppo_policy_loss,
    value_loss,
)
from learner.models import Critic, Policy, PolicyWithValue, shift_to_tokens, token_logprobs

log = structlog.get_logger()

M_STEPS = Counter("asyncppo_learner_steps_total", "Learner optimisation steps.")
M_TOKENS = Counter(
    "asyncppo_learner_action_tokens_trained_total",
    "Action tokens (action_mask = 1) trained on; prompt and observation tokens are not counted.",
)
M_TRAJ = Counter("asyncppo_learner_trajectories_trained_total", "Segments trained on.")
M_REJECTED = Counter(
    "asyncppo_learner_segments_rejected_total",
    "Segments dropped instead of trained, by reason: token ids outside the vocabulary (vocab), "
    "sampled with a nucleus the learner cannot score (top_p).",
    ["reason"],
)
M_STEP_S = Histogram(
    "asyncppo_learner_step_seconds",
    "Seconds per training step (excluding the wait).",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)
M_STALE = Histogram(
    "asyncppo_learner_staleness",
    "Policy-version lag of trained action tokens.",
    buckets=(0, 1, 2, 3, 4, 6, 8, 16),
)
M_LAST = Gauge(
    "asyncppo_learner_last_step_timestamp_seconds", "Unix time of the last finished step."
)
M_VERSION = Gauge("asyncppo_learner_policy_version", "Policy version the learner trains.")
GAUGES = {
    name: Gauge(f"asyncppo_learner_{name}", doc)
    for name, doc in {
        "policy_loss": "PPO policy loss of the last step.",
        "value_loss": "Value loss of the last step.",
        "clip_fraction": "Fraction of action tokens where the PPO clip was active.",
        "approx_kl": "k3 estimate of KL(pi_prox || pi_theta).",
        "icepop_kept_fraction": "Fraction of action tokens whose behavior weight was kept.",
        "importance_weight_mean": "Mean behavior weight pi_prox/mu over action tokens.",
        "importance_weight_max": "Largest behavior weight pi_prox/mu in the batch.",
        "explained_variance": "1 - Var(R - V) / Var(R) of the critic.",
        "grad_norm": "Policy gradient norm before clipping.",
        "reward_mean": "Mean episode reward of the last batch.",
    }.items()
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def clip_epsilon(step: int, lc: LearnerConfig) -> float:
    """PPO clip epsilon at ``step``: linear from clip_start to clip_end over total_steps; with
    total_steps = 0 (run until stopped) there is no horizon to schedule over, so clip_start."""
    if lc.total_steps == 0:
        return lc.clip_start
    return clip_schedule(step, lc.total_steps, start=lc.clip_start, end=lc.clip_end)


def value_sums(returns: torch.Tensor, values: torch.Tensor) -> list[float]:
    """[n, ΣR, ΣR², Σ(R−V), Σ(R−V)²] over the given (action) tokens, in float64.

    Sums, so that ranks can all-reduce them before ``explained_variance``.
    """
    r, d = returns.double(), returns.double() - values.double()
    return [
        float(r.numel()),
        float(r.sum()),
        float((r**2).sum()),
        float(d.sum()),
        float((d**2).sum()),
    ]


VALUE_SUMS = ("n", "sum_r", "sum_r2", "sum_d", "sum_d2")  # the names of value_sums' entries


@dataclass(frozen=True)
class Step:
    """What one step's optimisation reads: this rank's segments and what was computed on them."""

    segs: list[Segment]
    scores: Scores
    targets: Targets
    weights: list[torch.Tensor]  # behavior weights on action tokens, 0 elsewhere
    masks: list[torch.Tensor]  # action tokens
    denominator: float  # action tokens of the global batch: the loss's token-mean denominator
    clip: float
    micro_batches: list[list[int]]  # segment indices of each of this rank's micro-batches
    n_micro: int  # micro-batches per optimiser step on every rank (the most any rank has)


LOSS_TERMS = ("policy_loss", "value_loss", "clip_fraction", "approx_kl")


def explained_variance(sums: Sequence[float]) -> float:
    """1 − Var(R−V) / Var(R) from ``value_sums`` (population variances); 0 without variance.

    Var, not the mean square: a critic off by a constant explains all the variance (1.0).
    """
    n, r, r2, d, d2 = sums
    if n <= 0:
        return 0.0
    var_r = r2 / n - (r / n) ** 2
    if var_r <= 1e-12:
        return 0.0
    return 1.0 - (d2 / n - (d / n) ** 2) / var_r


RESUME_MODES = ("require", "auto")


class Learner:
    """``resume``: None starts fresh; "require" loads the latest checkpoint and fails without one;
    "auto" loads it when there is one and starts fresh otherwise (a restarted pod)."""

    def __init__(self, cfg: Config, *, resume: str | None = None, health: Health | None = None):
        import deepspeed

        self.cfg, self.lc = cfg, cfg.learner
        self.health = health or Health()
        self.rank, self.world = init_distributed()
        torch.manual_seed(self.lc.seed)
        dtype = DTYPES[cfg.model.dtype]
        self.shared = self.lc.algorithm == "ppo" and self.lc.critic == "shared"
        self.use_critic = self.lc.algorithm == "ppo"
        path = cfg.model.path
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.lc.grad_clip,
            "zero_optimization": {"stage": self.lc.zero_stage},
            "bf16": {"enabled": dtype == torch.bfloat16},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
        }

        def engine(module: torch.nn.Module, lr: float) -> Any:
            opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=self.lc.weight_decay)
            return deepspeed.initialize(model=module, optimizer=opt, config=ds_config)[0]

        self.policy = engine(
            PolicyWithValue(path, dtype) if self.shared else Policy(path, dtype), self.lc.lr
        )
        self.critic = (
            engine(Critic(path, dtype), self.lc.critic_lr)
            if self.use_critic and not self.shared
            else None
        )
        # The engine's device: inputs, the reference model and collectives live there (CPU + gloo
        # without a GPU, the rank's CUDA device + NCCL with one).
        self.device = self.policy.device
        self.reference = (
            Policy(path, dtype).eval().requires_grad_(False).to(self.device)
            if self.lc.kl_coef > 0
            else None
        )
        self.step = 0
        self.version = 0
        self.run_dir = Path(cfg.run.out_dir)
        self.ckpt_dir = Path(self.lc.checkpoint_dir or self.run_dir / "checkpoints")
        if resume is not None:
            self._load_checkpoint(resume)
        self._stop = False
        # Rank 0's batches in, versions out: the only part of the learner that speaks the protocol.
        self.link = BrokerLink(cfg, self.health, lambda: self._stop) if self.rank == 0 else None
        if self.rank == 0:
            self.steps_log = open(self.run_dir / "learner_steps.jsonl", "a")  # noqa: SIM115 (kept open)
        log.info(
            "learner ready",
            rank=self.rank,
            world=self.world,
            algorithm=self.lc.algorithm,
            critic=self.lc.critic if self.use_critic else None,
            zero_stage=self.lc.zero_stage,
            broker=self.lc.broker,
            step=self.step,
        )

    # ------------------------------------------------------------ the model
    def _forward(
        self, input_ids: torch.Tensor, attn: torch.Tensor, temps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass per model: policy log-probs [B,T] aligned to tokens, each row at its own
        sampling temperature, and the critic's raw outputs [B,T] (index t = the state after
        token t; None without a critic)."""
        if self.shared:
            logits, raw = self.policy(input_ids, attn)
        else:
            logits = self.policy(input_ids, attn)
            raw = self.critic(input_ids, attn) if self.critic is not None else None
        return token_logprobs(logits, input_ids, temps), raw

    def _policy_module(self) -> torch.nn.Module:
        return self.policy.module.policy

    def _all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        return all_reduce(values, op, self.device)

    # -------------------------------------------------------------- broker
    def connect(self) -> None:
        """HELLO, then publish the starting weights under a version newer than any the broker has.

        Ready (``/readyz``) once the broker has answered: the all-reduce waits for rank 0's WELCOME.
        """
        if self.link is not None:
            self.version = max(self.version, self.link.hello(self.version) + 1)
        self.version = int(self._all_reduce([float(self.version)], "max")[0])
        self.health.ready = True
        self.publish()

    def publish(self) -> None:
        """Export the full state dict (tied tensors once), chunk it, push it; visible on COMMIT."""
        t0 = time.monotonic()
        self.health.beat("publishing weights")
        tensors = self.export_weights()
        if self.link is not None:
            manifest, chunks = pack_state_dict(tensors, self.version, self.lc.weight_chunk_bytes)
            del tensors
            self.link.publish(manifest, chunks)
            log.info(
                "published weights",
                version=self.version,
                bytes=manifest["total_bytes"],
                seconds=round(time.monotonic() - t0, 3),
            )
        M_VERSION.set(self.version)
        bind_version(self.version)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The policy's full state dict as ``publish`` sends it (tied tensors once); {} off rank 0.

        Under ZeRO-3 every rank must call this: DeepSpeed gathers the shards layer by layer.
        """
        module = self._policy_module()
        if self.lc.zero_stage != 3:
            return state_dict_for_export(module) if self.rank == 0 else {}
        state = self.policy._zero3_consolidated_16bit_state_dict()
        if self.rank != 0:
            return {}
        prefix, tied = "policy.", tied_keys(module)
        return {
            name: tensor
            for key, tensor in state.items()
            if key.startswith(prefix) and (name := key[len(prefix) :]) not in tied
        }

    def _get_batch(self) -> list[Segment]:
        """Rank 0 waits for a batch; every rank gets the same segments, validated by the wire decoder."""
        publishes_after = (self.step + 1) % self.lc.publish_every == 0
        msg = self.link.next_batch(self.version, publishes_after) if self.link else None
        return self._trainable(share_batch(msg, self.rank, self.world, self.device))

    def _trainable(self, segs: list[Segment]) -> list[Segment]:
        """Drop (and count) whole episodes the learner cannot train on faithfully, instead of
        crashing on them or training on a biased signal:

        * token ids the model cannot embed;
        * tokens sampled from a top-p nucleus (``top_p < 1``). The learner scores the full
          softmax at the segment's temperature; for nucleus-sampled tokens μ is renormalised on the
          nucleus, so π_prox/μ would equal the nucleus mass on every token (a systematic shift, not
          staleness) and tokens outside the nucleus could never be sampled. Scoring under the
          same nucleus would need π_θ's nucleus at every position (a sort over the vocabulary per
          token); until then such segments are refused, naming their actors.
        """
        vocab = self._policy_module().config.vocab_size
        for reason, bad_segment, what in (
            ("vocab", lambda s: int(s.tokens.max()) >= vocab, f"token ids >= vocab_size {vocab}"),
            ("top_p", lambda s: s.top_p < 1.0, "sampled with top_p < 1, which it cannot score"),
        ):
            bad = {s.episode_id for s in segs if bad_segment(s)}
            if bad:
                dropped = [s for s in segs if s.episode_id in bad]
                M_REJECTED.labels(reason=reason).inc(len(dropped))
                log.error(
                    f"learner refused segments: {what}",
                    episodes=len(bad),
                    actors=sorted({s.actor_id for s in dropped}),
                )
                segs = [s for s in segs if s.episode_id not in bad]
        return segs

    # ---------------------------------------------------------------- step
    @torch.no_grad()
    def _score(self, segs: list[Segment]) -> Scores:
        """No-grad pass: log π_prox, V aligned to tokens, V after the last token, reference log-probs."""
        prox, values, end_values, ref = [], [], [], [] if self.reference is not None else None
        for idx in data.micro_batches(segs, self.lc.micro_batch_tokens):
            self.health.beat("scoring the batch")
            ids, attn, lens, temps = self._inputs([segs[i] for i in idx])
            lp, raw = self._forward(ids, attn, temps)
            v = shift_to_tokens(raw) if raw is not None else torch.zeros_like(lp)
            # The value after each segment's last token: the bootstrap at a cut with no next segment.
            vend = [float(raw[j, n - 1]) if raw is not None else 0.0 for j, n in enumerate(lens)]
            r = token_logprobs(self.reference(ids, attn), ids, temps) if ref is not None else None
            # Per-token bookkeeping (advantages, weights, statistics) runs on the CPU; the losses
            # move what they need back to the engine's device.
            lp, v = lp.cpu(), v.cpu()
            r = r.cpu() if r is not None else None
            for j, i in enumerate(idx):
                prox.append((i, lp[j, : lens[j]]))
                values.append((i, v[j, : lens[j]]))
                end_values.append((i, vend[j]))
                if ref is not None:
                    ref.append((i, r[j, : lens[j]]))
        order = lambda pairs: [t for _, t in sorted(pairs, key=lambda p: p[0])]  # noqa: E731
        return Scores(
            order(prox),
            order(values),
            order(end_values),
            order(ref) if ref is not None else None,
        )

    def _inputs(
        self, segs: list[Segment]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor]:
        """Padded token ids and attention mask on the engine's device, the true lengths, and the
        temperature each row was sampled with (it travels with the segment)."""
        lens = [s.num_tokens for s in segs]
        ids = data.pad([torch.from_numpy(s.tokens.astype("int64")) for s in segs])
        attn = data.pad([torch.ones(n, dtype=torch.long) for n in lens])
        temps = torch.tensor([s.temperature for s in segs], dtype=torch.float32)
        return ids.to(self.device), attn.to(self.device), lens, temps

    def _rows(self, xs: list[torch.Tensor], idx: list[int]) -> torch.Tensor:
        """Per-token tensors of micro-batch ``idx``, padded, on the engine's device."""
        return data.pad([xs[i] for i in idx]).to(self.device)

    def train_step(self, batch: list[Segment]) -> dict[str, Any]:
        """One step, a pipeline: score -> targets -> behavior weights -> optimise -> statistics."""
        t0 = time.monotonic()
        episodes = data.group_episodes(batch)
        segs = [s for ep in data.split_for_rank(episodes, self.rank, self.world) for s in ep]
        scores = self._score(segs)
        targets = ESTIMATORS[self.lc.algorithm](episodes, segs, scores, self.lc)
        masks = [torch.from_numpy(s.action_mask.astype(bool)) for s in segs]
        weights, keeps = behavior_weights(segs, scores.prox, masks, self.lc)
        (n_tokens,) = self._all_reduce([float(sum(s.num_action_tokens for s in segs))])
        mbs = data.micro_batches(segs, self.lc.micro_batch_tokens)
        step = Step(
            segs,
            scores,
            targets,
            weights,
            masks=masks,
            denominator=max(n_tokens, 1.0),
            clip=clip_epsilon(self.step, self.lc),
            micro_batches=mbs,
            n_micro=int(self._all_reduce([float(len(mbs))], "max")[0]),
        )
        losses = self._optimise(step)
        return {
            **self._statistics(step, keeps, losses),
            **self._batch_facts(batch, episodes, n_tokens, time.monotonic() - t0),
            "clip": step.clip,
        }

    def _optimise(self, step: Step) -> dict[str, float]:
        """``ppo_epochs`` passes: the critic's updates, then the policy's (after the critic's
        warm-up); the loss terms' means over the epochs and the policy's last gradient norm."""
        lc = self.lc
        train_policy = self.step >= lc.critic_warmup_steps
        sums = dict.fromkeys(LOSS_TERMS, 0.0)
        grad_norm = 0.0
        for _ in range(lc.ppo_epochs):
            if self.critic is not None:
                for _ in range(lc.critic_updates):
                    terms, _ = self._micro_steps(self.critic, step, self._critic_loss)
                    sums["value_loss"] += terms.get("value_loss", 0.0) / lc.critic_updates
            if train_policy or self.shared:
                terms, grad_norm = self._micro_steps(
                    self.policy, step, lambda s, idx: self._policy_loss(s, idx, train_policy)
                )
                for key, value in terms.items():
                    sums[key] += value
        return {**{k: v / lc.ppo_epochs for k, v in sums.items()}, "grad_norm": grad_norm}

    def _micro_steps(
        self,
        engine: Any,
        step: Step,
        loss_fn: Callable[[Step, list[int]], tuple[torch.Tensor, dict[str, float]]],
    ) -> tuple[dict[str, float], float]:
        """Accumulate over the same number of micro-batches on every rank, then step once; the
        loss terms summed over this rank's micro-batches, and the gradient norm before clipping.

        DeepSpeed keeps the norm only in its ZeRO optimizers; without ZeRO the (already
        all-reduced) gradients are plain ``.grad``.
        """
        sums: dict[str, float] = {}
        for j in range(step.n_micro):
            self.health.beat("training")
            engine.set_gradient_accumulation_boundary(j == step.n_micro - 1)
            if j < len(step.micro_batches):
                loss, terms = loss_fn(step, step.micro_batches[j])
                for key, value in terms.items():
                    sums[key] = sums.get(key, 0.0) + value
            else:
                loss = self._zero_loss(engine)
            engine.backward(loss * self.world, scale_wrt_gas=False)
        grads = (
            [p.grad for p in engine.module.parameters() if p.grad is not None]
            if self.lc.zero_stage == 0
            else None
        )
        norm = torch.nn.utils.get_total_norm(grads) if grads is not None else None
        engine.step()
        return sums, float(engine.get_global_grad_norm() if norm is None else norm)

    def _policy_loss(
        self, step: Step, idx: list[int], train_policy: bool
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Token-level PPO on the proximal policy (+ KL to a reference, + the shared critic's
        value loss); the loss and its terms."""
        lc = self.lc
        ids, attn, _, temps = self._inputs([step.segs[i] for i in idx])
        out = self.policy(ids, attn)
        lp = token_logprobs(out[0] if self.shared else out, ids, temps)
        rows = lambda xs: self._rows(xs, idx)  # noqa: E731
        mask = rows(step.masks)
        loss, stats = ppo_policy_loss(
            lp,
            rows(step.scores.prox),
            rows(step.targets.advantages),
            rows(step.weights),
            mask,
            clip_low=step.clip,
            clip_high=step.clip,
            denominator=step.denominator,
        )
        terms = {
            "policy_loss": float(loss),
            "clip_fraction": float(stats["clip_fraction"]),
            "approx_kl": float(stats["approx_kl"]),
        }
        if step.scores.ref is not None:
            kl = kl_penalty(lp, rows(step.scores.ref), mask, denominator=step.denominator)
            loss = loss + lc.kl_coef * kl
        if self.shared:
            vl = value_loss(
                shift_to_tokens(out[1]),
                rows(step.scores.values),
                rows(step.targets.returns),
                mask,
                clip=lc.value_clip,
                denominator=step.denominator,
            )
            terms["value_loss"] = float(vl)
            loss = (loss if train_policy else loss * 0) + lc.value_coef * vl
        return loss, terms

    def _critic_loss(self, step: Step, idx: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        ids, attn, _, _ = self._inputs([step.segs[i] for i in idx])
        rows = lambda xs: self._rows(xs, idx)  # noqa: E731
        vl = value_loss(
            shift_to_tokens(self.critic(ids, attn)),
            rows(step.scores.values),
            rows(step.targets.returns),
            rows(step.masks),
            clip=self.lc.value_clip,
            denominator=step.denominator,
        )
        return vl, {"value_loss": float(vl)}

    def _statistics(
        self, step: Step, keeps: list[torch.Tensor], losses: dict[str, float]
    ) -> dict[str, float]:
        """Over the global batch (every rank contributes its sums): the losses, IcePop's kept
        fraction, the raw behavior weights π_prox/μ (before masking or truncation) and the
        critic's explained variance over the action tokens."""
        ratios = [
            torch.exp(torch.clamp(p[m] - torch.from_numpy(s.behavior_logprobs)[m], -20, 20))
            for s, p, m in zip(step.segs, step.scores.prox, step.masks, strict=True)
        ]

        def on_actions(xs: list[torch.Tensor]) -> torch.Tensor:
            pairs = zip(xs, step.masks, strict=True)
            return torch.cat([x[m] for x, m in pairs]) if xs else torch.zeros(0)

        local = {
            **{k: losses[k] for k in LOSS_TERMS},
            "kept": float(sum(int(k.sum()) for k in keeps)),
            "weight_sum": float(sum(float(r.sum()) for r in ratios)),
            **dict(
                zip(
                    VALUE_SUMS,
                    value_sums(on_actions(step.targets.returns), on_actions(step.scores.values)),
                    strict=True,
                )
            ),
        }
        g = dict(zip(local, self._all_reduce(list(local.values())), strict=True))
        weight_max = max((float(r.max()) for r in ratios if r.numel()), default=0.0)
        return {
            **{k: g[k] for k in LOSS_TERMS},
            "icepop_kept_fraction": g["kept"] / step.denominator,
            "importance_weight_mean": g["weight_sum"] / step.denominator,
            "importance_weight_max": self._all_reduce([weight_max], "max")[0],
            "explained_variance": (
                explained_variance([g[k] for k in VALUE_SUMS]) if self.use_critic else 0.0
            ),
            "grad_norm": losses["grad_norm"],
        }

    def _batch_facts(
        self, batch: list[Segment], episodes: list[list[Segment]], tokens: float, seconds: float
    ) -> dict[str, Any]:
        """What the step trained on: rewards, sizes, staleness, throughput, who sent it."""
        staleness = [
            self.version - int(v) for s in batch for v in s.versions[s.action_mask.astype(bool)]
        ]
        rewards = data.episode_rewards(episodes)
        return {
            "step": self.step,
            "version": self.version,
            "reward_mean": float(np.mean(rewards)),
            "episode_rewards": rewards,
            "episodes": len(episodes),
            "segments": len(batch),
            "tokens": int(tokens),
            "max_staleness": max(staleness),
            "staleness_histogram": np.bincount(staleness).tolist(),
            "step_seconds": seconds,
            "tokens_per_second": tokens / max(seconds, 1e-9),
            "actors": sorted({s.actor_id for s in batch}),
            "time": time.time(),
            "traj_ids": [s.traj_id for s in batch],  # lets a reader check nothing trains twice
        }

    def _zero_loss(self, engine: Any) -> torch.Tensor:
        """A loss of exactly 0 from a one-token forward pass: keeps ranks in lockstep in collectives.

        A real forward, not a sum over parameters: under ZeRO-3 parameters exist only inside it.
        """
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        out = engine(ids, torch.ones_like(ids))
        return sum(o.sum() for o in (out if isinstance(out, tuple) else (out,))) * 0.0

    def _record(self, stats: dict[str, Any], batch: list[Segment]) -> None:
        M_STEPS.inc()
        M_TOKENS.inc(stats["tokens"])
        M_TRAJ.inc(stats["segments"])
        M_STEP_S.observe(stats["step_seconds"])
        M_LAST.set(time.time())
        for s in batch:
            for v in s.versions[s.action_mask.astype(bool)]:
                M_STALE.observe(self.version - int(v))
        for name, gauge in GAUGES.items():
            gauge.set(stats[name])
        self.steps_log.write(json.dumps(stats) + "\n")
        self.steps_log.flush()
        log.info(
            "step",
            step=stats["step"],
            reward=round(stats["reward_mean"], 4),
            tokens=stats["tokens"],
            policy_loss=round(stats["policy_loss"], 5),
            value_loss=round(stats["value_loss"], 5),
            kept=round(stats["icepop_kept_fraction"], 4),
            staleness_max=stats["max_staleness"],
            seconds=round(stats["step_seconds"], 3),
        )

    # --------------------------------------------------------------- loop
    def run(self) -> None:
        def on_sigterm(signum: int, frame: Any) -> None:
            self._stop = True
            log.warning("signal received: checkpointing after this step", signal=signum)

        signal.signal(signal.SIGTERM, on_sigterm)
        signal.signal(signal.SIGINT, on_sigterm)
        self.connect()
        while not self._stop_agreed() and (
            self.lc.total_steps == 0 or self.step < self.lc.total_steps
        ):
            batch = self._get_batch()
            if not batch:
                continue  # stopping, or every episode of the batch was dropped
            stats = self.train_step(batch)
            if self.rank == 0:
                self._record(stats, batch)
            self.step += 1
            self.health.beat("training")
            if self.step % self.lc.publish_every == 0:
                self.version += 1
                self.publish()
            if self.lc.checkpoint_every and self.step % self.lc.checkpoint_every == 0:
                self.save_checkpoint()
        self.save_checkpoint()
        if self.lc.export_dir:
            self.export(self.lc.export_dir)
        log.info("learner finished", steps=self.step, version=self.version)

    def _stop_agreed(self) -> bool:
        """Whether any rank was signalled, all-reduced (max) at the step boundary: every rank stops
        after the same step, so none checkpoints while another waits in a collective."""
        if any_rank(self._stop, self.device):
            self._stop = True  # set, never cleared: a signal landing during the all-reduce stays
        return self._stop

    # --------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> None:
        """DeepSpeed checkpoint (weights + optimizer) with the version counter and step."""
        tag = f"step{self.step}"
        client_state = {"step": self.step, "version": self.version}
        for name, engine in (("policy", self.policy), ("critic", self.critic)):
            if engine is not None:
                self.health.beat(f"saving the {name} checkpoint")
                engine.save_checkpoint(
                    str(self.ckpt_dir / name), tag=tag, client_state=client_state
                )
        self.health.beat("checkpoint saved")
        log.info("checkpoint saved", dir=str(self.ckpt_dir), step=self.step, version=self.version)

    def _load_checkpoint(self, mode: str) -> None:
        """``mode`` "require": the latest checkpoint or FileNotFoundError; "auto": the latest
        checkpoint if there is one, else a fresh start. Logs which of the two happened."""
        if mode not in RESUME_MODES:
            raise ValueError(f"resume must be one of {RESUME_MODES} or None, got {mode!r}")
        if not (self.ckpt_dir / "policy" / "latest").exists():
            if mode == "auto":
                log.info("no checkpoint: starting fresh", dir=str(self.ckpt_dir), resume=mode)
                return
            raise FileNotFoundError(
                f"--resume: no checkpoint under {self.ckpt_dir}/policy (no 'latest' file)"
            )
        _, client = self.policy.load_checkpoint(str(self.ckpt_dir / "policy"))
        if self.critic is not None:
            self.critic.load_checkpoint(str(self.ckpt_dir / "critic"))
        self.step, self.version = client["step"], client["version"]
        log.info(
            "resumed from checkpoint",
            dir=str(self.ckpt_dir),
            step=self.step,
            version=self.version,
            resume=mode,
        )

    def export(self, out_dir: str) -> None:
        """A Hugging Face ``save_pretrained`` directory of the policy (and its tokenizer)."""
        from common.model import load_tokenizer

        module = self._policy_module()
        if self.lc.zero_stage == 3:
            from deepspeed.runtime.zero import GatheredParameters

            with GatheredParameters(list(module.parameters())):
                if self.rank == 0:
                    module.save_pretrained(out_dir)
        elif self.rank == 0:
            module.save_pretrained(out_dir)
        if self.rank == 0:
            load_tokenizer(self.cfg.model.path).save_pretrained(out_dir)
            log.info("exported Hugging Face checkpoint", dir=out_dir)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.steps_log.close()
