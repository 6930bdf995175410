"""Weight distribution: a new version to N actors over rate-limited links, chain against star.

Every host is a network namespace behind its own veth cable to a switch (a bridge), and every
cable is limited by ``tc tbf`` in both directions (``--rate``), so links, not memory copies, are
the bottleneck, as on a cluster: a broker, a learner that serves the version it publishes, and N
fetchers, each an actor's weight path (HELLO with a chunk server, WEIGHTS_WHERE, every chunk
sha256-checked, served on at once). The same run measures both of the broker's policies:

* ``chain`` (the default): each fetcher is sent to the one that asked before it;
* ``star``: everyone fetches from the learner, N copies through its one link: the cost of a
  broker fan-out (the old design, where the broker relayed every copy through its link).

Reported per (design, size, N): seconds from PUBLISH until all N hold the version (and until the
first does), bytes through the busiest cable, the broker's resident memory; and the ratio to
N = 1. Needs root (``ip netns``, ``tc``). Writes docs/results/weights.json and weights.png
(weights_quick.* with --quick).

    python -m bench.weights [--quick] [--rate 100mbit] [--out docs/results]
                            [--actors 16] [--mb 64] [--design chain]   (a subset)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil
import torch

from bench.record import SCRATCH, write_report

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "aw"  # namespace names: aw-sw (the switch), aw-broker, aw-learner, aw-f1 ...
MB = 1 << 20
PORT = 5555
CHUNK_KIB = 1024  # learner.weight_chunk_bytes's default


# ------------------------------------------------------------------------------ the hosts
def sh(*args: str) -> str:
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode:
        raise OSError(f"{' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def address(index: int) -> str:
    return f"10.88.0.{index + 1}"


class Network:
    """Hosts on one switch, every cable rate-limited both ways."""

    def __init__(self, hosts: list[str], rate: str, prefix: str = PREFIX) -> None:
        self.hosts, self.rate, self.prefix = hosts, rate, prefix

    def ns(self, host: str) -> str:
        """The network namespace of ``host``."""
        return f"{self.prefix}-{host}"

    def build(self) -> None:
        self.remove()
        sh("ip", "netns", "add", self.ns("sw"))
        sh("ip", "-n", self.ns("sw"), "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.ns("sw"), "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            sh("ip", "netns", "add", self.ns(host))
            sh("ip", "-n", self.ns(host), "link", "set", "lo", "up")
            port = f"p{i}"
            sh("ip", "-n", self.ns("sw"), "link", "add", port, "type", "veth", "peer", "name", "eth0",
               "netns", self.ns(host))  # fmt: skip
            sh("ip", "-n", self.ns("sw"), "link", "set", port, "master", "br0")
            sh("ip", "-n", self.ns("sw"), "link", "set", port, "up")
            sh("ip", "-n", self.ns(host), "addr", "add", f"{address(i)}/24", "dev", "eth0")
            sh("ip", "-n", self.ns(host), "link", "set", "eth0", "up")
            for where, dev in ((self.ns(host), "eth0"), (self.ns("sw"), port)):  # up- and downlink
                self._shape(where, dev, "add", self.rate)

    def _shape(self, ns: str, dev: str, verb: str, rate: str) -> None:
        sh("ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", dev, "root", "tbf",
           "rate", rate, "burst", "256kb", "latency", "100ms")  # fmt: skip

    def limit_uplink(self, host: str, rate: str) -> None:
        """What ``host`` sends goes at ``rate`` from now on (a slow or congested sender)."""
        self._shape(self.ns(host), "eth0", "change", rate)

    def remove(self) -> None:
        for host in ("sw", *self.hosts):
            subprocess.run(["ip", "netns", "del", self.ns(host)], capture_output=True)

    def sent(self) -> dict[str, tuple[int, int]]:
        """(bytes sent, bytes received) of each host's cable (kernel counters)."""
        out = {}
        for host in self.hosts:
            stats = json.loads(
                sh("ip", "-n", self.ns(host), "-j", "-s", "link", "show", "dev", "eth0")
            )
            out[host] = (stats[0]["stats64"]["tx"]["bytes"], stats[0]["stats64"]["rx"]["bytes"])
        return out

    def start(self, host: str, args: list[str], log: Path) -> subprocess.Popen:
        from common.lifecycle import spawn

        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(log, "wb") as out:
            return spawn(["ip", "netns", "exec", self.ns(host), sys.executable, *args], cwd=ROOT,
                         env=env, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip


def kill_all(procs: Iterable[subprocess.Popen]) -> None:
    """SIGKILL every process ``Network.start`` started that still runs, its whole group."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# --------------------------------------------------------------------------- the roles
def serve(broker: str, nbytes: int, chunk_bytes: int, go: Path) -> None:
    """The learner's weight path: serve a version of ``nbytes`` and PUBLISH it once the file
    ``go`` exists; print when it published."""
    from common.config import SecurityConfig
    from common.peers import PeerServer
    from common.pieces import Pieces
    from common.transport import Client, Endpoint
    from common.weights import pack_state_dict

    endpoint = Endpoint(SecurityConfig(), 256 * MB)
    server = PeerServer(endpoint, "tcp://0.0.0.0:0")
    client = Client(endpoint, broker, "learner", timeout_s=30)
    client.request("HELLO", {"role": "learner", "version": 0, "batch_size": 1,
                             "publish_every": 1, "peer_port": server.port})  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    manifest, chunks = pack_state_dict(
        {"w": torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=gen)}, 0, chunk_bytes
    )
    server.offer(Pieces(manifest, chunks))
    print(json.dumps({"ready": True}), flush=True)
    while not go.exists():
        time.sleep(0.001)
    published = time.time()
    client.request("PUBLISH", {"manifest": manifest})
    print(json.dumps({"published": published}), flush=True)
    signal.sigwait({signal.SIGTERM})


def fetcher(broker: str, name: str, stall_s: float = 120.0, go: Path | None = None) -> None:
    """An actor's weight path: a chunk server, HELLO, then (once the file ``go`` exists, if
    given) the first version published, fetched from whom the broker names and served on (a
    source silent for ``stall_s`` is given up); prints when it started and finished."""
    from common.config import SecurityConfig
    from common.peers import PeerServer, Source, fetch
    from common.pieces import Pieces
    from common.transport import Client, Endpoint

    endpoint = Endpoint(SecurityConfig(), 256 * MB)
    server = PeerServer(endpoint, "tcp://0.0.0.0:0")
    client = Client(endpoint, broker, name, timeout_s=30)
    client.request("HELLO", {"role": "actor", "version": -1, "peer_port": server.port})
    print(json.dumps({"ready": True}), flush=True)
    while go is not None and not go.exists():
        time.sleep(0.001)
    while (info := client.request("WEIGHTS_INFO")).kind != "WEIGHTS_MANIFEST":
        time.sleep(0.005)
    started = time.time()
    pieces = Pieces(info.header["manifest"])
    server.offer(pieces)
    sources: list[str] = []

    def where(failed: list[str]) -> Source:
        reply = client.request("WEIGHTS_WHERE", {"version": pieces.version, "failed": failed})
        sources.append(reply.header["source"]["id"])
        return Source(**reply.header["source"])

    fetch(pieces, where, endpoint, name, stall_s=stall_s)
    done = time.time()
    pieces.tensors()  # every tensor's sha256, as an actor checks before loading
    print(json.dumps({"started": started, "done": done, "verified": time.time(),
                      "sources": sources}), flush=True)  # fmt: skip
    signal.sigwait({signal.SIGTERM})


# ------------------------------------------------------------------------------ the runs
def last_json(path: Path, key: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in reversed(path.read_text().splitlines() if path.exists() else []):
            if line.startswith("{") and key in (row := json.loads(line)):
                return row
        time.sleep(0.05)
    raise TimeoutError(f"{path}: no {key!r} within {timeout_s} s: {path.read_text()[-2000:]}")


def run(
    net: Network, logs: Path, design: str, nbytes: int, n: int, rate_bps: float, chunk_bytes: int
) -> dict:
    """One version of ``nbytes`` in chunks of ``chunk_bytes`` to ``n`` fetchers under ``design``."""
    broker_at = f"tcp://{address(0)}:{PORT}"
    tag = f"{design}-{nbytes // MB}MB-{n}"
    procs = [
        net.start("broker", ["-m", "deploy.cli", "broker", "--set", f"broker.bind={broker_at}",
                             "--set", f"broker.weights_fanout={design}",
                             "--set", "broker.heartbeat_timeout_s=600",
                             "--set", f"run.out_dir={logs}"], logs / f"{tag}-broker.log"),
    ]  # fmt: skip
    try:
        broker = psutil.Process(procs[0].pid)
        time.sleep(2.0)
        learner_log, go = logs / f"{tag}-learner.log", logs / f"{tag}-go"
        go.unlink(missing_ok=True)
        procs.append(
            net.start(
                "learner",
                ["-m", "bench.weights", "serve", broker_at, str(nbytes), str(chunk_bytes), str(go)],
                learner_log,
            )
        )
        fetch_logs = [logs / f"{tag}-f{i}.log" for i in range(n)]
        procs += [
            net.start(f"f{i}", ["-m", "bench.weights", "fetch", broker_at, f"f{i}"], fetch_logs[i])
            for i in range(n)
        ]
        last_json(learner_log, "ready", 120)
        for log in fetch_logs:
            last_json(log, "ready", 120)
        before, rss_before = net.sent(), broker.memory_info().rss
        psutil.cpu_percent()  # the machine's busy share is measured from here
        go.write_text("go\n")
        published = last_json(learner_log, "published", 60)["published"]
        done = [last_json(log, "done", 60 + 4 * n * nbytes * 8 / rate_bps) for log in fetch_logs]
        after, busy = net.sent(), psutil.cpu_percent() / 100
        # a cable carries both ways at once: its load is the busier direction
        moved = {h: max(after[h][0] - before[h][0], after[h][1] - before[h][1]) for h in after}
        busiest = max(moved, key=moved.get)
        row = {
            "design": design,
            "bytes": nbytes,
            "actors": n,
            "seconds_all": max(d["done"] for d in done) - published,
            "seconds_first": min(d["done"] for d in done) - published,
            "seconds_each": sorted(d["done"] - published for d in done),
            "one_link_seconds": nbytes * 8 / rate_bps,
            "busiest_cable": busiest,
            "busiest_cable_bytes": moved[busiest],
            "busiest_cable_versions": moved[busiest] / nbytes,
            "broker_rss_bytes": broker.memory_info().rss,
            "broker_rss_growth_bytes": broker.memory_info().rss - rss_before,
            "machine_cpu_busy": busy,  # near 1: the cores, not the links, set the pace
            "sources": [d["sources"] for d in done],
        }
        print(f"{design:5s} {nbytes // MB:4d} MB  N={n:2d}: all in {row['seconds_all']:6.2f} s "
              f"(first {row['seconds_first']:5.2f} s; one link {row['one_link_seconds']:5.2f} s), "
              f"busiest cable {row['busiest_cable_versions']:.1f} versions, cores {busy:.0%} busy",
              flush=True)  # fmt: skip
        return row
    finally:
        kill_all(procs)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (design, nbytes), marker in zip(
        sorted({(r["design"], r["bytes"]) for r in report["runs"]}), "osd^vx", strict=False
    ):
        rows = [r for r in report["runs"] if (r["design"], r["bytes"]) == (design, nbytes)]
        ax.plot([r["actors"] for r in rows], [r["seconds_all"] for r in rows], marker + "-",
                label=f"{design}, {nbytes // MB} MB")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="actors", ylabel="seconds until all hold the version",
           title=f"A version to N actors, every link {report['rate']}")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("serve", "fetch"):
        if sys.argv[1] == "serve":
            serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
        else:
            stall_s, go = (
                (float(sys.argv[4]), Path(sys.argv[5])) if len(sys.argv) > 5 else (120, None)
            )
            fetcher(sys.argv[2], sys.argv[3], stall_s, go)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 MB to 1 and 4 actors")
    parser.add_argument("--rate", default="100mbit", help="every cable's rate, both ways (tc)")
    parser.add_argument("--chunk-kib", type=int, default=CHUNK_KIB, help="chunk size in KiB")
    parser.add_argument("--out", type=Path, default=SCRATCH, help="the report's directory")
    parser.add_argument("--actors", type=int, nargs="+", help="only these N (1 is always run)")
    parser.add_argument("--mb", type=int, nargs="+", help="only these version sizes, in MiB")
    parser.add_argument("--design", choices=("chain", "star"), help="only this design")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench.weights needs root: it builds network namespaces and tc rate limits")
    rate_bps = float(args.rate.removesuffix("mbit")) * 1e6
    sizes = (
        [m * MB for m in args.mb] if args.mb else [16 * MB] if args.quick else [64 * MB, 256 * MB]
    )
    counts = (
        sorted({1, *args.actors}) if args.actors else (1, 4) if args.quick else (1, 2, 4, 8, 16)
    )
    net = Network(["broker", "learner", *(f"f{i}" for i in range(max(counts)))], args.rate)
    logs = ROOT / "runs" / "bench-weights"
    logs.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": "weights",
        "rate": args.rate,
        "chunk_bytes": args.chunk_kib << 10,
        "notes": [
            "Every host is a network namespace with one veth cable to a bridge, limited by tc tbf "
            "to the rate in both directions; all processes share this machine's cores.",
            "star = every fetcher from the learner's one link: the cost of the old broker fan-out "
            "(N copies through the broker's link); chain = each from the one before it.",
            "seconds_all: from PUBLISH until every fetcher holds every chunk, each sha256-checked "
            "as it arrived (the tensors' sha256 after that is not included).",
        ],
        "runs": [],
    }
    try:
        net.build()
        for nbytes in sizes:
            for design in [args.design] if args.design else ["chain", "star"]:
                for n in counts:
                    if design == "star" and nbytes > 64 * MB and n > 4:
                        continue  # N transfers through one link: minutes; the trend is clear
                    report["runs"].append(
                        run(net, logs, design, nbytes, n, rate_bps, args.chunk_kib << 10)
                    )
    finally:
        net.remove()
    for row in report["runs"]:
        one = next(
            r
            for r in report["runs"]
            if (r["design"], r["bytes"], r["actors"]) == (row["design"], row["bytes"], 1)
        )
        row["ratio_to_one_actor"] = row["seconds_all"] / one["seconds_all"]  # fmt: skip
    subset = args.actors or args.mb or args.design
    stem = "weights_subset" if subset else "weights_quick" if args.quick else "weights"
    write_report(args.out / f"{stem}.json", report)
    plot(report, args.out / f"{stem}.png")
    print(f"wrote {args.out / stem}.json and .png")


if __name__ == "__main__":
    main()
