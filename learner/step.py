"""One optimisation step on a ``Batch``, a pipeline: score -> targets -> behavior weights ->
optimise -> statistics (docs/architecture.md, "Learner step").

It knows nothing of brokers, checkpoints or processes: models come in as *engines* (a DeepSpeed
engine, or anything with the same five members — ``bench/learner.py`` passes plain torch modules
with AdamW), statistics leave through ``reduce`` (an all-reduce over ranks, or the identity).

DeepSpeed averages gradients over ranks; the losses are multiplied by the world size so that the
global-token denominator is exact: a long segment weighs the same on rank 0 or rank 1, in one
micro-batch or two.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
import torch

from common.config import LearnerConfig
from common.trajectory import Segment
from learner.algorithms import (
    ADVANTAGE_NORMS,
    ANCHORS,
    ESTIMATORS,
    Scores,
    Targets,
    behavior_weights,
)
from learner.batch import Batch
from learner.losses import (
    clip_schedule,
    entropy_bonus,
    kl_penalty,
    ppo_policy_loss,
    value_loss,
)
from learner.models import (
    Critic,
    Policy,
    PolicyWithValue,
    shift_to_tokens,
    token_logprobs,
    token_logprobs_and_entropy,
)
from learner.value import VALUE_SUMS, explained_variance, value_sums


class Engine(Protocol):
    """What the step needs of a trainable model (the subset of a DeepSpeed engine it uses)."""

    module: torch.nn.Module

    def __call__(self, input_ids: torch.Tensor) -> Any: ...
    def set_gradient_accumulation_boundary(self, boundary: bool) -> None: ...
    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> Any: ...
    def step(self) -> None: ...
    def get_global_grad_norm(self) -> float | None: ...


@dataclass(frozen=True)
class Models:
    """The step's models: ``policy`` returns logits, or (logits, values) when ``shared`` (a value
    head on the policy's trunk); ``critic`` a separate value model or None; ``reference`` a frozen
    policy for the KL penalty or None."""

    policy: Engine
    critic: Engine | None
    reference: torch.nn.Module | None
    shared: bool


Reduce = Callable[[list[float], str], list[float]]
LOSS_TERMS = ("policy_loss", "value_loss", "clip_fraction", "approx_kl")
# Batches whose mean explained variance gates the critic's warm-up (learner.critic.warmup_ev):
# one batch of 32 episodes is too noisy a measure (measured on the chain: -0.15 to 0.6 between
# consecutive steps of one run).
EV_WINDOW = 5

log = structlog.get_logger()


def clip_epsilon(step: int, lc: LearnerConfig) -> float:
    """PPO clip epsilon at ``step``: linear from clip_start to clip_end over total_steps; with
    total_steps = 0 (run until stopped) there is no horizon to schedule over, so clip_start."""
    if lc.total_steps == 0:
        return lc.clip_start
    return clip_schedule(step, lc.total_steps, start=lc.clip_start, end=lc.clip_end)


@dataclass(frozen=True)
class Step:
    """What one step's optimisation reads: this rank's rows and what was computed on them."""

    batch: Batch
    scores: Scores
    targets: Targets
    weights: torch.Tensor  # [B, T] behavior weights on action tokens, 0 elsewhere
    anchor: torch.Tensor  # [B, T] log π_old of the clipped ratio (learner.proximal)
    denominator: float  # action tokens of the global batch: the loss's token-mean denominator
    clip: float
    micro_batches: list[list[int]]  # row indices of each of this rank's micro-batches
    n_micro: int  # micro-batches per optimiser step on every rank (the most any rank has)


class TrainStep:
    """``step(batch, episodes, index)``: one optimisation step of the models on this rank's rows
    ``batch``; ``episodes`` is the global batch (GRPO's groups span ranks); ``index`` the step
    count (the clip schedule and the critic's warm-up read it)."""

    def __init__(
        self,
        lc: LearnerConfig,
        models: Models,
        *,
        device: torch.device | str,
        world: int = 1,
        reduce: Reduce = lambda values, op: values,
        beat: Callable[[str], None] = lambda what: None,
    ):
        self.lc, self.models, self.device, self.world = lc, models, device, world
        self.reduce, self.beat = reduce, beat
        # The critic's warm-up (``_policy_starts``): whether policy updates have started (a
        # checkpoint keeps it), and the critic's explained variance on the last fresh batches.
        self.policy_started = lc.critic.warmup_steps == 0
        self.recent_ev: deque[float] = deque(maxlen=EV_WINDOW)
        # The batches a separate critic's updates draw from (learner.critic.replay), newest last.
        self.critic_window: deque[Step] = deque(maxlen=lc.critic.replay)

    def __call__(
        self, batch: Batch, episodes: list[list[Segment]], index: int
    ) -> tuple[dict[str, float], float]:
        """The step's statistics, and the global batch's action tokens."""
        scores = self.score(batch)
        targets, moments = self._normalised(
            batch, ESTIMATORS[self.lc.algorithm](batch, scores, episodes, self.lc)
        )
        weights, keeps = behavior_weights(batch, scores.prox, self.lc)
        (n_tokens,) = self.reduce([float(batch.num_action_tokens)], "sum")
        mbs = batch.micro_batches(self.lc.micro_batch_tokens)
        step = Step(
            batch,
            scores,
            targets,
            weights,
            ANCHORS[self.lc.proximal](batch, scores),
            denominator=max(n_tokens, 1.0),
            clip=clip_epsilon(index, self.lc),
            micro_batches=mbs,
            n_micro=int(self.reduce([float(len(mbs))], "max")[0]),
        )
        # A batch whose every kept advantage is 0 (GRPO groups that all tie) has a zero policy
        # gradient, yet Adam's momentum would still move the policy: no policy step then, unless
        # the entropy bonus gives the step a gradient of its own.
        signal = float((targets.advantages * (weights != 0)).abs().max()) if len(batch) else 0.0
        (signal,) = self.reduce([signal], "max")
        train_policy = self._policy_starts(step, index) and (signal > 0 or self.lc.entropy_coef > 0)
        losses = self._optimise(step, train_policy=train_policy)
        moved = train_policy or self.models.shared
        (kl,) = self.reduce([self._update_kl(step) if moved else 0.0], "sum")
        return {
            **self._statistics(step, keeps, losses),
            **moments,
            "policy_updated": float(train_policy),
            "update_kl": kl / step.denominator,
            "clip": step.clip,
        }, n_tokens

    def _policy_starts(self, step: Step, index: int) -> bool:
        """Whether the critic's warm-up is over: after ``critic.warmup_steps`` steps, or, with
        ``critic.warmup_ev``, as soon as the critic's explained variance on the last
        ``EV_WINDOW`` batches reaches it. Each batch is new to the critic when it is scored here
        (before its update), so this is its fit on unseen episodes, not on what it trained on."""
        if not self.policy_started and self.lc.critic.warmup_ev > 0:
            mask = step.batch.action_mask
            sums = value_sums(step.targets.returns[mask], step.scores.values[mask])
            self.recent_ev.append(explained_variance(self.reduce(sums, "sum")))
            self.policy_started = (
                len(self.recent_ev) == EV_WINDOW
                and sum(self.recent_ev) / EV_WINDOW >= self.lc.critic.warmup_ev
            )
            if self.policy_started:
                log.info(
                    "critic warmed up: policy updates start", step=index, ev=list(self.recent_ev)
                )
        if not self.policy_started and index >= self.lc.critic.warmup_steps:
            self.policy_started = True
        return self.policy_started

    def _normalised(self, batch: Batch, targets: Targets) -> tuple[Targets, dict[str, float]]:
        """Advantages normalised by ``learner.advantage_norm`` with the global batch's action-token
        mean and standard deviation, and those two (before normalisation) for the step log."""
        mask = batch.action_mask
        a = targets.advantages[mask].double()
        n, total, squares = self.reduce(
            [float(a.numel()), float(a.sum()), float((a**2).sum())], "sum"
        )
        mean = total / max(n, 1.0)
        std = max(squares / max(n, 1.0) - mean**2, 0.0) ** 0.5
        adv = ADVANTAGE_NORMS[self.lc.advantage_norm](targets.advantages, mean, std)
        return targets._replace(advantages=torch.where(mask, adv, 0.0)), {
            "advantage_mean": mean,
            "advantage_std": std,
        }

    # ------------------------------------------------------------ the model
    def _forward(
        self, ids: torch.Tensor, temps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One pass per model: policy log-probs and entropies [B,T] aligned to tokens, each row at
        its own sampling temperature, and the critic's raw outputs [B,T] (index t = the state
        after token t; None without a critic)."""
        m = self.models
        if m.shared:
            logits, raw = m.policy(ids)
        else:
            logits = m.policy(ids)
            raw = m.critic(ids) if m.critic is not None else None
        return *token_logprobs_and_entropy(logits, ids, temps), raw

    @torch.no_grad()
    def score(self, batch: Batch) -> Scores:
        """No-grad pass: log π_prox, V aligned to tokens, V after each row's last token (the
        bootstrap at a cut with no next segment), reference log-probs.

        Per-token bookkeeping (advantages, weights, statistics) runs on the CPU; the losses move
        what they need back to the engine's device."""
        prox, values = torch.zeros(batch.tokens.shape), torch.zeros(batch.tokens.shape)
        end_values = torch.zeros(len(batch))
        ref = torch.zeros(batch.tokens.shape) if self.models.reference is not None else None
        entropy = torch.zeros(batch.tokens.shape)
        for rows in batch.micro_batches(self.lc.micro_batch_tokens):
            self.beat("scoring the batch")
            ids, temps = batch.inputs(rows, self.device)
            lp, h, raw = self._forward(ids, temps)
            width = ids.shape[1]
            prox[rows, :width], entropy[rows, :width] = lp.cpu(), h.cpu()
            if raw is not None:
                values[rows, :width] = shift_to_tokens(raw).cpu()
                end_values[rows] = raw.cpu()[torch.arange(len(rows)), batch.lengths[rows] - 1]
            if ref is not None:
                ref[rows, :width] = token_logprobs(self.models.reference(ids), ids, temps).cpu()
        return Scores(prox, values, end_values, ref, entropy)

    # ------------------------------------------------------------ optimise
    def _optimise(self, step: Step, *, train_policy: bool) -> dict[str, float]:
        """``ppo_epochs`` passes: the critic's updates, then the policy's (after the critic's
        warm-up); the loss terms' means over the epochs and the policy's last gradient norm.

        Update j of the critic trains on the j-th newest batch of its window (this step's first,
        cycling): with ``critic.replay`` > 1 it fits the last few policies' episodes, not only
        one noisy batch of returns, for the same compute."""
        lc, m = self.lc, self.models
        sums = dict.fromkeys(LOSS_TERMS, 0.0)
        grad_norm = 0.0
        if m.critic is not None:
            self.critic_window.append(step)
        for _ in range(lc.ppo_epochs):
            if m.critic is not None:
                for j in range(lc.critic.updates):
                    seen = self.critic_window[-1 - j % len(self.critic_window)]
                    terms, _ = self._micro_steps(m.critic, seen, self._critic_loss)
                    sums["value_loss"] += terms.get("value_loss", 0.0) / lc.critic.updates
            if train_policy or m.shared:  # a shared trunk still learns the value loss
                terms, grad_norm = self._micro_steps(
                    m.policy, step, lambda s, rows: self._policy_loss(s, rows, train_policy)
                )
                for key, value in terms.items():
                    sums[key] += value
        return {**{k: v / lc.ppo_epochs for k, v in sums.items()}, "grad_norm": grad_norm}

    @torch.no_grad()
    def _update_kl(self, step: Step) -> float:
        """Σ over this rank's action tokens of k3 = (r − 1) − log r, r = π_new/π_prox: how far the
        step moved the policy on its own batch (with one epoch PPO's approx_kl is 0 by
        construction, so only this says it). One no-grad policy pass."""
        b, m, total = step.batch, self.models, 0.0
        for rows in step.micro_batches:
            self.beat("measuring the update")
            ids, temps = b.inputs(rows, self.device)
            out = m.policy(ids)
            log_r = token_logprobs(out[0] if m.shared else out, ids, temps).cpu()
            log_r = log_r - b.take(step.scores.prox, rows)
            total += float(((log_r.exp() - 1) - log_r)[b.take(b.action_mask, rows)].double().sum())
        return total

    def _micro_steps(
        self,
        engine: Engine,
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
            self.beat("training")
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
        self, step: Step, rows: list[int], train_policy: bool
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Token-level PPO on the proximal policy (+ KL to a reference, + the shared critic's
        value loss); the loss and its terms."""
        lc, m, b = self.lc, self.models, step.batch
        ids, temps = b.inputs(rows, self.device)
        out = m.policy(ids)
        logits = out[0] if m.shared else out
        if lc.entropy_coef:  # the entropy's graph costs a [B, T, vocab] tensor: only when used
            lp, entropy = token_logprobs_and_entropy(logits, ids, temps)
        else:
            lp = token_logprobs(logits, ids, temps)
        take = lambda x: b.take(x, rows, self.device)  # noqa: E731
        mask = take(b.action_mask)
        loss, stats = ppo_policy_loss(
            lp,
            take(step.anchor),
            take(step.targets.advantages),
            take(step.weights),
            mask,
            clip_low=step.clip,
            clip_high=step.clip,
            denominator=step.denominator,
        )
        terms = {
            "policy_loss": float(loss.detach()),
            "clip_fraction": float(stats["clip_fraction"]),
            "approx_kl": float(stats["approx_kl"]),
        }
        if step.scores.ref is not None:
            kl = kl_penalty(lp, take(step.scores.ref), mask, denominator=step.denominator)
            loss = loss + lc.kl_coef * kl
        if lc.entropy_coef:
            loss = loss - lc.entropy_coef * entropy_bonus(
                entropy, mask, denominator=step.denominator
            )
        if m.shared:
            vl = value_loss(
                shift_to_tokens(out[1]),
                take(step.scores.values),
                take(step.targets.returns),
                mask,
                clip=lc.critic.value_clip,
                denominator=step.denominator,
            )
            terms["value_loss"] = float(vl.detach())
            loss = (loss if train_policy else loss * 0) + lc.critic.value_coef * vl
        return loss, terms

    def _critic_loss(self, step: Step, rows: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        b = step.batch
        ids, _ = b.inputs(rows, self.device)
        take = lambda x: b.take(x, rows, self.device)  # noqa: E731
        vl = value_loss(
            shift_to_tokens(self.models.critic(ids)),
            take(step.scores.values),
            take(step.targets.returns),
            take(b.action_mask),
            clip=self.lc.critic.value_clip,
            denominator=step.denominator,
        )
        return vl, {"value_loss": float(vl.detach())}

    def _zero_loss(self, engine: Engine) -> torch.Tensor:
        """A loss of exactly 0 from a one-token forward pass: keeps ranks in lockstep in collectives.

        A real forward, not a sum over parameters: under ZeRO-3 parameters exist only inside it.
        """
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        out = engine(ids)
        return sum(o.sum() for o in (out if isinstance(out, tuple) else (out,))) * 0.0

    # ---------------------------------------------------------- statistics
    def _statistics(
        self, step: Step, keeps: torch.Tensor, losses: dict[str, float]
    ) -> dict[str, float]:
        """Over the global batch (every rank contributes its sums): the losses, IcePop's kept
        fraction, the raw behavior weights π_prox/μ (before masking or truncation) and the
        critic's explained variance over the action tokens."""
        b, mask = step.batch, step.batch.action_mask
        ratios = torch.exp(torch.clamp(step.scores.prox - b.behavior_logprobs, -20, 20))[mask]
        local = {
            **{k: losses[k] for k in LOSS_TERMS},
            "kept": float(keeps.sum()),
            "weight_sum": float(ratios.double().sum()),
            "entropy_sum": float(step.scores.entropy[mask].double().sum()),
            "zero_advantage": float((step.targets.advantages[mask] == 0).sum()),
            **dict(
                zip(
                    VALUE_SUMS,
                    value_sums(step.targets.returns[mask], step.scores.values[mask]),
                    strict=True,
                )
            ),
        }
        g = dict(zip(local, self.reduce(list(local.values()), "sum"), strict=True))
        weight_max = float(ratios.max()) if ratios.numel() else 0.0
        return {
            **{k: g[k] for k in LOSS_TERMS},
            "icepop_kept_fraction": g["kept"] / step.denominator,
            "entropy": g["entropy_sum"] / step.denominator,
            "zero_advantage_fraction": g["zero_advantage"] / step.denominator,
            "importance_weight_mean": g["weight_sum"] / step.denominator,
            "importance_weight_max": self.reduce([weight_max], "max")[0],
            "explained_variance": (
                explained_variance([g[k] for k in VALUE_SUMS])
                if self.lc.algorithm == "ppo"
                else 0.0
            ),
            "grad_norm": losses["grad_norm"],
        }


def build_models(
    lc: LearnerConfig,
    path: str,
    dtype: torch.dtype,
    engine: Callable[[torch.nn.Module, float], Engine],
) -> Models:
    """The models ``lc`` asks for, each trainable one wrapped by ``engine(module, lr)``: the
    policy (with a value head under ``critic.kind: shared``), a separate critic under PPO with
    ``critic.kind: separate``, a frozen reference policy when ``kl_coef > 0``. Under ``lc.lora`` every
    trunk (the policy's, a separate critic's) trains adapters; value heads train fully."""
    shared = lc.algorithm == "ppo" and lc.critic.kind == "shared"
    policy = (PolicyWithValue if shared else Policy)(path, dtype, lc.lora)
    return Models(
        policy=engine(policy, lc.optimizer.lr),
        critic=(
            engine(Critic(path, dtype, lc.lora, lc.critic.init), lc.critic.lr)
            if lc.algorithm == "ppo" and not shared
            else None
        ),
        reference=(Policy(path, dtype).eval().requires_grad_(False) if lc.kl_coef > 0 else None),
        shared=shared,
    )
