"""Rollouts inside the running system against the engine loop alone: where an actor's CPU goes.

Inside: a real ``asyncppo up`` in one of two configurations (``--preset``): ``maze``, issue 40's
(the maze with 2-50 turns, the random-init tiny model, ``broker.max_staleness: 4``,
``learner.batch_size: 4``), or ``demo`` (``configs/demo.yaml``: the chain, the warm tiny model,
η = 2, batch 32); 2 actors, the learner training all along, one torch thread per process, no
held-out evaluator. After a warm-up, over a window, the
actors' own Prometheus counters and their processes' CPU time give episodes and tokens per
actor CPU-second, the batch the engine ran (tokens / engine steps), forwards and encoded tokens
per generated token and the share re-encoded after weight swaps; the whole system's episodes/s.
With ``--profile`` py-spy samples actor 0's and the learner's on-CPU stacks over the window and
splits actor 0's CPU into engine prefill, decode and sampling, weights, episodes (environment,
chat template, segments), sending, waiting for permits and the background threads; the
learner's into receiving batches, scoring, the updates, records, publishing and checkpoints.

Alone, in the same run: the engine loop the actor runs (``bench.rollout``'s (c), continuous
batching with prefix reuse, one thread), CPU time over episodes of the same environment, model
and budgets, at the bench's 64 episodes in flight and at the batch the actors actually ran. The
two split the gap between the bench and the system into what admission's in-flight cap costs and
what the system adds.

``--baseline REV`` runs the same ``up`` from a git worktree of REV (e51bb82: the actor before
continuous batching; the maze preset, whose keys it reads) right after, the same window.

    python -m bench.insystem [--preset maze|demo] [--quick] [--profile] [--baseline e51bb82]
                             [--out docs/results/insystem_maze.json]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import torch
from prometheus_client.parser import text_string_to_metric_families

from actors.chat import ChatFormat
from actors.engines import TorchEngine
from actors.play import new_episode
from bench.experiments.runs import override_args, override_texts
from bench.record import SCRATCH, write_report
from bench.rollout import continuous
from common.config import Config, load_config
from common.lifecycle import spawn
from common.transport import free_port

ROOT = Path(__file__).resolve().parents[1]
PRESETS: dict[str, tuple[str | None, dict[str, Any]]] = {  # a config file, then overrides
    "maze": (  # issue 40's configuration, in keys every revision since e51bb82 reads
        None,
        {
            "model.path": str(ROOT / "runs" / "models" / "tiny"),
            "model.builtin": "tiny",
            "broker.max_staleness": 4,
            "actor.env": "maze",
            "actor.env_kwargs": {"max_turns": 50},
            "actor.max_turns": 50,
            "learner.batch_size": 4,
            "learner.total_steps": 1_000_000,
            "learner.zero_stage": 1,
        },
    ),
    "demo": (
        "configs/demo.yaml",
        {"learner.total_steps": 1_000_000, "eval.every_versions": 0, "learner.export_dir": None},
    ),
}
ACTORS = 2
ACTOR_COUNTERS = {  # Prometheus sample name -> field
    "asyncppo_actor_episodes_total": "episodes",
    "asyncppo_actor_tokens_generated_total": "tokens",
    "asyncppo_actor_engine_steps_total": "engine_steps",
    "asyncppo_actor_engine_forwards_total": "forwards",
    "asyncppo_actor_engine_encoded_tokens_total": "encoded_tokens",
    "asyncppo_actor_engine_reencoded_tokens_total": "reencoded_tokens",
    "asyncppo_actor_policy_version": "version",
}
# py-spy stacks of a role's main thread, first rule that matches a frame wins
ACTOR_CATEGORIES = (
    ("weights: verify and load", "Actor._load"),
    ("weights: other", "Actor.follow_versions"),
    ("permits", "Actor.request_permits"),
    ("engine: prefill", "TorchEngine._prefill"),
    ("engine: decode", "TorchEngine._decode"),
    ("engine: sampling", "TorchEngine._sample"),
    ("engine: other", "TorchEngine."),
    ("episodes: environment, chat template, segments", "Episode."),
    ("episodes: environment, chat template, segments", "EnvDriver.start"),
    ("sending segments", "Actor.absorb"),
    ("metrics", "prometheus_client"),
)
LEARNER_CATEGORIES = (
    ("batch: receive and check", "Trainer._get_batch"),
    ("step: score (pi_prox, V)", "TrainStep.score"),
    ("step: critic and policy updates", "TrainStep._optimise"),
    ("step: other", "TrainStep."),
    ("step: records", "Trainer._record"),
    ("step: records", "Trainer._batch_facts"),
    ("publish: export", "Trainer.export_weights"),
    ("publish: pack and hash", "pack_state_dict"),
    ("publish: other", "Trainer.publish"),
    ("checkpoint", "Trainer.save_checkpoint"),
    ("stop agreement", "Trainer._stop_agreed"),
)


def scrape(port: int) -> dict[str, float]:
    """The counters of one role's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def listener(port: int) -> psutil.Process:
    """The process serving ``port`` (a role's metrics endpoint)."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return psutil.Process(conn.pid)
    raise LookupError(f"no process listens on port {port}")


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def snapshot(actors: list[tuple[int, psutil.Process]], roles: dict[str, psutil.Process]) -> dict:
    """Every actor's counters and CPU time, every role's CPU time, now."""
    counters = [(scrape(port), proc) for port, proc in actors]  # one scrape per actor
    return {
        "t": time.monotonic(),
        "actors": [
            {field: scraped.get(name) for name, field in ACTOR_COUNTERS.items()}
            | {"cpu_s": cpu_seconds(proc)}
            for scraped, proc in counters
        ],
        "roles_cpu_s": {role: cpu_seconds(proc) for role, proc in roles.items()},
    }


def in_system(
    tree: Path, preset: str, label: str, window_s: float, warmup_s: float, profile: bool
) -> dict:
    """One ``asyncppo up`` from ``tree``: counters and CPU over ``window_s`` after warm-up."""
    run_dir = ROOT / "runs" / "bench" / "insystem" / f"{preset}-{label}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    endpoint, base = f"tcp://127.0.0.1:{free_port()}", free_port()
    config, overrides = PRESETS[preset]
    overrides = overrides | {
        "broker.bind": endpoint,
        "actor.broker": endpoint,
        "learner.broker": endpoint,
        "run.out_dir": str(run_dir),
        "run.max_wall_s": warmup_s + window_s + 60,
        "run.metrics_base_port": base,
    }
    cmd = [sys.executable, "-m", "deploy.cli", "up", "--actors", str(ACTORS)]
    cmd += ["--config", config] if config else []
    cmd += override_args(overrides)
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    with open(run_dir / "up.log", "wb") as log:
        proc = spawn(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            return measure(proc, base, run_dir, window_s, warmup_s, profile)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def measure(
    proc: subprocess.Popen,
    base: int,
    run_dir: Path,
    window_s: float,
    warmup_s: float,
    profile: bool,
) -> dict:
    ports = [base + 10 + i for i in range(ACTORS)]
    deadline = time.monotonic() + warmup_s
    while True:  # warm: every actor has finished an episode and the learner has stepped twice
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run did not warm up; see {run_dir / 'up.log'}")
        try:
            warm = all(scrape(p)["asyncppo_actor_episodes_total"] >= 1 for p in ports)
            warm = warm and scrape(base + 1)["asyncppo_learner_steps_total"] >= 2
        except (OSError, KeyError):
            warm = False
        if warm:
            break
        time.sleep(1)
    actors = [(port, listener(port)) for port in ports]
    roles = {"broker": listener(base), "learner": listener(base + 1)}
    roles |= {f"actor{i}": p for i, (_, p) in enumerate(actors)}
    steps0 = scrape(base + 1)["asyncppo_learner_steps_total"]
    spied = {
        "actor0": (actors[0][1], ACTOR_CATEGORIES),
        "learner": (roles["learner"], LEARNER_CATEGORIES),
    }
    spies = {
        role: subprocess.Popen(
            [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(proc.pid),
             "--rate", "100", "--duration", str(int(window_s)), "--format", "raw",
             "--nonblocking", "--output", str(run_dir / f"{role}.stacks")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for role, (proc, _) in (spied.items() if profile else ())
    }  # fmt: skip
    before = snapshot(actors, roles)
    time.sleep(window_s)
    after = snapshot(actors, roles)
    steps1 = scrape(base + 1)["asyncppo_learner_steps_total"]
    result = rates(before, after) | {"learner_steps_per_s": (steps1 - steps0) / window_s}
    for role, spy in spies.items():
        spy.wait(timeout=window_s + 60)
        result[f"{role}_cpu_breakdown"] = breakdown(run_dir / f"{role}.stacks", spied[role][1])
    return result


def delta(before: dict, after: dict, field: str) -> float | None:
    if before.get(field) is None or after.get(field) is None:
        return None  # a revision that does not export it
    return after[field] - before[field]


def rates(before: dict, after: dict) -> dict[str, Any]:
    """What the actors did per CPU-second of their own processes, and the system per second."""
    window = after["t"] - before["t"]
    total = {
        field: sum(delta(b, a, field) or 0 for b, a in zip(before["actors"], after["actors"], strict=True))
        for field in ("episodes", "tokens", "engine_steps", "forwards", "encoded_tokens",
                      "reencoded_tokens", "cpu_s")
    }  # fmt: skip
    counted = delta(before["actors"][0], after["actors"][0], "engine_steps") is not None
    per_token = (lambda n: n / total["tokens"]) if counted and total["tokens"] else lambda n: None
    return {
        "window_s": window,
        "episodes": total["episodes"],
        "tokens": total["tokens"],
        "actor_cpu_s": total["cpu_s"],
        "actor_cpu_utilisation": total["cpu_s"] / (window * len(before["actors"])),
        "episodes_per_actor_cpu_s": total["episodes"] / total["cpu_s"],
        "tokens_per_actor_cpu_s": total["tokens"] / total["cpu_s"],
        "system_episodes_per_s": total["episodes"] / window,
        "batch": total["tokens"] / total["engine_steps"] if counted else None,
        "forwards_per_token": per_token(total["forwards"]),
        "encoded_per_token": per_token(total["encoded_tokens"]),
        "reencoded_fraction": (
            total["reencoded_tokens"] / total["encoded_tokens"] if counted else None
        ),
        "versions_loaded": [
            delta(b, a, "version") for b, a in zip(before["actors"], after["actors"], strict=True)
        ],
        "roles_cpu_s": {
            role: after["roles_cpu_s"][role] - cpu for role, cpu in before["roles_cpu_s"].items()
        },
    }


def mean_rates(runs: list[dict]) -> dict[str, Any]:
    """Every number of a tree's runs as the mean over its rounds; the rounds themselves kept."""
    first = runs[0]
    mean = {
        key: sum(run[key] for run in runs) / len(runs)
        for key, value in first.items()
        if isinstance(value, int | float) and all(run.get(key) is not None for run in runs)
    }
    return {**first, **mean, "rounds": runs}


