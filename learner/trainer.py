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

Steps 2-5 are ``learner.step.TrainStep`` on a rectangular ``learner.batch.Batch``; this module
holds what is around them: DeepSpeed engines, the broker link, publishing and checkpoints.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
from prometheus_client import Counter, Gauge, Histogram

from common.config import Config, LearnerConfig
from common.log import bind_version
from common.lora import adapter_tensors, apply_adapter, factor_pairs
from common.metrics import Health
from common.model import load_causal_lm, state_dict_for_export, tied_keys
from common.trajectory import Segment
from common.weights import pack_state_dict
from learner.algorithms import episode_rewards
from learner.batch import Batch, group_episodes, split_for_rank
from learner.distributed import all_reduce, any_rank, init_distributed
from learner.link import BrokerLink, share_batch
from learner.step import TrainStep, build_models

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
M_VERSION = Gauge(
    "asyncppo_learner_policy_version", "Policy version the learner trains (-1: none published yet)."
)
M_VERSION.set(-1)
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
        "entropy": "Mean entropy of pi_prox over the batch's action tokens (nats).",
        "update_kl": "k3 estimate of KL(pi_prox || pi_new) on the batch after the step: how far it moved.",
        "advantage_mean": "Mean policy advantage over action tokens, before normalisation.",
        "zero_advantage_fraction": "Share of action tokens whose advantage is exactly 0 (GRPO: tied groups).",
        "lr": "Policy learning rate of the next step (the warm-up schedule).",
        "reward_mean": "Mean episode reward of the last batch.",
    }.items()
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


RESUME_MODES = ("require", "auto")


def publish_dtype(cfg: Config) -> torch.dtype:
    """The dtype weights travel in: the actors' (``learner.publish_dtype`` auto), so no byte is
    sent that the engine would round away; the learner trains in its own."""
    name = cfg.learner.publish_dtype
    if name == "auto":
        engine = cfg.actor.engine_dtype
        bf16 = engine == "bfloat16" or (engine == "auto" and cfg.actor.engine == "sglang")
        name = "bfloat16" if bf16 else "float32"
    return DTYPES[name]


def deepspeed_engine(
    lc: LearnerConfig, dtype: torch.dtype, scheduler: Callable[[torch.optim.Optimizer], Any]
) -> Callable[[torch.nn.Module, float], Any]:
    """A function that wraps a model in a DeepSpeed engine with AdamW at a learning rate (its
    trainable parameters only: under LoRA the adapters and heads), the warm-up ``scheduler``,
    ZeRO at ``learner.zero_stage`` and gradient clipping; one micro-batch per engine call (the
    step accumulates its own)."""
    import deepspeed

    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": lc.optimizer.grad_clip,
        "zero_optimization": {"stage": lc.zero_stage},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }

    def engine(module: torch.nn.Module, lr: float) -> Any:
        trainable = [p for p in module.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=lc.optimizer.weight_decay)
        return deepspeed.initialize(
            model=module, optimizer=opt, lr_scheduler=scheduler, config=ds_config
        )[0]

    return engine


