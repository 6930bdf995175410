"""One PPO step of the DeepSpeed learner against a plain torch loop doing the same math.

Both sides load the same policy and separate critic from the same checkpoint and train on the
same batch in the same micro-batches: the no-grad pass for log pi_prox and V, GAE targets
(`learner.data`), IcePop weights and the PPO and value losses (`learner.losses`), AdamW and
gradient clipping. The plain loop is the learner without DeepSpeed and without its bookkeeping,
so the time ratio is what those cost. Also tokens/s at two model sizes. Writes
docs/results/learner.json.

Times are the best of several rounds, by wall clock and by this process's CPU time. The ratio
uses CPU time: on a shared machine other processes inflate wall times by a varying factor, while
with one torch thread and an idle machine the two clocks agree.

    python bench/learner.py [--quick] [--out docs/results/learner.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path and its name would shadow the
# `learner` package: put the repository root in front of it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deepspeed
import numpy as np
import torch

from common.config import Config, load_config
from common.model import build_tiny_model
from common.trajectory import Segment
from learner import data
from learner.losses import clip_schedule, icepop, ppo_policy_loss, value_loss
from learner.models import Critic, Policy, shift_to_tokens, token_logprobs
from learner.trainer import Learner

MODELS = {
    "tiny": {"hidden_size": 64, "num_layers": 2},
    "h256-l4": {"hidden_size": 256, "num_layers": 4},
}
TARGET_RATIO = 1.15


def synthetic_batch(episodes: int, seed: int = 0) -> list[Segment]:
    """Multi-turn episodes of 1-2 segments: a prompt, then turns of action and tool output."""
    rng = np.random.default_rng(seed)
    batch = []
    for e in range(episodes):
        n_segments = int(rng.integers(1, 3))
        for k in range(n_segments):
            spans = [(0, int(rng.integers(20, 40)))]  # (is_action, length)
            for _ in range(int(rng.integers(2, 8))):
                spans += [(1, int(rng.integers(8, 24))), (0, int(rng.integers(4, 16)))]
            mask = np.concatenate([np.full(n, a, dtype="|u1") for a, n in spans[:-1]])
            rewards = np.zeros(len(mask), "<f4")
            last = k == n_segments - 1
            rewards[np.flatnonzero(mask)[-1]] = float(rng.integers(0, 2)) if last else 0.0
            batch.append(
                Segment(
                    traj_id=f"e{e}/{k}",
                    episode_id=f"e{e}",
                    segment=k,
                    actor_id="bench",
                    task="bench",
                    group_id=None,
                    permit=f"p{e}",
                    last=last,
                    terminated=last,
                    truncated=not last,
                    temperature=1.0,
                    top_p=1.0,
                    tokens=rng.integers(5, 400, len(mask)).astype("<i4"),
                    action_mask=mask,
                    behavior_logprobs=np.where(mask == 1, -6.0, 0.0).astype(
                        "<f4"
                    ),  # ~ log(1/448): near-uniform init
                    versions=np.where(mask == 1, 0, -1).astype("<i4"),
                    rewards=rewards,
                )
            )
    return batch


def inputs(segs: list[Segment]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    lens = [s.num_tokens for s in segs]
    ids = data.pad([torch.from_numpy(s.tokens.astype("int64")) for s in segs])
    return ids, data.pad([torch.ones(n, dtype=torch.long) for n in lens]), lens


class PlainStep:
    """The learner's PPO step (separate critic, one process) in plain torch."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        lc = cfg.learner
        self.policy = Policy(cfg.model.path, torch.float32)
        self.critic = Critic(cfg.model.path, torch.float32)
        self.policy_opt = torch.optim.AdamW(
            self.policy.parameters(), lr=lc.lr, weight_decay=lc.weight_decay
        )
        self.critic_opt = torch.optim.AdamW(
            self.critic.parameters(), lr=lc.critic_lr, weight_decay=lc.weight_decay
        )

    def __call__(self, batch: list[Segment]) -> None:
        lc, temperature = self.cfg.learner, self.cfg.actor.temperature
        segs = [s for ep in data.group_episodes(batch) for s in ep]
        mbs = data.micro_batches(segs, lc.micro_batch_tokens)
        n = len(segs)
        prox, values, end_values = [torch.empty(0)] * n, [torch.empty(0)] * n, [0.0] * n
        with torch.no_grad():  # log pi_prox and V before the update
            for idx in mbs:
                ids, attn, lens = inputs([segs[i] for i in idx])
                lp = token_logprobs(self.policy(ids, attn), ids, temperature)
                raw = self.critic(ids, attn)
                v = shift_to_tokens(raw)
                for j, i in enumerate(idx):
                    prox[i], values[i], end_values[i] = (
                        lp[j, : lens[j]],
                        v[j, : lens[j]],
                        float(raw[j, lens[j] - 1]),
                    )

        advs, rets = [], []  # GAE per segment, bootstrapped from the episode's next segment
        for i, seg in enumerate(segs):
            nxt = segs[i + 1] if i + 1 < n and segs[i + 1].episode_id == seg.episode_id else None
            next_value = (
                float(values[i + 1][data.turn_starts(torch.from_numpy(nxt.action_mask))[0]])
                if nxt
                else None
            )
            t = data.segment_targets(
                seg,
                values[i],
                end_values[i],
                next_value,
                gamma=lc.gamma,
                lam=lc.lam,
                critic_lam=lc.critic_lam,
                adaptive_alpha=lc.adaptive_lambda_alpha,
                max_segment_steps=self.cfg.learner.max_segment_steps,
            )
            advs.append(t.advantages)
            rets.append(t.returns)
        masks = [torch.from_numpy(s.action_mask.astype(bool)) for s in segs]
        weights = [
            torch.where(
                m,
                icepop(
                    p, torch.from_numpy(s.behavior_logprobs), low=lc.icepop_low, high=lc.icepop_high
                )[0],
                0.0,
            )
            for p, s, m in zip(prox, segs, masks, strict=True)
        ]
        denominator = max(float(sum(int(m.sum()) for m in masks)), 1.0)
        clip = clip_schedule(0, max(lc.total_steps, 1), start=lc.clip_start, end=lc.clip_end)

        def cat(xs: list[torch.Tensor], idx: list[int]) -> torch.Tensor:
            return data.pad([xs[i] for i in idx])

        def critic_loss(idx: list[int]) -> torch.Tensor:
            ids, attn, _ = inputs([segs[i] for i in idx])
            v = shift_to_tokens(self.critic(ids, attn))
            return value_loss(
                v,
                cat(values, idx),
                cat(rets, idx),
                cat(masks, idx),
                clip=lc.value_clip,
                denominator=denominator,
            )

        def policy_loss(idx: list[int]) -> torch.Tensor:
            ids, attn, _ = inputs([segs[i] for i in idx])
            lp = token_logprobs(self.policy(ids, attn), ids, temperature)
            return ppo_policy_loss(
                lp,
                cat(prox, idx),
                cat(advs, idx),
                cat(weights, idx),
                cat(masks, idx),
                clip_low=clip,
                clip_high=clip,
                denominator=denominator,
            )[0]

        for model, opt, loss_fn in (
            (self.critic, self.critic_opt, critic_loss),
            (self.policy, self.policy_opt, policy_loss),
        ):
            opt.zero_grad()
            for idx in mbs:  # gradient accumulation over micro-batches
                loss_fn(idx).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), lc.grad_clip)
            opt.step()