def breakdown(stacks: Path, categories: tuple[tuple[str, str], ...]) -> dict[str, float]:
    """Share of a role's on-CPU samples per category (py-spy's raw format: a stack, a count)."""
    shares: Counter[str] = Counter()
    for line in stacks.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():  # a line py-spy cut short
            continue
        frames = stack.split(";")
        if frames[0].startswith("_run_module_as_main"):
            category = next((name for name, pat in categories if pat in stack), "loop and other")
        else:  # a background thread, by the function its thread runs
            runs = [f for f in frames if not re.match(r"Thread\.|_bootstrap", f)]
            category = "thread: " + (runs[0].split(" (")[0] if runs else "?")
        shares[category] += int(count)
    total = sum(shares.values())
    return {name: n / total for name, n in shares.most_common()}


def preset_config(preset: str) -> Config:
    config, overrides = PRESETS[preset]
    return load_config(config, override_texts(overrides))


def alone(cfg: Config, n: int, inflight: int) -> dict[str, float]:
    """The actor's engine loop without the system: CPU time over ``n`` episodes of the actor's
    environment, model and budgets."""
    engine = TorchEngine(cfg.model.path)
    fmt = ChatFormat(engine.tokenizer)
    eps = [
        new_episode(cfg.actor, fmt, seed, permit=f"p{seed}", actor_id="alone", group_id=None)
        for seed in range(n)
    ]
    start = time.process_time()
    with torch.inference_mode():
        tokens = continuous(engine, eps, inflight, reuse=True)
    cpu = time.process_time() - start
    return {
        "inflight": inflight,
        "episodes_per_cpu_s": n / cpu,
        "tokens_per_cpu_s": tokens / cpu,
        "forwards_per_token": engine.forwards / tokens,
        "encoded_per_token": engine.encoded_tokens / tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="maze")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", action="store_true", help="py-spy actor 0 and the learner")
    parser.add_argument("--baseline", help="also run `up` from a worktree of this revision")
    parser.add_argument("--window", type=float, default=90.0)
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of each tree, alternating; rates averaged"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out = args.out or SCRATCH / f"insystem_{args.preset}.json"
    torch.set_num_threads(1)  # as the actors run
    window, warmup = (20.0, 120.0) if args.quick else (args.window, 240.0)
    preset = args.preset
    trees = {"this tree": ROOT}
    if args.baseline:
        trees[args.baseline] = ROOT / "runs" / "bench" / "insystem" / f"tree-{args.baseline}"
        if not trees[args.baseline].exists():
            subprocess.run(["git", "worktree", "add", "--detach", str(trees[args.baseline]),
                            args.baseline], check=True, cwd=ROOT)  # fmt: skip
    rounds: dict[str, list[dict]] = {label: [] for label in trees}
    for i in range(args.rounds):  # a b, b a, ...: a machine that drifts slows both alike
        for label, tree in list(trees.items())[:: 1 if i % 2 == 0 else -1]:
            profile = args.profile and label == "this tree" and i == 0
            name = "head" if label == "this tree" else label
            rounds[label].append(in_system(tree, preset, name, window, warmup, profile))
    systems = {label: mean_rates(runs) for label, runs in rounds.items()}
    batch = max(1, round(systems["this tree"]["batch"] or 1))
    n = 16 if args.quick else 48
    cfg = preset_config(preset)
    engine_alone = {f"inflight {k}": alone(cfg, n, k) for k in sorted({64, batch})}
    bench = engine_alone["inflight 64"]
    for label, system in systems.items():
        system["episodes_per_actor_cpu_s_vs_alone_64"] = (
            system["episodes_per_actor_cpu_s"] / bench["episodes_per_cpu_s"]
        )
        system["tokens_per_actor_cpu_s_vs_alone_64"] = (
            system["tokens_per_actor_cpu_s"] / bench["tokens_per_cpu_s"]
        )
        print(
            f"{label:12s} {system['tokens_per_actor_cpu_s']:7.0f} tok/actor-CPU-s "
            f"{system['episodes_per_actor_cpu_s']:.3f} ep/actor-CPU-s "
            f"(x{system['tokens_per_actor_cpu_s_vs_alone_64']:.2f} of the loop alone at 64), "
            f"system {system['system_episodes_per_s']:.3f} ep/s, actors "
            f"{100 * system['actor_cpu_utilisation']:.0f}% of a core, batch {system['batch']}"
        )
    for label, result in engine_alone.items():
        print(
            f"alone, {label:11s} {result['tokens_per_cpu_s']:7.0f} tok/CPU-s "
            f"{result['episodes_per_cpu_s']:.3f} ep/CPU-s, "
            f"{result['forwards_per_token']:.3f} forwards and {result['encoded_per_token']:.1f} "
            "encoded tokens per generated token"
        )
    if args.baseline:
        head, base = systems["this tree"], systems[args.baseline]
        for key in ("episodes_per_actor_cpu_s", "tokens_per_actor_cpu_s", "system_episodes_per_s"):
            head[f"{key}_vs_{args.baseline}"] = head[key] / base[key]
            print(f"{key}: this tree / {args.baseline} = x{head[key] / base[key]:.2f}")
    report = {
        "preset": preset,
        "config": {"file": PRESETS[preset][0], "overrides": PRESETS[preset][1]},
        "actors": ACTORS,
        "systems": systems,
        "alone": engine_alone,
    }
    write_report(out, report)
    plot(report, out.with_suffix(".png"))


def plot(report: dict, path: Path) -> None:
    """Tokens per actor CPU-second in the system and alone; where actor 0's CPU went."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems, alone_runs = report["systems"], report["alone"]
    profile = systems["this tree"].get("actor0_cpu_breakdown")
    fig, axes = plt.subplots(1, 2 if profile else 1, figsize=(12, 4.2), squeeze=False)
    labels = [f"up: {label}" for label in systems] + [f"alone, {k}" for k in alone_runs]
    values = [s["tokens_per_actor_cpu_s"] for s in systems.values()]
    values += [a["tokens_per_cpu_s"] for a in alone_runs.values()]
    axes[0][0].barh(labels[::-1], values[::-1])
    axes[0][0].set(xlabel="generated tokens per actor CPU-second",
                   title=f"{report['preset']}: in the system against the loop alone")  # fmt: skip
    if profile:
        top = dict(list(profile.items())[:10])
        axes[0][1].barh(list(top)[::-1], [100 * v for v in top.values()][::-1])
        axes[0][1].set(xlabel="% of actor 0's on-CPU samples (py-spy)", title="where it goes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
