"""Rollout throughput: the lockstep loop against continuous batching with prefix reuse.

The same episodes (fixed environment seeds, the same model) are played by
  (a) lockstep: the actor loop before continuous batching, ``permits_per_request`` (4) episodes
      generated as one batch turn by turn until the last ends, each turn re-encoding the context;
  (b) continuous: up to ``--inflight`` episodes at once, each at its own turn, a slot refilled
      the moment its episode ends, every turn a new request (whole context re-encoded);
  (c) continuous with prefix reuse (what the actor runs): an episode's KV cache survives its
      turns, so a turn encodes only its new tokens;
  (d) Hugging Face ``generate`` called per turn, lockstep like (a), log-probs from its scores;
on the 2–50 turn maze and on a single-turn task. Prints generated tokens/s, episodes/s and each
ratio to (a), and the model's FLOP-bound rate on this machine as the ceiling: a large fp32
matmul's FLOP/s divided by the forward FLOPs of one token at the run's mean context length, and
by the tokens that must pass through the model per sampled token (each context token once, as
(c) encodes them: on the maze most of them are observations, not samples).

A second part plays (c) while weights change every ``--swap-every`` engine steps, under both
``kv_on_weight_swap`` policies, and reports their throughput and how far each token's μ is from
log π of the version it is tagged with (a fresh forward of that version): what the learner's
IcePop ratio sees as engine mismatch.

    python -m bench.rollout [--quick] [--out docs/results/rollout.json]
"""

from __future__ import annotations

import argparse
import math
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.chat import ChatFormat
from actors.engines import Generation, SamplingParams, TorchEngine
from actors.engines.torch_engine import sampling_logprobs
from actors.envs import make_env
from actors.episode import Episode
from actors.play import Rollouts
from bench.record import SCRATCH, write_report
from common.model import load_exported_state_dict, state_dict_for_export
from deploy.warmup import warm_up

WORKLOADS = {
    "maze 2-50 turns": ("maze", {"max_turns": 50}),
    "single turn": ("digits", {}),
}
LOCKSTEP_BATCH = 4  # permits_per_request of the experiments before this change
TOTALS = (
    "seconds",
    "generated_tokens",
    "episodes",
    "turns",
    "segment_tokens",
    "segments",
    "engine_encoded_tokens",
    "kv_cache_peak_bytes",
)


def episodes(fmt: ChatFormat, env: str, kwargs: dict, n: int) -> list[Episode]:
    """n fresh episodes on fixed seeds: every variant plays the same instances."""
    return [
        Episode(
            make_env(env, **kwargs),
            fmt,
            seed=zlib.crc32(f"rollout-bench/{i}".encode()),
            permit=f"p{i}",
            actor_id="bench",
            group_id=None,
            max_turns=50,
            context_budget=512,
        )
        for i in range(n)
    ]


def lockstep(
    engine: TorchEngine, eps: list[Episode], generate: Callable[..., list[Generation]]
) -> int:
    """The old actor loop: batches of LOCKSTEP_BATCH, one `generate` per turn until all end."""
    rollouts = Rollouts(engine, temperature=1.0, top_p=1.0)
    tokens = 0
    for start in range(0, len(eps), LOCKSTEP_BATCH):
        batch = eps[start : start + LOCKSTEP_BATCH]
        while active := [e for e in batch if not e.done]:
            gens = generate([e.context for e in active], rollouts.params(active[0]))
            for ep, gen in zip(active, gens, strict=True):
                tokens += len(gen.token_ids)
                ep.step(gen)
    return tokens


def continuous(engine: TorchEngine, eps: list[Episode], inflight: int, reuse: bool) -> int:
    """Rollouts as the actor drives them: refill free slots, step, repeat."""
    rollouts = Rollouts(engine, temperature=1.0, top_p=1.0, reuse_prefix=reuse)
    waiting, tokens = list(eps), 0
    while waiting or len(rollouts):
        while waiting and len(rollouts) < inflight:
            rollouts.add(waiting.pop(0))
        for turn in rollouts.step():
            tokens += len(turn.generation.token_ids)
    return tokens


