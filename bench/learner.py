"""One PPO step of the DeepSpeed learner against the same step on plain torch modules.

Both sides run the learner's real step (`learner.step.TrainStep`: the no-grad pass for log pi_prox
and V, GAE targets, IcePop weights, the PPO and value losses) on the same batch in the same
micro-batches, with models loaded from the same checkpoint. The learner wraps them in DeepSpeed
engines (ZeRO, its optimizer wrapper, gradient clipping) and adds its own bookkeeping (episode
split, statistics' all-reduce, the step record); the baseline is a plain torch loop: the modules
themselves, `loss.backward()`, `clip_grad_norm_` and `torch.optim.AdamW`. The time ratio is what
DeepSpeed and the learner's bookkeeping cost. Also tokens/s at two model sizes. Writes
docs/results/learner.json.

Times are the best of several rounds, by wall clock and by this process's CPU time. The ratio
uses CPU time: on a shared machine other processes inflate wall times by a varying factor, while
with one torch thread and an idle machine the two clocks agree.

    python -m bench.learner [--quick] [--out docs/results/learner.json]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import deepspeed
import numpy as np
import torch

from bench.record import SCRATCH, write_report
from common.config import Config, LearnerConfig, load_config
from common.model import build_tiny_model
from common.trajectory import Segment
from learner.batch import Batch, group_episodes
from learner.step import TrainStep, build_models
from learner.trainer import Learner
from testkit.segments import make_segment

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
            layout = "".join(("a" if act else "o") * n for act, n in spans[:-1])
            last = k == n_segments - 1
            reward = float(rng.integers(0, 2)) if last else 0.0
            batch.append(
                make_segment(
                    layout,
                    episode_id=f"e{e}",
                    index=k,
                    actor_id="bench",
                    last=last,
                    rewards={layout.rindex("a"): reward},
                    seed=int(rng.integers(1 << 31)),
                )
            )
    return batch


class PlainEngine:
    """A torch module trained by a plain loop, with the members ``TrainStep`` uses of a
    DeepSpeed engine: accumulate ``backward`` calls, then clip, step AdamW and zero the grads."""

    def __init__(self, module: torch.nn.Module, lr: float, lc: LearnerConfig):
        self.module, self.grad_clip = module, lc.optimizer.grad_clip
        self.opt = torch.optim.AdamW(
            module.parameters(), lr=lr, weight_decay=lc.optimizer.weight_decay
        )
        self.norm = 0.0

    def __call__(self, input_ids: torch.Tensor) -> Any:
        return self.module(input_ids)

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        pass

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        loss.backward()

    def step(self) -> None:
        self.norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip))
        self.opt.step()
        self.opt.zero_grad()

    def get_global_grad_norm(self) -> float:
        return self.norm


def plain_step(cfg: Config) -> Callable[[list[Segment]], Any]:
    """The baseline: ``TrainStep`` on plain engines, one process, the batch as one rank's rows."""
    lc = cfg.learner
    torch.manual_seed(lc.seed)  # the same initial value heads as the learner's
    models = build_models(
        lc, cfg.model.path, torch.float32, lambda module, lr: PlainEngine(module, lr, lc)
    )
    step = TrainStep(lc, models, device="cpu")

    def run(batch: list[Segment]) -> Any:
        episodes = group_episodes(batch)
        return step(Batch.of([s for ep in episodes for s in ep]), episodes, 0)

    run.policy = models.policy.module  # type: ignore[attr-defined]
    return run


def max_param_diff(learner: Learner, plain: Callable) -> float:
    """Largest |difference| between the two policies' parameters (same math: ~float noise)."""
    ours = dict(learner.policy.module.named_parameters())
    return max(float((ours[name] - p).abs().max()) for name, p in plain.policy.named_parameters())


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def measure(
    learner: Learner, plain: Callable, batch: list[Segment], repeats: int
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
    parser.add_argument("--out", type=Path, default=SCRATCH / "learner.json")
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
            learner, plain = Learner(cfg), plain_step(cfg)
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
                "micro_batches": len(Batch.of(batch).micro_batches(cfg.learner.micro_batch_tokens)),
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
    meta = {
        "quick": args.quick,
        "threads": args.threads,
        "zero_stage": args.zero_stage,
        "target_ratio": TARGET_RATIO,
    }
    write_report(args.out, {"meta": meta, "results": rows}, deepspeed=deepspeed.__version__)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
