"""LoRA against full fine-tuning of SmolLM2-135M-Instruct on CPU, measured in one run.

* weights: bytes published per version, and seconds to publish a version and for 1 and 4 real
  actors to fetch, verify and load it from a broker process (``bench/smollm2.py``'s push), for
  full weights (the baseline) and for the adapter;
* learner: seconds per real ``Learner.train_step`` (ZeRO-2, separate critic) and the learner
  process's peak resident memory, each configuration in a fresh process on the same arith
  segments, so one's peak cannot hide the other's;
* actor: an adapter merged into the weights (what ``TorchEngine.load_adapter`` does: seconds per
  version) against the same adapter run unmerged (peft's LoRA layers inside the engine's model):
  decode tokens/s of each, alternating rounds, and their log-prob gap.

Needs `make smollm2`. Writes lora.json to runs/bench/ or --out.

    python -m bench.lora [--quick] [--rank 16] [--out docs/results/lora.json]
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from actors.chat import ChatFormat
from actors.engines import SamplingParams, TorchEngine
from bench.record import SCRATCH
from bench.smollm2 import (
    CONFIG,
    arith_prompts,
    bench_learner,
    bench_push,
    play_arith,
    write_result,
)
from common.config import Config, load_config
from common.lora import adapter_tensors, factor_pairs, fingerprint
from common.transport import free_port
from learner.models import with_adapters

ROOT = Path(__file__).resolve().parents[1]


def config(rank: int, out_dir: str) -> Config:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    return load_config(
        CONFIG,
        [
            f"broker.bind={endpoint}",
            f"actor.broker={endpoint}",
            f"learner.broker={endpoint}",
            f"run.out_dir={out_dir}",
            f"learner.lora.rank={rank}",
        ],
    )


def learner_in_fresh_process(rank: int, segments: Path, steps: int, out_dir: str) -> dict:
    """``bench_learner`` in a child process; its row plus the child's peak RSS."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.lora",
            "--learner-child",
            str(rank),
            str(segments),
            str(steps),
            out_dir,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def learner_child(rank: int, segments: Path, steps: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    cfg = config(rank, out_dir)
    row = bench_learner(cfg, pickle.loads(segments.read_bytes()), steps)
    row["lora_rank"] = rank
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(row))


def random_adapter(model_path: str, rank: int) -> dict[str, torch.Tensor]:
    """A rank-``rank`` adapter on every linear layer of the trunk, B not zero (as after training)."""
    from transformers import AutoModelForCausalLM

    cfg = Config()
    cfg.learner.lora.rank, cfg.learner.lora.alpha = rank, float(rank)
    model = with_adapters(
        AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True), cfg.learner.lora
    )
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return adapter_tensors(model.state_dict(), 1.0)


def unmerged(engine: TorchEngine, tensors: dict[str, torch.Tensor]) -> None:
    """peft's LoRA layers injected into the engine's model, holding the adapter's factors."""
    from peft import LoraConfig, inject_adapter_in_model

    pairs = factor_pairs(tensors)
    rank = next(iter(pairs.values()))[0].shape[0]
    modules = sorted({w.removesuffix(".weight").rpartition(".")[2] for w in pairs})
    inject_adapter_in_model(
        LoraConfig(r=rank, lora_alpha=rank, target_modules=modules), engine.model
    )
    state = {}
    for weight, (a, b) in pairs.items():
        module = weight.removesuffix(".weight")
        state[f"{module}.lora_A.default.weight"] = a
        state[f"{module}.lora_B.default.weight"] = b
    missing = set(state) - set(engine.model.state_dict())
    assert not missing, sorted(missing)[:3]
    engine.model.load_state_dict(state, strict=False)
    engine.model.requires_grad_(False)


def forward_gap(a: TorchEngine, b: TorchEngine, tokens: list[int]) -> float:
    """Largest |log-prob difference| of the two engines' models over one sequence's vocabulary."""
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        la, lb = (e.model(input_ids=ids).logits.float().log_softmax(-1) for e in (a, b))
    return float((la - lb).abs().max())