def hf_generate(engine: TorchEngine) -> Callable[..., list[Generation]]:
    """`model.generate` on a left-padded batch, stopping like the engine; log-probs from scores."""
    model, tok = engine.model, engine.tokenizer

    def generate(prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        width = max(len(p) for p in prompts)
        pad = tok.pad_token_id
        out = model.generate(
            input_ids=torch.tensor([[pad] * (width - len(p)) + p for p in prompts]),
            attention_mask=torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]),
            do_sample=True,
            temperature=params.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=params.stop_token_ids,
            stop_strings=params.stop or None,
            tokenizer=tok,
            pad_token_id=pad,
            output_scores=True,
            return_dict_in_generate=True,
        )
        new = out.sequences[:, width:]
        logp = torch.stack(out.scores, dim=1).log_softmax(-1).gather(-1, new.unsqueeze(-1))
        gens = []
        for row in range(len(prompts)):
            ids, lps = [], []
            for t, token in enumerate(new[row].tolist()):
                ids.append(token)
                lps.append(float(logp[row, t]))
                stop = token in params.stop_token_ids or any(
                    s in tok.decode(ids) for s in params.stop
                )
                if stop:
                    break
            reason = "stop" if stop else "length"
            gens.append(Generation(ids, lps, [0] * len(ids), reason, params.temperature, 1.0))
        return gens

    return generate