def max_param_diff(learner: Learner, plain: PlainStep) -> float:
    """Largest |difference| between the two policies' parameters (same math: ~float noise)."""
    ours = dict(learner.policy.module.named_parameters())
    return max(float((ours[name] - p).abs().max()) for name, p in plain.policy.named_parameters())


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def measure(
    learner: Learner, plain: PlainStep, batch: list[Segment], repeats: int
) -> tuple[dict[str, list[float]], float]:
    """Best step seconds per clock as [learner, plain], and the policies' difference after the
    first (warm-up) step. The two alternate within each round, so a busy CPU slows both alike."""
    runs = (lambda: learner.train_step(batch), lambda: plain(batch))
    best, diff = {clock: [math.inf, math.inf] for clock in CLOCKS}, math.nan
    for round_ in range(repeats + 1):
        for i, run in enumerate(runs):
            start = {clock: now() for clock, now in CLOCKS.items()}
            run()
            if round_:  # round 0 is the warm-up
                for clock, now in CLOCKS.items():
                    best[clock][i] = min(best[clock][i], now() - start[clock])
        if round_ == 0:
            diff = max_param_diff(learner, plain)
    return best, diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="8 episodes, best of 2 (default: 16 episodes, best of 5)",
    )
    parser.add_argument("--out", type=Path, default=Path("docs/results/learner.json"))
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--zero-stage", type=int, default=1, choices=range(4), help="DeepSpeed ZeRO stage"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    episodes, repeats = (8, 2) if args.quick else (16, 5)
    batch = synthetic_batch(episodes)
    tokens = sum(s.num_tokens for s in batch)
    action_tokens = sum(s.num_action_tokens for s in batch)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, size in MODELS.items():
            path = build_tiny_model(Path(tmp) / name, **size)
            cfg = load_config(
                None,
                [
                    f"model.path={path}",
                    f"run.out_dir={tmp}/run-{name}",
                    f"learner.zero_stage={args.zero_stage}",
                ],
            )
            Path(cfg.run.out_dir).mkdir()
            learner, plain = Learner(cfg), PlainStep(cfg)
            best, diff = measure(learner, plain, batch, repeats)
            (ours, theirs), (ours_cpu, theirs_cpu) = best["wall"], best["cpu"]
            learner.close()
            row = {
                "model": name,
                **size,
                "parameters": sum(p.numel() for p in plain.policy.parameters()),
                "segments": len(batch),
                "tokens": tokens,
                "action_tokens": action_tokens,
                "micro_batches": len(data.micro_batches(batch, cfg.learner.micro_batch_tokens)),
                "learner_step_s": ours,
                "plain_step_s": theirs,
                "learner_step_cpu_s": ours_cpu,
                "plain_step_cpu_s": theirs_cpu,
                "ratio": ours_cpu / theirs_cpu,
                "wall_ratio": ours / theirs,
                "learner_tokens_per_s": tokens / ours,
                "learner_tokens_per_cpu_s": tokens / ours_cpu,
                "plain_tokens_per_cpu_s": tokens / theirs_cpu,
                "learner_action_tokens_per_cpu_s": action_tokens / ours_cpu,
                "max_policy_param_diff_after_one_step": diff,
            }
            rows.append(row)
            print(
                f"{name:8s} learner {ours_cpu:.3f} CPU s ({row['learner_tokens_per_cpu_s']:7.1f} tok/s)"
                f"  plain {theirs_cpu:.3f} CPU s  ratio {row['ratio']:.3f}x (target <= {TARGET_RATIO},"
                f" wall {row['wall_ratio']:.3f}x)  policy diff {diff:.1e}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "quick": args.quick,
        "threads": args.threads,
        "zero_stage": args.zero_stage,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "machine": platform.machine(),
        "target_ratio": TARGET_RATIO,
    }
    args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