class Learner:
    """``resume``: None starts fresh; "require" loads the latest checkpoint and fails without one;
    "auto" loads it when there is one and starts fresh otherwise (a restarted pod)."""

    def __init__(self, cfg: Config, *, resume: str | None = None, health: Health | None = None):
        self.cfg, self.lc = cfg, cfg.learner
        self.health = health or Health()
        self.rank, self.world = init_distributed()
        torch.manual_seed(self.lc.seed)
        dtype = DTYPES[cfg.model.dtype]
        engine = deepspeed_engine(self.lc, dtype, self._warmup)
        models = build_models(self.lc, cfg.model.path, dtype, engine)
        self.policy, self.critic = models.policy, models.critic
        # The engine's device: inputs, the reference model and collectives live there (CPU + gloo
        # without a GPU, the rank's CUDA device + NCCL with one).
        self.device = self.policy.device
        if models.reference is not None:
            models.reference.to(self.device)
        self.steps = TrainStep(
            self.lc,
            models,
            device=self.device,
            world=self.world,
            reduce=self._all_reduce,
            beat=lambda what: self.health.beat(what),  # tests swap self.health
        )
        self.step = 0
        self.version = 0
        self.run_dir = Path(cfg.run.out_dir)
        self.ckpt_dir = Path(self.lc.checkpoint_dir or self.run_dir / "checkpoints")
        if resume is not None:
            self._load_checkpoint(resume)
        self._stop = False  # agreed by every rank (``_stop_agreed``), or set by a test
        self._requested: Callable[[], bool] = lambda: False  # this rank was told to stop
        # Rank 0's batches in, versions out: the only part of the learner that speaks the protocol.
        self.link = BrokerLink(cfg, self.health, self.stopping) if self.rank == 0 else None
        if self.rank == 0:
            self.steps_log = open(self.run_dir / "learner_steps.jsonl", "a")  # noqa: SIM115 (kept open)
        log.info(
            "learner ready",
            rank=self.rank,
            world=self.world,
            algorithm=self.lc.algorithm,
            critic=self.lc.critic.kind if self.critic is not None or models.shared else None,
            zero_stage=self.lc.zero_stage,
            lora_rank=self.lc.lora.rank,
            broker=self.lc.broker,
            step=self.step,
        )

    # ------------------------------------------------------------ the model
    def _warmup(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        """Linear learning-rate warm-up over the first ``optimizer.warmup_steps`` optimiser steps (lr/k,
        2·lr/k, …, lr); DeepSpeed steps it after every optimiser step and checkpoints it."""
        k = self.lc.optimizer.warmup_steps
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / max(k, 1)))

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
        """Export the policy's weights (under LoRA: its adapter, naming the base model), chunk
        them, push them; visible on COMMIT."""
        t0 = time.monotonic()
        self.health.beat("publishing weights")
        tensors = self.export_weights()
        dtype = publish_dtype(self.cfg)
        tensors = {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}
        if self.link is not None:
            manifest, chunks = pack_state_dict(
                tensors,
                self.version,
                self.lc.weight_chunk_bytes,
                adapter_base=self.policy.module.base_fingerprint,
            )
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
        """What ``publish`` sends: the policy's full state dict (tied tensors once), or under
        LoRA its adapter (``common.lora``); {} off rank 0.

        Under ZeRO-3 every rank must call this: DeepSpeed gathers the shards layer by layer.
        """
        module, lora = self._policy_module(), self.lc.lora
        state = (  # under LoRA only the adapters (and heads) train: the base is not gathered
            self.policy._zero3_consolidated_16bit_state_dict(
                exclude_frozen_parameters=lora.rank > 0
            )
            if self.lc.zero_stage == 3
            else None
        )
        if self.rank != 0:
            return {}
        if lora.rank:
            return self._adapter(module.state_dict() if state is None else state)
        if state is None:
            return state_dict_for_export(module)
        prefix, tied = "policy.", tied_keys(module)
        return {
            name: tensor
            for key, tensor in state.items()
            if key.startswith(prefix) and (name := key[len(prefix) :]) not in tied
        }

    def _adapter(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The policy's adapter as it travels (``common.lora``: B scaled by alpha / rank), from a
        state dict holding it."""
        lora = self.lc.lora
        return adapter_tensors(state, lora.alpha / lora.rank)

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
    def train_step(self, batch: list[Segment]) -> dict[str, Any]:
        """One step on the global batch: this rank's whole episodes as one ``Batch``, the
        ``TrainStep`` pipeline on it, and what the step trained on."""
        t0 = time.monotonic()
        episodes = group_episodes(batch)
        mine = Batch.of([s for ep in split_for_rank(episodes, self.rank, self.world) for s in ep])
        stats, n_tokens = self.steps(mine, episodes, self.step)
        return {
            **stats,
            "lr": float(self.policy.get_lr()[0]),
            **self._batch_facts(batch, episodes, n_tokens, time.monotonic() - t0),
        }

    def _batch_facts(
        self, batch: list[Segment], episodes: list[list[Segment]], tokens: float, seconds: float
    ) -> dict[str, Any]:
        """What the step trained on: rewards, sizes, staleness, throughput, who sent it."""
        staleness = [
            self.version - int(v) for s in batch for v in s.versions[s.action_mask.astype(bool)]
        ]
        rewards = episode_rewards(episodes)
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
    def stopping(self) -> bool:
        """Whether this rank is to stop: it checkpoints after the step it is in, and no wait on
        the broker holds it up."""
        return self._stop or self._requested()

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Train until ``total_steps`` or ``should_stop()`` (SIGTERM: ``common.lifecycle``)."""
        self._requested = should_stop
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
        if self.link is not None and not self._stop:  # completed: its last version lives on
            self.link.hand_over(self.cfg.learner.broker_timeout_s)
        log.info("learner finished", steps=self.step, version=self.version)

    def _stop_agreed(self) -> bool:
        """Whether any rank was signalled, all-reduced (max) at the step boundary: every rank stops
        after the same step, so none checkpoints while another waits in a collective."""
        if any_rank(self.stopping(), self.device):
            self._stop = True  # set, never cleared: a signal landing during the all-reduce stays
        return self._stop

    # --------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> None:
        """DeepSpeed checkpoint (weights + optimizer) with the version counter and step."""
        tag = f"step{self.step}"
        client_state = {
            "step": self.step,
            "version": self.version,
            "policy_started": self.steps.policy_started,  # an EV-gated warm-up that has ended
        }
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
        self.steps.policy_started |= client.get("policy_started", False)
        log.info(
            "resumed from checkpoint",
            dir=str(self.ckpt_dir),
            step=self.step,
            version=self.version,
            resume=mode,
        )

    def export(self, out_dir: str) -> None:
        """A Hugging Face ``save_pretrained`` directory of the policy and its tokenizer; under
        LoRA, as ``learner.lora.export`` says, the adapter (peft's format, naming the base model's
        path) or the base model with the adapter merged in."""
        from common.model import load_tokenizer

        module = self._policy_module()
        if self.lc.zero_stage == 3:
            from deepspeed.runtime.zero import GatheredParameters

            with GatheredParameters(list(module.parameters())):
                if self.rank == 0:
                    self._save_policy(module, out_dir)
        elif self.rank == 0:
            self._save_policy(module, out_dir)
        if self.rank == 0:
            load_tokenizer(self.cfg.model.path).save_pretrained(out_dir)
            log.info("exported Hugging Face checkpoint", dir=out_dir, lora=self.lc.lora.rank > 0)

    def _save_policy(self, module: torch.nn.Module, out_dir: str) -> None:
        lora = self.lc.lora
        if lora.rank == 0 or lora.export == "adapter":
            module.save_pretrained(out_dir)
            return
        model = load_causal_lm(self.cfg.model.path, dtype=DTYPES[self.cfg.model.dtype])
        apply_adapter(model, factor_pairs(self._adapter(module.state_dict())), {})
        model.save_pretrained(out_dir)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.steps_log.close()