def flop_ceiling(engine: TorchEngine, mean_context: float) -> dict[str, float]:
    """Tokens/s if every forward FLOP ran at the speed of a large fp32 matmul on this machine."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    flops_per_s = 2 * 1024**3 / best
    cfg = engine.model.config
    params = sum(p.numel() for n, p in engine.model.named_parameters() if "embed" not in n)
    params += cfg.vocab_size * cfg.hidden_size  # the (tied) output projection is a matmul
    attention = 2 * 2 * cfg.num_hidden_layers * mean_context * cfg.hidden_size  # QK^T and AV
    per_token = 2 * params + attention
    return {
        "matmul_gflops": flops_per_s / 1e9,
        "forward_flops_per_token": per_token,
        "ceiling_tokens_per_s": flops_per_s / per_token,
    }


def timed(run: Callable[[], int], n_episodes: int) -> dict[str, float]:
    start = time.perf_counter()
    with torch.inference_mode():
        tokens = run()
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "episodes_per_s": n_episodes / seconds,
    }


def variants(inflight: int) -> dict[str, Callable[[TorchEngine, list[Episode]], int]]:
    """Each variant: the loop that plays episodes on an engine; it returns the tokens sampled."""
    return {
        "(a) lockstep x4": lambda engine, eps: lockstep(engine, eps, engine.generate),
        "(b) continuous": lambda engine, eps: continuous(engine, eps, inflight, reuse=False),
        "(c) continuous + prefix reuse": lambda engine, eps: continuous(
            engine, eps, inflight, reuse=True
        ),
        "(d) HF generate per turn x4": lambda engine, eps: lockstep(
            engine, eps, hf_generate(engine)
        ),
    }


def throughput(path: Path, n: dict[str, int], inflight: int, rounds: int) -> list[dict[str, Any]]:
    """Every variant plays the same episodes `rounds` times, in alternating order (a b c d,
    d c b a, ...) so that a machine that gets busier or quieter mid-run slows them alike."""
    rows = []
    for workload, (env, kwargs) in WORKLOADS.items():
        count = n[env]
        results: dict[str, dict[str, Any]] = {}
        order = list(variants(inflight).items())
        for round_ in range(rounds):
            for name, play in order if round_ % 2 == 0 else order[::-1]:
                engine = TorchEngine(str(path))  # a fresh KV buffer per play
                fmt = ChatFormat(engine.tokenizer)
                eps = episodes(fmt, env, kwargs, count)
                kv_peak = 0
                step = engine.step

                def sampled_step(step: Callable = step, engine: TorchEngine = engine) -> list:
                    nonlocal kv_peak
                    kv_peak = max(kv_peak, engine.kv_cache_bytes())
                    return step()

                engine.step = sampled_step
                run = timed(lambda play=play, engine=engine, eps=eps: play(engine, eps), count)
                total = results.setdefault(name, dict.fromkeys(TOTALS, 0))
                total["seconds"] += run["seconds"]
                total["generated_tokens"] += run["generated_tokens"]
                total["episodes"] += count
                total["turns"] += sum(e.turns for e in eps)
                total["segment_tokens"] += sum(len(s.tokens) for e in eps for s in e.segments)
                total["segments"] += sum(len(e.segments) for e in eps)
                total["engine_encoded_tokens"] += engine.encoded_tokens
                total["kv_cache_peak_bytes"] = max(total["kv_cache_peak_bytes"], kv_peak)
        for name, total in results.items():
            total.update(
                tokens_per_s=total["generated_tokens"] / total["seconds"],
                episodes_per_s=total["episodes"] / total["seconds"],
                mean_turns=total["turns"] / total["episodes"],
                mean_segment_tokens=total["segment_tokens"] / total["segments"],
                kv_bytes_per_episode=total["kv_cache_peak_bytes"]
                / (inflight if "continuous" in name else LOCKSTEP_BATCH),
            )
            if "HF" in name:  # generate's own cache: not counted
                total["engine_encoded_tokens"] = total["kv_cache_peak_bytes"] = None
                total["kv_bytes_per_episode"] = None
        base = results["(a) lockstep x4"]
        ceiling = flop_ceiling(
            TorchEngine(str(path)), np.mean([r["mean_segment_tokens"] for r in results.values()])
        )
        # every token of every context must pass through the model once, as (c) does: per
        # sampled token that is encoded/generated forwards, not one
        reuse = results["(c) continuous + prefix reuse"]
        per_sampled = reuse["engine_encoded_tokens"] / reuse["generated_tokens"]
        ceiling["encoded_tokens_per_sampled_token"] = per_sampled
        ceiling["ceiling_with_context_tokens_per_s"] = ceiling["ceiling_tokens_per_s"] / per_sampled
        for name, result in results.items():
            result["episodes_per_s_vs_a"] = result["episodes_per_s"] / base["episodes_per_s"]
            result["tokens_per_s_vs_a"] = result["tokens_per_s"] / base["tokens_per_s"]
            result["fraction_of_ceiling"] = result["tokens_per_s"] / ceiling["ceiling_tokens_per_s"]
            result["fraction_of_ceiling_with_context"] = (
                result["tokens_per_s"] / ceiling["ceiling_with_context_tokens_per_s"]
            )
            rows.append({"workload": workload, "variant": name, **result})
            print(
                f"{workload:16s} {name:30s} {result['tokens_per_s']:8.0f} tok/s "
                f"{result['episodes_per_s']:7.2f} ep/s  x{result['episodes_per_s_vs_a']:5.2f} vs (a)"
                f"  {100 * result['fraction_of_ceiling_with_context']:.1f}% of ceiling"
            )
        rows.append({"workload": workload, "variant": "FLOP ceiling", **ceiling})
        print(
            f"{workload:16s} FLOP ceiling {ceiling['ceiling_with_context_tokens_per_s']:.0f} "
            f"sampled tok/s (each context token encoded once: {per_sampled:.1f} forward tokens "
            f"per sampled token; {ceiling['ceiling_tokens_per_s']:.0f} if only sampled ones cost)"
        )
    return rows


def swap_policies(path: Path, n: int, inflight: int, swap_every: int) -> list[dict[str, Any]]:
    """(c) with a new version every `swap_every` steps, under each policy: throughput, and
    |log μ − log π_v| per action token against a fresh forward of the tagged version v."""
    base = TorchEngine(str(path)).model
    generator = torch.Generator().manual_seed(0)
    weights = [state_dict_for_export(base)]
    for _ in range(2):  # two further versions, each one AdamW-sized step (1e-3 per weight) away
        weights.append(
            {
                name: t + 1e-3 * torch.randn(t.shape, generator=generator).sign()
                for name, t in weights[-1].items()
            }
        )
    rows = []
    for policy in ("reencode", "keep"):
        engine = TorchEngine(str(path), on_swap=policy)
        fmt = ChatFormat(engine.tokenizer)
        eps = episodes(fmt, "maze", {"max_turns": 50}, n)
        step, steps = engine.step, [0]

        def swapping_step(
            step: Callable = step, engine: TorchEngine = engine, steps: list = steps
        ) -> list:
            steps[0] += 1
            if steps[0] % swap_every == 0:
                version = engine.version + 1
                engine.load_weights(version, weights[version % len(weights)])
            return step()

        engine.step = swapping_step
        result = timed(lambda eps=eps, engine=engine: continuous(engine, eps, inflight, True), n)
        result["versions"] = engine.version + 1
        result["mismatch"] = mismatch(engine, eps, weights)
        rows.append({"policy": policy, "swap_every_steps": swap_every, **result})
        print(
            f"swaps every {swap_every} steps, {policy:8s}: {result['tokens_per_s']:7.0f} tok/s, "
            f"|log mu - log pi_v| mean {result['mismatch']['mean_abs']:.2e} "
            f"max {result['mismatch']['max_abs']:.2e} "
            f"({100 * result['mismatch']['fraction_above_1e-3']:.1f}% of tokens above 1e-3)"
        )
    return rows


def mismatch(engine: TorchEngine, eps: list[Episode], weights: list[dict]) -> dict[str, float]:
    """Per action token of the first 16 episodes: |μ − log π_v(token | segment prefix)|, v the
    token's version, by one unpadded forward of each segment under each version's weights."""
    errors = []
    model = engine.model
    for ep in eps[:16]:
        for seg in ep.segments:
            tokens = torch.from_numpy(seg.tokens.astype(np.int64)).unsqueeze(0)
            actions = np.flatnonzero(seg.action_mask)
            for version in np.unique(seg.versions[actions]):
                load_exported_state_dict(model, weights[version % len(weights)])
                with torch.inference_mode():
                    logits = model(input_ids=tokens).logits[0, :-1]
                logp = sampling_logprobs(logits, seg.temperature, 1.0)
                mine = actions[seg.versions[actions] == version]
                expected = logp[mine - 1].gather(-1, tokens[0, mine].unsqueeze(-1)).squeeze(-1)
                errors.append(np.abs(seg.behavior_logprobs[mine] - expected.numpy()))
    err = np.concatenate(errors)
    return {
        "tokens": int(err.size),
        "mean_abs": float(err.mean()),
        "max_abs": float(err.max()),
        "fraction_above_1e-3": float((err > 1e-3).mean()),
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["throughput"] if "episodes_per_s" in r]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(11, 4))
    for ax, workload in zip(axes, workloads, strict=True):
        mine = [r for r in rows if r["workload"] == workload]
        ax.barh([r["variant"] for r in mine], [r["episodes_per_s"] for r in mine], color="C0")
        for i, r in enumerate(mine):
            ax.text(r["episodes_per_s"], i, f" x{r['episodes_per_s_vs_a']:.1f}", va="center")
        ax.invert_yaxis()
        ax.set_xlabel("episodes / s")
        ax.set_title(f"{workload} ({mine[0]['episodes']} episodes)")
    fig.suptitle(
        f"rollout throughput, tiny model, 1 thread, {report['meta']['inflight']} in flight"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="few episodes, one round (a smoke run)"
    )
    parser.add_argument("--model", help="model directory (default: deploy/warmup.py's)")
    parser.add_argument("--inflight", type=int, default=64, help="episodes in flight for (b), (c)")
    parser.add_argument("--swap-every", type=int, default=50, help="engine steps per version")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=2, help="plays of each variant, interleaved")
    parser.add_argument("--out", type=Path, default=SCRATCH / "rollout.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = {"maze": 8, "digits": 32} if args.quick else {"maze": 64, "digits": 256}
    rounds = 1 if args.quick else args.rounds
    # by default the maze experiments' starting model: it solves some mazes, so episodes end
    # anywhere from 2 to 50 turns (a random-init model plays every one to the budget)
    path = args.model or warm_up()  # built once at runs/models/tiny-maze-warm
    report = {
        "meta": {
            "quick": args.quick,
            "inflight": args.inflight,
            "threads": args.threads,
            "lockstep_batch": LOCKSTEP_BATCH,
            "rounds": rounds,
            "episodes_per_round": n,
            "model": args.model or "deploy/warmup.py's warm-started tiny model",
        },
        "throughput": throughput(path, n, args.inflight, rounds),
        "swap_policies": swap_policies(path, n["maze"], args.inflight, args.swap_every),
    }
    write_report(args.out, report)
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
