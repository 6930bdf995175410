"""Tokens/s of TorchEngine against Hugging Face `generate` on the same random-init models.

Both sides sample every token with temperature 1, no top-k/top-p and no early stop, and both
end with per-token log-probs (HF's from `output_scores`), so they do the same work. Writes
engine.json to runs/bench/ or --out.

    python -m bench.engine [--quick] [--out docs/results/engine.json]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch

from actors.engines import SamplingParams, TorchEngine
from bench.record import SCRATCH, write_report
from common.model import build_tiny_model

MODELS = {
    "tiny": {"hidden_size": 64, "num_layers": 2},
    "h256-l4": {"hidden_size": 256, "num_layers": 4},
}
# different lengths, so the batch is left-padded as in real use
PROMPT_TEXTS = [f"What is {a} + {a + 10}? Think step by step. " * (1 + a % 3) for a in range(8)]


def hf_generate(engine: TorchEngine, prompts: list[list[int]], new_tokens: int) -> None:
    """`model.generate` on the same left-padded batch, then the sampled tokens' log-probs."""
    width = max(len(p) for p in prompts)
    pad = engine.tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = engine.model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad,
        output_scores=True,
        return_dict_in_generate=True,
    )
    scores = torch.stack(out.scores, dim=1).log_softmax(-1)
    scores.gather(-1, out.sequences[:, width:].unsqueeze(-1))


def measure(
    engine: TorchEngine, prompts: list[list[int]], new_tokens: int, repeats: int
) -> tuple[float, float]:
    """Best wall seconds of TorchEngine and of HF generate on the same batch.

    The two alternate within each round, so a busy shared CPU slows both alike.
    """
    params = SamplingParams(max_new_tokens=new_tokens, seed=0)
    runs = (
        lambda: engine.generate(prompts, params),
        lambda: hf_generate(engine, prompts, new_tokens),
    )
    best = [math.inf, math.inf]
    with torch.inference_mode():
        for round_ in range(repeats + 1):
            for i, run in enumerate(runs):
                start = time.perf_counter()
                run()
                if round_:  # round 0 is the warm-up
                    best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="16 new tokens, one timed round (default: 64 tokens, best of 5)",
    )
    parser.add_argument("--out", type=Path, default=SCRATCH / "engine.json")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    new_tokens, repeats = (16, 1) if args.quick else (64, 5)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, size in MODELS.items():
            path = build_tiny_model(Path(tmp) / name, **size)
            engine = TorchEngine(str(path))
            for batch in (1, 8):
                prompts = [
                    engine.tokenizer.encode(t, add_special_tokens=False)
                    for t in PROMPT_TEXTS[:batch]
                ]
                ours, theirs = measure(engine, prompts, new_tokens, repeats)
                row = {
                    "model": name,
                    **size,
                    "batch": batch,
                    "new_tokens": new_tokens,
                    "torch_engine_tokens_per_s": batch * new_tokens / ours,
                    "hf_generate_tokens_per_s": batch * new_tokens / theirs,
                    "speedup": theirs / ours,
                }
                rows.append(row)
                print(
                    f"{name:8s} batch {batch}: TorchEngine {row['torch_engine_tokens_per_s']:8.1f} tok/s"
                    f"  HF generate {row['hf_generate_tokens_per_s']:8.1f} tok/s"
                    f"  ratio {row['speedup']:.2f}x"
                )
    meta = {"quick": args.quick, "threads": args.threads}
    write_report(args.out, {"meta": meta, "results": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