def bench_actor(model_path: str, rank: int, new_tokens: int, repeats: int) -> dict:
    """Merge seconds, and decode tokens/s merged vs unmerged on 8 arith prompts."""
    tensors = random_adapter(model_path, rank)
    merged_engine, unmerged_engine = TorchEngine(model_path), TorchEngine(model_path)
    t0 = time.perf_counter()
    base = fingerprint(merged_engine.model)
    fingerprint_s = time.perf_counter() - t0
    merge_s = math.inf
    for version in range(1, 4):  # the first merge also copies the base of the adapted weights
        t0 = time.perf_counter()
        merged_engine.load_adapter(version, tensors, base)
        merge_s = min(merge_s, time.perf_counter() - t0)
    unmerged(unmerged_engine, tensors)
    prompts = arith_prompts(ChatFormat(merged_engine.tokenizer), 8)
    params = SamplingParams(max_new_tokens=new_tokens, seed=0)
    best = {"merged": math.inf, "unmerged": math.inf}
    gens: dict[str, list] = {}
    with torch.inference_mode():
        for round_ in range(repeats + 1):
            for name, engine in (("merged", merged_engine), ("unmerged", unmerged_engine)):
                t0 = time.perf_counter()
                gens[name] = engine.generate(prompts, params)
                if round_:
                    best[name] = min(best[name], time.perf_counter() - t0)
    gap = forward_gap(merged_engine, unmerged_engine, prompts[0] + gens["merged"][0].token_ids)
    tokens = len(prompts) * new_tokens
    row = {
        "rank": rank,
        "batch": len(prompts),
        "new_tokens": new_tokens,
        "fingerprint_seconds": fingerprint_s,
        "merge_seconds": merge_s,
        "merged_tokens_per_s": tokens / best["merged"],
        "unmerged_tokens_per_s": tokens / best["unmerged"],
        "merged_over_unmerged": best["unmerged"] / best["merged"],
        "logprob_gap_max": gap,  # merged vs unmerged model, one forward: the same function
    }
    print(
        f"actor: merge {merge_s:.3f} s/version (fingerprint once {fingerprint_s:.2f} s); decode "
        f"merged {row['merged_tokens_per_s']:.1f} tok/s, unmerged "
        f"{row['unmerged_tokens_per_s']:.1f} tok/s ({row['merged_over_unmerged']:.2f}x)"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 learner step, 1 round, 16 tokens")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=SCRATCH / "lora.json")
    parser.add_argument("--learner-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.learner_child:
        rank, segments, steps, out_dir = args.learner_child
        learner_child(int(rank), Path(segments), int(steps), out_dir)
        return
    torch.set_num_threads(args.threads)
    steps, repeats, new_tokens = (1, 1, 16) if args.quick else (2, 3, 32)
    out_dir = "runs/bench-lora"
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    full, lora = config(0, out_dir), config(args.rank, out_dir)

    actor = bench_actor(full.model.path, args.rank, new_tokens, repeats)
    with tempfile.NamedTemporaryFile(suffix=".pkl") as f:
        f.write(pickle.dumps(play_arith(full, full.learner.batch_size)))
        f.flush()
        learner = [
            learner_in_fresh_process(rank, Path(f.name), steps, out_dir) for rank in (0, args.rank)
        ]
    for row in learner:
        print(f"learner rank {row['lora_rank']}: peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB")
    push = {"full": bench_push(full, (1, 4)), "lora": bench_push(lora, (1, 4))}
    ratios = {
        "bytes_full_over_lora": push["full"][0]["bytes"] / push["lora"][0]["bytes"],
        "push_4_actors_full_over_lora": push["full"][1]["total_seconds"]
        / push["lora"][1]["total_seconds"],
        "step_seconds_full_over_lora": learner[0]["step_seconds"] / learner[1]["step_seconds"],
        "peak_rss_full_over_lora": learner[0]["peak_rss_bytes"] / learner[1]["peak_rss_bytes"],
    }
    print("ratios (full / LoRA):", {k: round(v, 2) for k, v in ratios.items()})
    write_result(
        args,
        ratios=ratios,
        weight_push=push,
        learner=learner,
        actor=actor,
    )


if __name__ == "__main__":
    main()
