"""Weights in the running system: the real roles on hosts of their own, chain against star.

``bench.weights`` moves synthetic versions with the roles' weight path alone. This runs the roles
themselves: a broker, a learner training SmolLM2-135M-Instruct (configs/smollm2-arith.yaml) and
N actors playing on it, each in its own network namespace behind a rate-limited cable
(``bench.weights.Network``), the actors' engines in bf16, so the learner publishes bf16 (about
270 MB a version). Per version published after every actor is up, from the roles' JSON logs: the
seconds from the learner's PUBLISH until each actor has loaded it, its transfer, and how long
each actor's rollouts were held for it. The same run measures ``broker.weights_fanout: star``
(every actor from the learner's one link: the cost of the old broker fan-out) after ``chain``.

    python -m bench.weights_system [--actors 4] [--rate 1000mbit] [--steps 6] [--out docs/results]

Needs root and ``make smollm2``. Writes weights_system.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.record import SCRATCH, write_report
from bench.weights import PORT, ROOT, Network, address, kill_all

CONFIG = "configs/smollm2-arith.yaml"
MODEL = "runs/models/smollm2-135m-instruct"


def events(log: Path, name: str) -> list[dict]:
    """The JSON log lines of ``log`` whose event is ``name``, each with its time in seconds."""
    found = []
    for line in log.read_text().splitlines() if log.exists() else []:
        if line.startswith("{") and f'"{name}"' in line:
            row = json.loads(line)
            if row.get("event") == name:
                found.append(row | {"t": datetime.fromisoformat(row["timestamp"]).timestamp()})
    return found


def per_version(published: list[dict], loads: list[list[dict]]) -> list[dict[str, Any]]:
    """Per version published once every actor had loaded one (the first waits for the actors to
    start): the seconds until each actor had loaded it or a newer one (a newer one may overtake a
    slow fetch), that load's transfer and how long it held the actor's rollouts."""
    up = max(min(e["version"] for e in mine) for mine in loads)
    versions = []
    for pub in sorted(published, key=lambda e: e["version"]):
        v = pub["version"]
        got = [next((e for e in mine if e["version"] >= v), None) for mine in loads]
        if v <= up or None in got:
            continue  # published before every actor was up, or after the run ended
        versions.append({
            "version": v,
            "bytes": pub["bytes"],
            "seconds_to_each": sorted(g["t"] - pub["t"] for g in got),
            "skipped_by": sum(g["version"] > v for g in got),
            "transfer_s": [g["transfer_s"] for g in got],
            "rollouts_held_s": [g["rollouts_held_s"] for g in got],
        })  # fmt: skip
    return versions


def run(net: Network, logs: Path, design: str, n: int, steps: int) -> dict[str, Any]:
    """One training run of ``steps`` steps under ``design``; per version, when each actor had it
    (or a newer one)."""
    broker_at = f"tcp://{address(0)}:{PORT}"
    common = ["--config", CONFIG, "--set", f"model.path={MODEL}", "--set", "run.log_format=json",
              "--set", f"run.out_dir={logs / design}", "--set", "actor.engine_dtype=bfloat16",
              "--set", "broker.heartbeat_timeout_s=120", "--set", f"run.num_actors={n}"]  # fmt: skip
    procs = {
        "broker": net.start("broker", ["-m", "deploy.cli", "broker", *common, "--set",
                                       f"broker.bind={broker_at}", "--set",
                                       f"broker.weights_fanout={design}"],
                            logs / f"{design}-broker.log"),
    }  # fmt: skip
    try:
        time.sleep(2.0)
        for i in range(n):
            procs[f"a{i}"] = net.start(
                f"a{i}",
                ["-m", "deploy.cli", "actor", *common, "--set", f"actor.broker={broker_at}",
                 "--set", f"actor.id=a{i}"],
                logs / f"{design}-a{i}.log",
            )  # fmt: skip
        learner_log = logs / f"{design}-learner.log"
        procs["learner"] = net.start(
            "learner",
            ["-m", "deploy.cli", "learner", *common, "--set", f"learner.broker={broker_at}",
             "--set", f"learner.total_steps={steps}", "--set", "learner.checkpoint_every=0"],
            learner_log,
        )  # fmt: skip
        if procs["learner"].wait(timeout=1800):
            raise RuntimeError(f"the learner failed: see {learner_log}")
        time.sleep(10.0)  # the last version reaches every actor
    finally:
        kill_all(procs.values())
    published = events(learner_log, "published weights")
    versions = per_version(published, [events(logs / f"{design}-a{i}.log", "weights loaded")
                                       for i in range(n)])  # fmt: skip
    if not versions:
        raise RuntimeError(f"no version reached every actor: see {logs}")
    row = {
        "design": design,
        "actors": n,
        "versions": versions,
        "bytes": versions[0]["bytes"],
        "seconds_all_median": statistics.median(v["seconds_to_each"][-1] for v in versions),
        "seconds_first_median": statistics.median(v["seconds_to_each"][0] for v in versions),
        "rollouts_held_s_mean": statistics.mean(x for v in versions for x in v["rollouts_held_s"]),
    }
    print(f"{design:5s} N={n}: {len(versions)} versions of {row['bytes'] / 1e6:.0f} MB, all "
          f"actors loaded in {row['seconds_all_median']:.2f} s (median; the first "
          f"{row['seconds_first_median']:.2f} s), rollouts held {row['rollouts_held_s_mean']:.2f} s "
          "per actor and version", flush=True)  # fmt: skip
    return row


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, row in enumerate(report["runs"]):
        every = [s for v in row["versions"] for s in v["seconds_to_each"]]
        last = [v["seconds_to_each"][-1] for v in row["versions"]]
        ax.scatter([i] * len(every), every, alpha=0.4, label="each actor" if i == 0 else None)
        ax.scatter([i] * len(last), last, marker="x", color="k",
                   label="the last actor" if i == 0 else None)  # fmt: skip
    ax.set_xticks(range(len(report["runs"])),
                  [f"{r['design']}, {r['actors']} actors" for r in report["runs"]])  # fmt: skip
    ax.set(ylabel="seconds from PUBLISH to loaded", ylim=(0, None),
           title=f"SmolLM2 bf16 versions in a training run, every link {report['rate']}")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actors", type=int, default=4)
    parser.add_argument("--rate", default="1000mbit", help="every cable's rate, both ways (tc)")
    parser.add_argument("--steps", type=int, default=6, help="learner steps (versions) a run")
    parser.add_argument("--out", type=Path, default=SCRATCH)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench.weights_system needs root: it builds network namespaces")
    if not (ROOT / MODEL / "config.json").exists():
        sys.exit(f"{MODEL} is missing: run `make smollm2` first")
    logs = ROOT / "runs" / "bench-weights-system"
    logs.mkdir(parents=True, exist_ok=True)
    net = Network(["broker", "learner", *(f"a{i}" for i in range(args.actors))], args.rate, "ws")
    report: dict[str, Any] = {
        "benchmark": "weights_system",
        "config": CONFIG,
        "rate": args.rate,
        "notes": [
            "Real roles (broker, learner, actors) each in a network namespace with one veth cable "
            "to a bridge, limited by tc tbf to the rate both ways; all share this machine's cores.",
            "seconds_to_each: from the learner's 'published weights' log line to each actor's "
            "'weights loaded' (every chunk and tensor sha256-checked, loaded into the engine).",
            "star = every actor from the learner's one link (the old broker fan-out's cost).",
        ],
        "runs": [],
    }
    try:
        net.build()
        for design in ("chain", "star"):
            report["runs"].append(run(net, logs, design, args.actors, args.steps))
    finally:
        net.remove()
    chain, star = report["runs"]
    report["star_over_chain"] = star["seconds_all_median"] / chain["seconds_all_median"]
    print(f"star / chain, all actors loaded: x{report['star_over_chain']:.2f}")
    write_report(args.out / "weights_system.json", report)
    plot(report, args.out / "weights_system.png")


if __name__ == "__main__":
    main()
