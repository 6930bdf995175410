"""Broker benchmark: every figure against a raw-ZeroMQ baseline measured in the same run.

* Trajectories: actor process -> broker process -> learner process, against raw PUSH/PULL between
  two processes carrying the same frames (a segment's arrays of 4 KB, 256 KB and 4 MB).
* (Weights no longer pass through the broker: bench.weights measures their distribution.)
* 256 simulated actors connected at once (threads of one process, one DEALER each): broker RSS,
  throughput against 4 actors doing the same total work, nothing lost.

Writes broker.json and broker.png (broker_quick.* with --quick) to runs/bench/ or --out.

    python -m bench.broker [--quick] [--out docs/results]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import zmq

from bench.record import SCRATCH, provenance, write_report
from common.protocol import encode
from common.transport import send
from testkit.peers import BYTES_PER_TOKEN, BrokerProcess, Peer, ScriptedActor, ScriptedLearner
from testkit.segments import make_segment, turns

MP = multiprocessing.get_context("spawn")
LOCAL = "tcp://127.0.0.1"
MB = 1 << 20
WINDOW = 4  # requests in flight per client (Client.pipeline's default)
BATCH, PUBLISH_EVERY = 16, 4  # trajectory runs: capacity (1 + 1) * 4 * 16 = 128 episodes
SWARM_TOKENS = 64  # ~1 KB segments: the 256-actor run measures messages, not bytes


# ------------------------------------------------------------------ trajectories
def traj_actor(address: str, count: int, num_tokens: int, ready: Any, go: Any, out: Any) -> None:
    """Send ``count`` one-segment episodes as fast as permits allow, WINDOW TRAJs in flight."""
    actor = ScriptedActor(address, "bench-actor", num_tokens=num_tokens, timeout_s=60)
    actor.hello()
    while actor.sync_weights() < 0:
        time.sleep(0.05)
    seg = make_segment(
        turns(num_tokens),
        permit="-",
        actor_id=actor.id,
        episode_id="-",
        index=0,
        last=True,
        version=actor.version,
    )
    arrays, built_for = seg.arrays(), actor.version
    ready.set()
    go.wait()
    start, sent = time.monotonic(), 0
    while sent < count:
        permits = actor.permits(min(2 * BATCH, count - sent))
        if actor.version != built_for:  # the tokens carry the version that "sampled" them
            arrays["versions"] = np.where(seg.action_mask == 1, actor.version, -1).astype("<i4")
            built_for = actor.version
        headers = [
            {**seg.header(), "permit": p, "traj_id": f"t{sent + i}", "episode_id": f"e{sent + i}"}
            for i, p in enumerate(permits)
        ]
        actor.client.pipeline("TRAJ", headers, window=WINDOW, tensors=[arrays] * len(headers))
        sent += len(headers)
    out.put(start)


def traj_learner(
    address: str, count: int, batch: int, publish_every: int, ready: Any, out: Any
) -> None:
    """Pull batches until ``count`` segments arrived, publishing tiny weights every few steps."""
    learner = ScriptedLearner(address, "bench-learner", timeout_s=60)
    learner.hello(batch, publish_every)
    learner.publish(0)
    ready.set()
    version = step = received = 0
    while received < count:
        publishes_after = (step + 1) % publish_every == 0
        segments = learner.get_batch(version, batch, publishes_after=publishes_after)
        if segments is None:
            continue
        received, step = received + len(segments), step + 1
        if publishes_after:
            version += 1
            learner.publish(version)
    out.put((time.monotonic(), received))


def raw_pull(count: int, ports: Any, out: Any) -> None:
    sock = zmq.Context.instance().socket(zmq.PULL)
    ports.put(sock.bind_to_random_port(LOCAL))
    for _ in range(count):
        sock.recv_multipart(copy=False)
    out.put(time.monotonic())


def raw_push(port: int, count: int, num_tokens: int, ready: Any, go: Any, out: Any) -> None:
    """The same frames the actor sends (a TRAJ message), straight to the consumer."""
    seg = make_segment(
        turns(num_tokens),
        permit="-",
        actor_id="raw",
        episode_id="-",
        index=0,
        last=True,
        version=0,
    )
    frames = encode("TRAJ", seg.header(), seg.arrays())
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(f"{LOCAL}:{port}")
    ready.set()
    go.wait()
    start = time.monotonic()
    for _ in range(count):
        send(sock, frames)
    out.put(start)
    sock.close(linger=-1)
    zmq.Context.instance().term()  # returns once everything is delivered (zero-copy frames too)


def raw_relay(count: int, to_port: int, ports: Any, out: Any) -> None:
    """The ideal broker: PULL each message and PUSH the very same frames on (zero-copy), no work."""
    ctx = zmq.Context.instance()
    inlet, outlet = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    outlet.connect(f"{LOCAL}:{to_port}")
    ports.put(inlet.bind_to_random_port(LOCAL))
    for _ in range(count):
        outlet.send_multipart(inlet.recv_multipart(copy=False), copy=False)
    out.put(None)
    inlet.close()
    outlet.close(linger=-1)
    ctx.term()  # returns once everything is delivered


def process(target: Any, *args: Any) -> Any:
    """A spawned daemon process: an interrupted benchmark leaves none behind."""
    return MP.Process(target=target, args=args, daemon=True)


def run_procs(procs: list, ready: list, go: Any, timeout_s: float = 600) -> None:
    for p in procs:
        p.start()
    for event in ready:
        if not event.wait(timeout_s):
            raise TimeoutError("a benchmark process did not get ready")
    go.set()


def broker_trajectories(tmp: Path, num_tokens: int, count: int) -> dict:
    """One actor process -> a fresh broker -> one learner process; seconds and what arrived."""
    with BrokerProcess(tmp / f"traj-{num_tokens}.log", {"run.log_format": "json"}) as broker:
        l_ready, a_ready, go = MP.Event(), MP.Event(), MP.Event()
        l_out, a_out = MP.Queue(), MP.Queue()
        procs = [
            process(traj_learner, broker.address, count, BATCH, PUBLISH_EVERY, l_ready, l_out),
            process(traj_actor, broker.address, count, num_tokens, a_ready, go, a_out),
        ]
        run_procs(procs, [l_ready, a_ready], go)
        start = a_out.get(timeout=600)
        end, received = l_out.get(timeout=600)
        stats = Peer(broker.address, "bench-stats").stats()
        for p in procs:
            p.join()
    return {
        "seconds": end - start,
        "received": received,
        "accepted": stats["accepted"],
        "dropped_stale": stats["dropped_stale"],
    }


def raw_trajectories(num_tokens: int, count: int, *, relay: bool = False) -> float:
    """The same TRAJ frames over raw PUSH/PULL between two processes; with ``relay``, through a
    third that forwards them (``raw_relay``: the physical floor of any broker). Seconds."""
    ports, r_out, p_out, ready, go = MP.Queue(), MP.Queue(), MP.Queue(), MP.Event(), MP.Event()
    procs = [process(raw_pull, count, ports, r_out)]
    procs[0].start()
    port = ports.get(timeout=60)
    if relay:
        relay_done = MP.Queue()  # held here: a queue collected in the parent breaks the child
        procs.append(process(raw_relay, count, port, ports, relay_done))
        procs[1].start()
        port = ports.get(timeout=60)
    push = process(raw_push, port, count, num_tokens, ready, go, p_out)
    run_procs([push], [ready], go)
    seconds = r_out.get(timeout=600) - p_out.get(timeout=600)
    for p in (push, *procs):
        p.join()
    return seconds


def trajectories(tmp: Path, payload: int, count: int, repeats: int) -> dict:
    """Broker path and raw baseline, alternating, best of ``repeats`` each (a busy CPU slows both)."""
    num_tokens = payload // BYTES_PER_TOKEN
    nbytes = num_tokens * BYTES_PER_TOKEN
    runs, raw, relay = [], [], []
    for _ in range(repeats):
        runs.append(broker_trajectories(tmp, num_tokens, count))
        raw.append(raw_trajectories(num_tokens, count))
        relay.append(raw_trajectories(num_tokens, count, relay=True))
    best = min(runs, key=lambda r: r["seconds"])
    broker_s, raw_s, relay_s = best["seconds"], min(raw), min(relay)
    row = {
        "payload_bytes": nbytes,
        "segments": count,
        "repeats": repeats,
        "broker_seconds": broker_s,
        "broker_mb_per_s": count * nbytes / broker_s / MB,
        "broker_segments_per_s": count / broker_s,
        "raw_seconds": raw_s,
        "raw_mb_per_s": count * nbytes / raw_s / MB,
        "raw_segments_per_s": count / raw_s,
        "ratio_broker_over_raw": raw_s / broker_s,
        "relay_seconds": relay_s,
        "relay_mb_per_s": count * nbytes / relay_s / MB,
        "ratio_relay_over_raw": raw_s / relay_s,
        "ratio_broker_over_relay": relay_s / broker_s,
        "nothing_lost": all(r["received"] == r["accepted"] == count for r in runs),
        "dropped_stale": sum(r["dropped_stale"] for r in runs),
    }
    print(
        f"trajectories {nbytes / 1024:6.0f} KB x {count:5d}: broker {row['broker_mb_per_s']:7.1f} MB/s"
        f" ({row['broker_segments_per_s']:6.0f} seg/s)  raw PUSH/PULL {row['raw_mb_per_s']:7.1f} MB/s"
        f" ({row['raw_segments_per_s']:6.0f} seg/s)  ratio {row['ratio_broker_over_raw']:.2f}"
        f"  (bare relay {row['ratio_relay_over_raw']:.2f} of raw; broker"
        f" {row['ratio_broker_over_relay']:.2f} of the relay)",
        flush=True,
    )
    return row


def swarm(address: str, actors: int, episodes: int, ready: Any, go: Any, out: Any) -> None:
    """``actors`` ScriptedActors on threads of this process, each on its own DEALER socket."""
    connected = threading.Barrier(actors + 1)
    acked = [0] * actors

    def act(i: int) -> None:
        actor = ScriptedActor(address, f"sim-{i:03d}", num_tokens=SWARM_TOKENS, timeout_s=120)
        actor.hello()
        actor.sync_weights()
        connected.wait()
        go.wait()
        while acked[i] < episodes:
            for permit in actor.permits(min(2, episodes - acked[i])):
                actor.play(permit, segments=1)
                acked[i] += 1
        actor.close()

    threads = [threading.Thread(target=act, args=(i,)) for i in range(actors)]
    for t in threads:
        t.start()
    connected.wait()
    ready.set()
    go.wait()
    start = time.monotonic()
    for t in threads:
        t.join()
    out.put((start, sum(acked)))


def many_actors(tmp: Path, actors: int, total: int) -> dict:
    batch = min(128, total)
    # The simulated actors idle from their HELLO until all are connected: a long heartbeat timeout.
    settings = {"run.log_format": "json", "broker.heartbeat_timeout_s": 300}
    with BrokerProcess(tmp / f"swarm-{actors}.log", settings) as broker:
        broker_ps = psutil.Process(broker.proc.pid)
        idle_rss = broker_ps.memory_info().rss
        l_ready, s_ready, go = MP.Event(), MP.Event(), MP.Event()
        l_out, s_out = MP.Queue(), MP.Queue()
        procs = [
            process(traj_learner, broker.address, total, batch, 2, l_ready, l_out),
            process(swarm, broker.address, actors, total // actors, s_ready, go, s_out),
        ]
        run_procs(procs, [l_ready, s_ready], go)
        monitor = Peer(broker.address, "bench-stats", timeout_s=60)
        connected = monitor.stats()["actors"]
        peak_rss = broker_ps.memory_info().rss
        while l_out.empty():
            if not procs[0].is_alive() and l_out.empty():
                raise RuntimeError(f"the learner process died; see {broker.log}")
            peak_rss = max(peak_rss, broker_ps.memory_info().rss)
            time.sleep(0.1)
        end, received = l_out.get()
        start, sent = s_out.get(timeout=600)
        stats = monitor.stats()
        for p in procs:
            p.join()
    row = {
        "actors": actors,
        "connected_at_start": connected,
        "segments_sent": sent,
        "accepted": stats["accepted"],
        "received_by_learner": received,
        "dropped": stats["dropped_stale"] + stats["dropped_incomplete_episode"],
        "rejected_invalid": stats["rejected_invalid"],
        "nothing_lost": sent == stats["accepted"] == received == total,
        "seconds": end - start,
        "segments_per_s": total / (end - start),
        "broker_rss_idle_bytes": idle_rss,
        "broker_rss_peak_bytes": peak_rss,
    }
    print(
        f"{actors:3d} actors connected ({connected} seen): {row['segments_per_s']:7.0f} seg/s, "
        f"broker RSS {idle_rss / MB:.0f} -> {peak_rss / MB:.0f} MB, sent {sent} accepted "
        f"{stats['accepted']} trained {received}",
        flush=True,
    )
    return row


# ------------------------------------------------------------------ report
def size_label(nbytes: int) -> str:
    return f"{nbytes / MB:.0f} MB" if nbytes >= MB else f"{nbytes / 1024:.0f} KB"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax3) = plt.subplots(1, 2, figsize=(11, 4.5))
    rows = report["trajectories"]
    x = np.arange(len(rows))
    ax1.bar(x - 0.27, [r["raw_mb_per_s"] for r in rows], 0.27, label="raw PUSH/PULL (1 hop)")
    ax1.bar(x, [r["relay_mb_per_s"] for r in rows], 0.27, label="bare zero-copy relay (2 hops)")
    ax1.bar(
        x + 0.27, [r["broker_mb_per_s"] for r in rows], 0.27, label="actor -> broker -> learner"
    )
    for i, r in enumerate(rows):
        ax1.annotate(
            f"{r['ratio_broker_over_raw']:.2f}x",
            (i + 0.27, r["broker_mb_per_s"]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax1.set_xticks(x, [size_label(r["payload_bytes"]) for r in rows])
    ax1.set_yscale("log")
    ax1.set(title="Trajectory throughput", xlabel="segment payload", ylabel="MB/s")
    ax1.legend(loc="upper left", fontsize=8)
    swarm_rows = report["many_actors"]
    labels = [f"{r['actors']} actors" for r in swarm_rows]
    ax3.bar(labels, [r["segments_per_s"] for r in swarm_rows], color="tab:green")
    ax3.set(title="Many actors at once (1 KB segments)", ylabel="segments/s")
    for i, r in enumerate(swarm_rows):
        ax3.annotate(
            f"RSS {r['broker_rss_peak_bytes'] / MB:.0f} MB",
            (i, r["segments_per_s"]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer segments (about a minute)",
    )
    parser.add_argument("--out", type=Path, default=SCRATCH, help="the report's directory")
    parser.add_argument(
        "--only",
        choices=("trajectories",),
        help="re-measure one part and update it in the existing results file",
    )
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so every broker (in its own session) is killed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    q = args.quick
    counts = {
        4 << 10: 1024 if q else 4096,
        256 << 10: 208 if q else 1600,
        4 << 20: 32 if q else 160,
    }
    episodes = 4 if q else 16
    repeats = 1 if q else 2
    report: dict[str, Any] = {
        "benchmark": "broker",
        "quick": q,
        "notes": [
            "Every process shares one machine: the broker, its clients and the baselines compete for the same cores.",
            "Trajectory relay = a third process that PULLs each message and PUSHes the same frames on "
            "(zero-copy, no work): the floor of any two-hop path on this machine.",
            "Trajectory ratio = broker throughput / raw PUSH/PULL throughput of the same TRAJ frames; "
            f"the broker path includes permits, ACKs, validation and batching (batch {BATCH}, "
            f"publish every {PUBLISH_EVERY} batches, max_staleness 1).",
            "Trajectories: best of `repeats` rounds, broker and baseline alternating, so load "
            "from other processes slows both alike.",
            "Many actors: threads of one process, one DEALER each, 1 KB one-segment episodes, "
            "learner batch 128 publishing every 2 batches; baseline: 4 actors, same total.",
        ],
    }
    stem = "broker_quick" if q else "broker"
    versions = {"pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()}
    path = args.out / f"{stem}.json"
    if args.only == "trajectories":  # re-measure one part; the file keeps the others
        with tempfile.TemporaryDirectory() as tmp_dir:
            rows = [trajectories(Path(tmp_dir), p, n, repeats) for p, n in counts.items()]
        report = json.loads(path.read_text())
        report["trajectories"] = rows
        report.setdefault("updates", {})["trajectories"] = provenance(**versions)
        write_report(path, report, **versions)
        plot(report, path.with_suffix(".png"))
        print(f"updated the trajectories of {path} and .png")
        return
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        report["trajectories"] = [
            trajectories(tmp, payload, n, repeats) for payload, n in counts.items()
        ]
        report["many_actors"] = [many_actors(tmp, n, 256 * episodes) for n in (4, 256)]
    base, crowd = report["many_actors"]
    report["many_actors_ratio_256_over_4"] = crowd["segments_per_s"] / base["segments_per_s"]
    print(f"256 actors vs 4: throughput ratio {report['many_actors_ratio_256_over_4']:.2f}")
    write_report(path, report, **versions)
    plot(report, path.with_suffix(".png"))
    print(f"wrote {path} and .png")


if __name__ == "__main__":
    main()
