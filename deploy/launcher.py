"""``asyncppo up``: broker, learner and N actors as separate OS processes on this machine.

The launcher only starts, watches and stops processes; it learns how training goes the way an
operator would, from the broker's STATS and the learner's step log. The actor count follows
``<run dir>/actors.target`` (written by ``asyncppo scale``) and SIGUSR1/SIGUSR2 (+1/-1), live.
Shutdown order: learner first (it checkpoints, and a learner that completed its steps stays until
an actor holds its last version), then the evaluator (after a completed run, once it has scored
that version, fetched from the actors), then the actors (they say BYE), then the broker.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from common.config import Config
from common.lifecycle import spawn
from common.transport import Client, Endpoint, TransportError

STOP_TIMEOUT_S = 30.0
RUN_FILES = ("logs", "learner_steps.jsonl", "eval.jsonl", "actors.target")  # what `up` writes


class Launcher:
    def __init__(self, cfg: Config, args: argparse.Namespace):
        self.cfg, self.args = cfg, args
        self.run_dir = Path(cfg.run.out_dir)
        self.earlier_run = set_aside_earlier_run(self.run_dir)
        self.logs = self.run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.base_cmd = [sys.executable, "-m", "deploy.cli"]
        self.role_args = (["--config", args.config] if args.config else []) + [
            a for o in args.overrides for a in ("--set", o)
        ]
        self.actors: dict[str, subprocess.Popen] = {}
        self.retired: list[str] = []
        self.actor_versions: dict[str, int] = {}  # every actor seen, its newest version
        self.next_actor = 0
        self.target = args.actors if args.actors is not None else cfg.run.num_actors
        (self.run_dir / "actors.target").write_text(f"{self.target}\n")
        self.stopping = False
        self.ended_by: str | None = None  # why the watch ended early, when it did
        self.cpu: dict[str, float] = {}  # each role process's CPU seconds, at its last sample

    def _spawn(self, role: str, name: str, extra: list[str]) -> subprocess.Popen:
        port = self._port(role)
        cmd = (
            self.base_cmd
            + [role, *self.role_args, *extra]
            + (["--metrics-port", str(port)] if port else [])
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "ASYNCPPO_ACTOR_ID": name}
        with open(self.logs / f"{name}.log", "ab") as out:  # dies with the launcher, however
            return spawn(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def _port(self, role: str) -> int | None:
        base = self.cfg.run.metrics_base_port
        if not base:
            return None
        return {"broker": base, "learner": base + 1, "eval": base + 2}.get(
            role, base + 10 + self.next_actor
        )

    def start(self) -> None:
        from common.model import ensure_model

        ensure_model(
            self.cfg.model.path, builtin=self.cfg.model.builtin
        )  # once, before the roles race for it
        self.broker = self._spawn("broker", "broker", [])
        self.learner = self._spawn("learner", "learner", [])
        # Held-out evaluation beside training: a process that takes no permits and sends nothing.
        self.evaluator = (
            self._spawn("eval", "eval", ["--follow"]) if self.cfg.eval.every_versions else None
        )
        self.scale_to(self.target)
        self.stats_client = Client(
            Endpoint(self.cfg.security, self.cfg.broker.max_message_bytes),
            self.cfg.learner.broker,
            f"launcher-{os.getpid()}",
            timeout_s=2.0,
        )

    def scale_to(self, n: int) -> None:
        """Start or stop actors until n run; stopping sends SIGTERM (the actor says BYE)."""
        while len(self.actors) < n:
            name = f"actor-{self.next_actor}"
            self.actors[name] = self._spawn("actor", name, [])
            self.next_actor += 1
            print(f"[up] started {name} (actors: {len(self.actors)})", flush=True)
        while len(self.actors) > n:
            name = sorted(self.actors, key=lambda a: int(a.split("-")[1]))[-1]
            stop(self.actors.pop(name))
            self.retired.append(name)
            print(f"[up] stopped {name} (actors: {len(self.actors)})", flush=True)

    def stop_learner(self) -> None:
        """SIGTERM; the learner finishes its step and checkpoints, which with a real model on CPU
        takes minutes: wait as long as its /healthz says it makes progress (or, serving none,
        ``run.stall_timeout_s``), and SIGKILL only a learner that stopped making progress."""
        if self.learner.poll() is not None:
            return
        self.learner.send_signal(signal.SIGTERM)
        print("[up] stopping the learner: it finishes its step and checkpoints", flush=True)
        if not self._wait_while_progressing(self.learner, "learner"):
            print(
                f"[up] the learner made no progress for {self.cfg.run.stall_timeout_s} s: "
                "killing it",
                flush=True,
            )
            self.learner.kill()
        self.learner.wait()

    def finish_evaluation(self, learner_completed: bool) -> None:
        """Once the learner has completed its steps, the evaluator scores the final version
        (SIGUSR1: due or not, then it exits), however long that takes while it makes progress;
        then, or at once after an interrupted run, it is stopped."""
        if learner_completed and not self.stopping and self.evaluator.poll() is None:
            print("[up] scoring the final version on the held-out set", flush=True)
            self.evaluator.send_signal(signal.SIGUSR1)
            self._wait_while_progressing(self.evaluator, "eval", until=lambda: self.stopping)
        stop(self.evaluator)

    def _wait_while_progressing(
        self, proc: subprocess.Popen, role: str, until: Any = lambda: False
    ) -> bool:
        """Wait for `proc` to exit as long as its /healthz says it makes progress (or, serving
        none, ``run.stall_timeout_s``), or until `until()`; whether it exited."""
        port, stall = self._port(role), self.cfg.run.stall_timeout_s
        deadline = time.monotonic() + stall
        while proc.poll() is None and time.monotonic() < deadline and not until():
            if port and healthy(self.cfg.run.metrics_host, port):
                deadline = time.monotonic() + stall
            time.sleep(0.5)
        return proc.poll() is not None

    def broker_stats(self) -> dict[str, Any]:
        """The broker's STATS ({} when it does not answer). The broker forgets an actor once it
        leaves, so the newest version each actor reported is kept here for the summary."""
        try:
            stats = self.stats_client.request("STATS").header["stats"]
        except TransportError:
            return {}
        self.actor_versions.update(stats.get("actor_versions", {}))
        return stats

    def steps(self) -> list[dict]:
        return read_jsonl(self.run_dir / "learner_steps.jsonl")

    def evals(self) -> list[dict]:
        return read_jsonl(self.run_dir / "eval.jsonl")

    def progress(self, t0: float) -> None:
        steps, stats = self.steps(), self.broker_stats()
        if not steps:
            print(
                f"[up] {time.monotonic() - t0:6.1f}s waiting for the first step | version "
                f"{stats.get('policy_version', '?')} | actors {stats.get('actors', '?')} | "
                f"queued {stats.get('queued_episodes', '?')}",
                flush=True,
            )
            return
        s, evals = steps[-1], self.evals()
        total = self.cfg.learner.total_steps or "∞"
        held_out = (
            f" | held-out {evals[-1]['success']:.3f} @v{evals[-1]['version']}" if evals else ""
        )
        print(
            f"[up] {time.monotonic() - t0:6.1f}s step {s['step'] + 1}/{total} | version {s['version']} | "
            f"reward {s['reward_mean']:.3f} | {s['tokens_per_second']:.0f} tok/s | staleness max "
            f"{s['max_staleness']} | kept {s['icepop_kept_fraction']:.3f} | actors {stats.get('actors', '?')} | "
            f"queued {stats.get('queued_episodes', '?')}{held_out}",
            flush=True,
        )

    def watch(self) -> str | None:
        """Until the learner exits, a deadline passes or we are told to stop; why the run
        failed, or None (``outcome`` then judges it by the steps done)."""
        t0 = time.monotonic()
        last_print = 0.0
        learner_port = self._port("learner")
        while not self.stopping:
            if self.learner.poll() is not None:
                break
            if self.broker.poll() is not None:
                return f"the broker exited with status {self.broker.returncode} (logs/broker.log)"
            for name, proc in list(self.actors.items()):
                if proc.poll() is not None:  # an actor died: replace it, as a Deployment would
                    print(f"[up] {name} exited with {proc.returncode}; replacing it", flush=True)
                    del self.actors[name]
            target = read_target(self.run_dir / "actors.target", self.target)
            if target != self.target or len(self.actors) != target:
                self.target = target
                self.scale_to(target)
            if self.cfg.run.max_wall_s and time.monotonic() - t0 > self.cfg.run.max_wall_s:
                print("[up] run.max_wall_s reached", flush=True)
                self.ended_by = f"run.max_wall_s ({self.cfg.run.max_wall_s:g} s) reached"
                break
            if learner_port and (stalled := stall(self.cfg.run.metrics_host, learner_port)):
                return f"the learner stalled: no progress for run.stall_timeout_s ({stalled})"
            if time.monotonic() - last_print > 5:
                self.progress(t0)
                last_print = time.monotonic()
            self.sample_cpu()
            time.sleep(0.2)
        self.progress(t0)
        if self.learner.poll() not in (0, None):
            return f"the learner exited with status {self.learner.returncode} (logs/learner.log)"
        return None

    def sample_cpu(self) -> None:
        """Each role's CPU seconds so far (user + system, its own and its children's): the roles'
        cost apart from how they share this machine's cores. A role that exits keeps its last
        sample, at most one watch tick old."""
        roles = {"broker": self.broker, "learner": self.learner, **self.actors}
        if self.evaluator is not None:
            roles["eval"] = self.evaluator
        for name, proc in roles.items():
            try:
                t = psutil.Process(proc.pid).cpu_times()
            except psutil.Error:  # exited between the poll and the sample
                continue
            self.cpu[name] = t.user + t.system + t.children_user + t.children_system

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds per role kind: broker, learner, eval and every actor that ran, summed."""
        kinds: dict[str, float] = {}
        for name, seconds in self.cpu.items():
            kind = "actors" if name.startswith("actor-") else name
            kinds[kind] = round(kinds.get(kind, 0.0) + seconds, 2)
        return kinds

    def outcome(self, failure: str | None) -> tuple[int, str]:
        steps = self.steps()
        ended = self.ended_by or ("stopped" if self.stopping else "the learner exited")
        done = steps[-1]["step"] + 1 if steps else 0
        return run_outcome(failure, ended, done, self.cfg.learner.total_steps)

    def shutdown(self) -> dict[str, Any]:
        learner_completed = self.learner.poll() == 0  # exited on its own: total_steps done
        self.sample_cpu()
        self.stop_learner()
        stats = self.broker_stats()
        if self.evaluator is not None:  # the final version's sources are the actors now
            self.finish_evaluation(learner_completed)
        for proc in self.actors.values():
            proc.send_signal(signal.SIGTERM)
        for proc in self.actors.values():
            stop(proc)
        final = self.broker_stats() or stats
        self.stats_client.close()
        stop(self.broker)
        return final

    def summary(self, stats: dict[str, Any], wall: float) -> dict[str, Any]:
        steps, evals = self.steps(), self.evals()
        rewards = [r for s in steps for r in s["episode_rewards"]]
        k = max(1, len(rewards) // 5)
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return {
            "learner_steps": len(steps),
            "policy_version": stats.get("policy_version", steps[-1]["version"] + 1 if steps else 0),
            "trajectories_trained": sum(s["segments"] for s in steps),
            "episodes_trained": sum(s["episodes"] for s in steps),
            "tokens_trained": sum(s["tokens"] for s in steps),
            "reward_first": mean(rewards[:k]),
            "reward_last": mean(rewards[-k:]),
            "actors": len(self.actor_versions),
            "actor_versions": dict(self.actor_versions),
            "max_staleness_seen": max((s["max_staleness"] for s in steps), default=0),
            "max_staleness_allowed": self.cfg.broker.max_staleness,
            "dropped_stale": stats.get("dropped_stale", 0),
            "rejected_invalid": stats.get("rejected_invalid", 0),
            "icepop_kept_fraction_mean": mean([s["icepop_kept_fraction"] for s in steps]),
            "wall_seconds": round(wall, 2),
            "cpu_seconds": self.cpu_seconds(),
            # Held-out success of the first and last evaluated versions (eval.every_versions).
            "eval": [
                {k: e[k] for k in ("version", "success", "success_ci95", "episodes")}
                for e in (evals[:1] + evals[-1:] if len(evals) > 1 else evals)
            ],
        }


def run_outcome(failure: str | None, ended: str, done: int, total: int) -> tuple[int, str]:
    """`up`'s exit status and the line that says why. 0 only for a run that trained what it was
    asked: ``total`` steps, or with ``total`` 0 (run until stopped) at least one step; else 1,
    whether a role failed (``failure``) or the run ``ended`` early (wall clock, a signal)."""
    of = f"{done} of {total or '∞'} steps"
    if failure is not None:
        return 1, f"failed after {of}: {failure}"
    if total and done >= total:
        return 0, f"done: {of}"
    if not total and done:
        return 0, f"{ended} after {done} steps (learner.total_steps 0: run until stopped)"
    return 1, f"incomplete: {ended} after {of}"


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_target(path: Path, default: int) -> int:
    try:
        return max(0, int(path.read_text().strip()))
    except (OSError, ValueError):
        return default


def healthy(host: str, port: int) -> bool:
    """Whether the role serving on ``port`` answers /healthz with 200 (its loop makes progress)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=2) as reply:
            return reply.status == 200
    except OSError:  # refused, 503 (HTTPError), timed out
        return False


def stall(host: str, port: int) -> str | None:
    """What a role whose /healthz answers 503 waits for; None while it is alive or not serving."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=2):
            return None
    except urllib.error.HTTPError as exc:
        if exc.code != 503:
            return None
        try:
            return f"waiting for {json.loads(exc.read())['waiting_for']}"
        except (ValueError, KeyError, TypeError):
            return "no reason given"
    except OSError:  # not serving (yet), timed out
        return None


def set_aside_earlier_run(run_dir: Path) -> Path | None:
    """``up`` never continues a run (its learner starts fresh), so an earlier run's logs, step
    log and evaluations would mix with the new run's: move them to ``<run dir>.prev``, replacing
    the one before, and return where they went (None when there was nothing to move). A run dir
    holding other files only (a caller's own log) is no earlier run and stays."""
    if not any((run_dir / name).exists() for name in RUN_FILES):
        return None
    earlier = run_dir.with_name(run_dir.name + ".prev")
    if earlier.exists():
        shutil.rmtree(earlier)
    run_dir.rename(earlier)
    return earlier


def stop(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, wait, then SIGKILL: a role that hangs on exit never hangs the launcher."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def launch(cfg: Config, args: argparse.Namespace) -> int:
    launcher = Launcher(cfg, args)

    def on_signal(signum: int, frame: Any) -> None:
        if signum == signal.SIGUSR1:
            launcher.target += 1
        elif signum == signal.SIGUSR2:
            launcher.target = max(0, launcher.target - 1)
        else:
            launcher.stopping = True
            return
        (launcher.run_dir / "actors.target").write_text(f"{launcher.target}\n")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, on_signal)
    t0 = time.monotonic()
    print(f"[up] run dir {launcher.run_dir} (logs in {launcher.logs})", flush=True)
    if launcher.earlier_run:
        print(
            f"[up] {launcher.run_dir} held an earlier run: moved to {launcher.earlier_run} "
            "(this run starts clean)",
            flush=True,
        )
    launcher.start()
    try:
        failure = launcher.watch()
    finally:
        stats = launcher.shutdown()
    code, why = launcher.outcome(failure)
    summary = launcher.summary(stats, time.monotonic() - t0) | {"exit": code, "outcome": why}
    print("[up] summary " + json.dumps(summary), flush=True)
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[up] {why}", file=sys.stderr if code else sys.stdout, flush=True)
    return code
