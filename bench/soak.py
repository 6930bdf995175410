"""Soak run: one `asyncppo up` for a long time, sampling every role's memory and the throughput.

Leaks and slowdowns that a minute-long test cannot see show up as a resident set that keeps
growing, or a trained-tokens rate that sinks, over an hour.

    python -m bench.soak                                    # 60 minutes of configs/demo.yaml
    python -m bench.soak --minutes 2 --out /tmp/soak.json   # a smoke version (tests/test_soak.py)

Every ``--interval`` seconds it records, per role (broker, learner, each actor, named as the
launcher names them): the resident set size of the role's process tree (psutil, the role and its
children); and for the whole system: learner steps, tokens trained (learner_steps.jsonl),
segments accepted by the broker and policy version (broker STATS). Rates are differences of two
samples over their time apart. The summary compares each role's RSS at the first sample after
``--warmup-fraction`` of the run with the last one, and averages rates over the same span.
Writes JSON (``--out``) and a PNG beside it (RSS and throughput against time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from bench.record import SCRATCH, write_report
from common.config import load_config
from common.lifecycle import spawn
from common.transport import Client, Endpoint, TransportError

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def role_processes(up: psutil.Process) -> dict[str, psutil.Process]:
    """The roles `up` started, by the name the launcher gives each (ASYNCPPO_ACTOR_ID)."""
    roles = {}
    for child in up.children():
        try:
            roles[child.environ()["ASYNCPPO_ACTOR_ID"]] = child
        except (psutil.Error, KeyError):  # gone, or not a role
            continue
    return roles


def tree_rss(proc: psutil.Process) -> int:
    """Resident bytes of a process and all its descendants (0 once it is gone)."""
    total = 0
    try:
        tree = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in tree:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


class StepLog:
    """Reads learner_steps.jsonl as it grows; keeps running totals, never the whole log."""

    def __init__(self, path: Path):
        self.path, self.offset, self.steps, self.tokens = path, 0, 0, 0

    def update(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line being written waits for the next read
        self.offset += len(complete)
        for line in complete.splitlines():
            self.steps += 1
            self.tokens += json.loads(line)["tokens"]


def rate(samples: list[dict], key: str) -> float:
    """Per second between the last two samples."""
    if len(samples) < 2:
        return 0.0
    a, b = samples[-2], samples[-1]
    return (b[key] - a[key]) / max(b["t"] - a["t"], 1e-9)


def summarize(samples: list[dict], warmup_fraction: float) -> dict[str, Any]:
    """Per role RSS after warm-up and at the end; mean rates over the same span."""
    end = samples[-1]
    start = next(s for s in samples if s["t"] >= warmup_fraction * end["t"])
    span = max(end["t"] - start["t"], 1e-9)
    roles = {}
    for role in sorted({r for s in samples for r in s["rss_bytes"]}):
        series = [s["rss_bytes"][role] for s in samples if role in s["rss_bytes"]]
        first, last = start["rss_bytes"].get(role), end["rss_bytes"].get(role)
        roles[role] = {
            "rss_max_bytes": max(series),
            "rss_after_warmup_bytes": first,
            "rss_last_bytes": last,
            "rss_growth_bytes": last - first if first is not None and last is not None else None,
        }
    return {
        "window_s": [start["t"], end["t"]],
        "roles": roles,
        "tokens_per_s": (end["tokens_trained"] - start["tokens_trained"]) / span,
        "accepted_per_s": (end["accepted"] - start["accepted"]) / span,
        "steps_per_min": 60 * (end["learner_steps"] - start["learner_steps"]) / span,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    minutes = [s["t"] / 60 for s in samples]
    fig, (mem, thr) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for role in report["summary"]["roles"]:
        pts = [
            (m, s["rss_bytes"][role] / MiB)
            for m, s in zip(minutes, samples, strict=True)
            if role in s["rss_bytes"]
        ]
        mem.plot(*zip(*pts, strict=True), label=role)
    mem.set_ylabel("RSS of process tree (MiB)")
    mem.legend(fontsize=8, ncol=3)
    mem.set_title(f"asyncppo soak: {report['minutes']} min of {report['config']}")
    thr.plot(minutes, [s["tokens_per_s"] for s in samples], label="trained tokens/s (learner)")
    thr.set_ylabel("tokens / s")
    acc = thr.twinx()
    acc.plot(
        minutes,
        [s["accepted_per_s"] for s in samples],
        color="tab:orange",
        label="accepted segments/s",
    )
    acc.set_ylabel("segments / s")
    thr.set_xlabel("minutes")
    lines = thr.get_lines() + acc.get_lines()
    thr.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def soak(args: argparse.Namespace) -> dict[str, Any]:
    cfg = load_config(args.config, args.overrides)
    run_dir = Path(cfg.run.out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "learner_steps.jsonl").unlink(missing_ok=True)  # a fresh log: totals start at 0
    overrides = [*args.overrides, "learner.total_steps=0", "run.max_wall_s=0"]
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "up",
        "--config",
        args.config,
        *(a for o in overrides for a in ("--set", o)),
    ]
    with open(run_dir / "soak-up.log", "wb") as log:
        up = spawn(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    client = Client(
        Endpoint(cfg.security, cfg.broker.max_message_bytes),
        cfg.learner.broker,
        "soak",
        timeout_s=5.0,
    )
    steps, samples, t0 = StepLog(run_dir / "learner_steps.jsonl"), [], time.monotonic()
    stats: dict[str, Any] = {}
    try:
        while (now := time.monotonic() - t0) < 60 * args.minutes:
            if up.poll() is not None:
                raise RuntimeError(
                    f"asyncppo up exited with {up.returncode}; see {run_dir / 'soak-up.log'}"
                )
            steps.update()
            with contextlib.suppress(TransportError):  # not up yet: keep the last answer
                stats = client.request("STATS").header["stats"]
            samples.append(
                {
                    "t": round(now, 2),
                    "rss_bytes": {
                        name: tree_rss(p)
                        for name, p in role_processes(psutil.Process(up.pid)).items()
                    },
                    "learner_steps": steps.steps,
                    "tokens_trained": steps.tokens,
                    "accepted": stats.get("accepted", 0),
                    "policy_version": stats.get("policy_version", -1),
                }
            )
            samples[-1]["tokens_per_s"] = rate(samples, "tokens_trained")
            samples[-1]["accepted_per_s"] = rate(samples, "accepted")
            print(
                f"[soak] {now / 60:6.1f} min | steps {steps.steps} | {samples[-1]['tokens_per_s']:.0f} tok/s | "
                + " ".join(
                    f"{r} {b / MiB:.0f}MiB" for r, b in sorted(samples[-1]["rss_bytes"].items())
                ),
                flush=True,
            )
            time.sleep(args.interval)
    finally:
        client.close()
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
    return {
        "config": args.config,
        "overrides": args.overrides,
        "minutes": args.minutes,
        "interval_s": args.interval,
        "final_stats": {k: v for k, v in stats.items() if not isinstance(v, dict)},
        "summary": summarize(samples, args.warmup_fraction),
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=60.0, help="how long to run (default 60)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    p.add_argument(
        "--warmup-fraction",
        type=float,
        default=0.25,
        help="the summary starts after this fraction of the run (start-up and first weights)",
    )
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override passed to `asyncppo up` (repeatable)",
    )
    p.add_argument(
        "--out", type=Path, default=SCRATCH / "soak.json", help="the report; its .png beside it"
    )
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.interval <= 0 or not 0 <= args.warmup_fraction < 1:
        p.error("--minutes and --interval must be > 0, --warmup-fraction in [0, 1)")
    report = soak(args)
    write_report(args.out, report)
    plot(report, args.out.with_suffix(".png"))
    print(json.dumps(report["summary"], indent=1))
    print(f"[soak] wrote {args.out} and its .png")


if __name__ == "__main__":
    main()
