"""Weights around the broker (docs/protocol.md §6.3): the broker names sources, peers serve
chunks; a chain of fetchers gets every byte right, a dead or lying peer is routed around, the
broker's memory does not grow with a version's size, and actors play on while they fetch."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import zmq
from test_broker import start_broker, wait_until  # noqa: F401  (the fixture)

from actors.actor import Actor
from actors.link import WeightsClient
from bench.weights import PORT, Network, address, kill_all, last_json
from bench.weights_system import events, per_version
from common.config import SecurityConfig, load_config
from common.peers import PeerServer, fetch, slow
from common.pieces import Pieces
from common.protocol import ProtocolError, decode, encode
from common.transport import Endpoint
from common.weights import pack_state_dict
from testkit.peers import BrokerProcess, Peer, ScriptedActor, ScriptedLearner
from testkit.segments import synthetic_weights


class Fetcher(ScriptedActor):
    """An actor that serves what it fetches: HELLO with its chunk server's port."""

    def __init__(self, address: str, actor_id: str, **kw):
        super().__init__(address, actor_id, **kw)
        self.server = PeerServer(self.client.endpoint, "tcp://127.0.0.1:0", park_s=1.0)
        self.sources: list[str] = []

    def hello(self, held=()) -> int:
        header = {"role": "actor", "version": self.version, "held_permits": list(held)}
        header["peer_port"] = self.server.port
        return self.request("HELLO", header).header["latest_version"]

    def get(self, manifest: dict, stall_s: float = 2.0) -> Pieces:
        pieces = Pieces(manifest)
        self.server.offer(pieces)

        def where(failed: list[str]):
            source = self.source(manifest["version"], failed)
            self.sources.append(source.id)
            return source

        assert fetch(pieces, where, self.client.endpoint, self.id, stall_s=stall_s)
        return pieces

    def close(self) -> None:
        super().close()
        self.server.close()


def serving(broker: BrokerProcess) -> tuple[ScriptedLearner, dict, list]:
    """A learner that published version 0 (256 KiB in 16 chunks) and serves it."""
    learner = ScriptedLearner(broker.address, "learner")
    learner.hello(batch_size=2)
    return learner, *learner.publish(0, nbytes=256 << 10, chunk_bytes=16 << 10)


@pytest.mark.system
def test_a_chain_of_fetchers_gets_every_byte_each_from_the_one_before(start_broker):  # noqa: F811
    learner, manifest, chunks = serving(broker := start_broker())
    fetchers = [Fetcher(broker.address, f"a{i}") for i in range(3)]
    for f in fetchers:
        f.hello()
    got = [f.get(manifest) for f in fetchers]
    assert [f.sources for f in fetchers] == [["learner"], ["a0"], ["a1"]]
    for pieces in got:
        assert [bytes(c) for c in pieces.chunks] == [bytes(c) for c in chunks]
        assert set(pieces.tensors()) == {"layer.weight", "layer.bias"}
    star = start_broker({"broker.weights_fanout": "star"})  # the comparison: all from the learner
    learner2, manifest2, _ = serving(star)
    more = [Fetcher(star.address, f"b{i}") for i in range(2)]
    for f in more:
        f.hello()
        f.get(manifest2)
    assert [f.sources for f in more] == [["learner"], ["learner"]]
    for peer in (*fetchers, *more, learner, learner2):
        peer.close()


@pytest.mark.system
def test_a_relay_that_stops_serving_mid_version_is_routed_around(start_broker):  # noqa: F811
    """The chain's relay holds half the chunks and never gets the rest (killed, frozen): the
    fetcher after it takes the first half from it, waits, gives it up, and gets the rest from the
    learner, byte for byte."""
    learner, manifest, chunks = serving(broker := start_broker())
    relay, last = Fetcher(broker.address, "relay"), Fetcher(broker.address, "last")
    relay.hello()
    last.hello()
    assert relay.source(0).id == "learner"  # the relay joins the chain
    half = Pieces(manifest)
    for i in range(len(chunks) // 2):
        half.put(i, chunks[i])
    relay.server.offer(half)
    t0 = time.monotonic()
    got = last.get(manifest, stall_s=1.0)
    assert last.sources == ["relay", "learner"]
    assert [bytes(c) for c in got.chunks] == [bytes(c) for c in chunks]
    assert time.monotonic() - t0 < 10
    for peer in (relay, last, learner):
        peer.close()


@pytest.mark.system
def test_a_peer_that_serves_a_forged_chunk_is_caught_and_avoided(start_broker):  # noqa: F811
    learner, manifest, chunks = serving(broker := start_broker())
    liar, honest, later = (Fetcher(broker.address, name) for name in ("liar", "honest", "later"))
    for f in (liar, honest, later):
        f.hello()
    assert liar.source(0).id == "learner"
    forged = [bytes(c) for c in chunks]
    forged[1] = bytes(b ^ 0xFF for b in forged[1])  # one flipped chunk
    liar.server.offer(Pieces(manifest, forged))  # served as if it checked
    got = honest.get(manifest)
    assert honest.sources == ["liar", "learner"]
    assert [bytes(c) for c in got.chunks] == [bytes(c) for c in chunks]
    later.get(manifest)
    assert "liar" not in later.sources  # reported once, avoided by everyone
    for peer in (liar, honest, later, learner):
        peer.close()


@pytest.mark.system
def test_a_fetch_from_a_dead_learner_gives_way_to_its_successors_version(start_broker):  # noqa: F811
    """The learner dies with its version served to nobody (its chunk server gone, as under
    SIGKILL mid-transfer) and a new learner publishes the next one: an actor fetching the dead
    one's gives it up (the broker has no source for it) instead of waiting for ever, loads
    nothing of it, and then gets the new version whole."""
    first = ScriptedLearner((broker := start_broker()).address, "learner")
    first.hello(batch_size=2)
    first.publish(0)
    first.server.close()  # nobody can get version 0 any more
    actor = Fetcher(broker.address, "a0")
    actor.hello()
    cfg = load_config(overrides=["actor.weights_stall_s=0.5"])
    info = lambda: actor.client.request("WEIGHTS_INFO")  # noqa: E731
    weights = WeightsClient(cfg, actor.client, info, server=actor.server)
    weights.start(weights.newest())
    time.sleep(2.0)  # stalled on the learner, then told no_source, again and again
    assert weights.busy() and weights.downloading.version == 0
    first.request("BYE")
    second = ScriptedLearner(broker.address, "learner2")
    assert second.hello(batch_size=2) == 0
    manifest, chunks = second.publish(1)
    wait_until(lambda: not weights.busy(), 20, "the fetch of version 0 to give up")
    assert weights.take() is None  # nothing of version 0 to load
    weights.start(weights.newest())
    wait_until(lambda: not weights.busy(), 20, "version 1")
    got = weights.take()
    assert got.version == 1 and [bytes(c) for c in got.chunks] == [bytes(c) for c in chunks]
    for peer in (actor, second):
        peer.close()
    first.client.close()


def manifest_of(total_bytes: int, chunk_bytes: int, version: int) -> dict:
    """A valid manifest of ``total_bytes`` (a multiple of 4096: one uint8 matrix) without the
    bytes behind it."""
    digest = hashlib.sha256(b"").hexdigest()
    n = max(1, -(-total_bytes // chunk_bytes))
    return {
        "version": version,
        "chunk_bytes": chunk_bytes,
        "total_bytes": total_bytes,
        "chunks": [
            {"nbytes": min(chunk_bytes, total_bytes - i * chunk_bytes), "sha256": digest}
            for i in range(n)
        ],
        "tensors": [
            {"name": "w", "dtype": "uint8", "shape": [total_bytes // 4096, 4096], "offset": 0,
             "nbytes": total_bytes, "sha256": digest}
        ],
    }  # fmt: skip


@pytest.mark.system
def test_the_brokers_memory_does_not_grow_with_a_versions_size(tmp_path: Path) -> None:
    """Versions of 16 MiB, then of 4 GiB: the broker holds manifests, never bytes."""
    with BrokerProcess(tmp_path / "broker.log") as broker:
        process = psutil.Process(broker.proc.pid)
        learner = ScriptedLearner(broker.address, "learner")
        learner.hello(batch_size=2)
        for version in range(3):  # warm-up: the handlers' first use
            learner.request("PUBLISH", {"manifest": manifest_of(16 << 20, 4 << 20, version)})
        small = process.memory_info().rss
        for version in range(3, 6):
            learner.request("PUBLISH", {"manifest": manifest_of(4 << 30, 4 << 20, version)})
        grown = process.memory_info().rss - small
        assert Peer(broker.address, "probe").stats()["policy_version"] == 5
        assert grown < 8 << 20, f"the broker grew by {grown / 2**20:.1f} MiB for 4 GiB versions"
        learner.close()


def test_a_chunk_server_answers_anything_and_serves_on() -> None:
    """Whatever a connection sends a chunk server (another kind, a bad header, an unknown
    version, a chunk out of range) gets an ERROR naming the field; valid requests are served."""
    endpoint = Endpoint(SecurityConfig(), 1 << 20)
    server = PeerServer(endpoint, "tcp://127.0.0.1:0", park_s=0.2)
    manifest, chunks = pack_state_dict(synthetic_weights(4096), 3, 1024)
    server.offer(Pieces(manifest, chunks))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")

    def ask(frames: list) -> dict:
        sock.send_multipart(frames)
        assert sock.poll(5000)
        reply = decode(sock.recv_multipart(copy=False))
        return reply

    def get(version: int, chunk: int, **extra) -> list:
        return [bytes(f) for f in encode("WEIGHTS_GET", {"id": "x", "req": 1, "version": version,
                                                           "chunk": chunk, **extra})]  # fmt: skip

    try:
        assert ask([b"\xc1"]).header["code"] == "bad_header"
        other = [bytes(f) for f in encode("PERMITS_REQ", {"id": "x", "n": 1, "version": 3})]
        assert ask(other).header["code"] == "unknown_kind"
        assert ask(get(9, 0)).header["code"] == "version_gone"
        assert ask(get(3, 99)).header["field"] == "chunk"
        assert ask(get(3, "0")).header["code"] == "bad_type"
        reply = ask(get(3, 2))
        assert reply.kind == "WEIGHTS_CHUNK" and bytes(reply.tensors["data"]) == bytes(chunks[2])
        assert "rate" not in reply.header  # given whole: no rate it received the version at
        parked = Pieces(manifest_of(8192, 4096, 4))
        server.offer(parked)
        assert ask(get(4, 0)).header["code"] == "not_yet"  # after park_s
    finally:
        sock.close()
        server.close()


def test_pieces_keep_only_chunks_that_check() -> None:
    manifest, chunks = pack_state_dict(synthetic_weights(4096), 0, 1024)
    pieces = Pieces(manifest)
    with pytest.raises(ProtocolError, match="checksum"):
        pieces.put(0, bytes(len(chunks[0])))
    with pytest.raises(ProtocolError, match="size_mismatch"):
        pieces.put(0, bytes(chunks[0])[:-1])
    assert pieces.missing() == [0, 1, 2, 3] and not pieces.complete
    for i, c in enumerate(chunks):
        assert pieces.rate() is None or i >= 2  # known from two chunks on
        pieces.put(i, c)
        time.sleep(0.01)
    assert pieces.complete and pieces.first_at <= pieces.done_at
    assert 0 < pieces.rate() <= 3 / 0.02  # 3 intervals of at least 10 ms (the sleeps)
    assert Pieces(manifest, chunks).rate() is None  # the learner's: given whole


def test_a_relay_is_slow_only_when_it_serves_far_slower_than_it_receives() -> None:
    """``slow(rate it received at, chunks it served us, seconds first to latest)``."""
    assert slow(10.0, 3, 1.3)  # due in 0.2 s: 1.1 s late and 6x slower
    assert not slow(10.0, 2, 100.0)  # one interval decides nothing
    assert not slow(10.0, 3, 1.1)  # 6x slower, but within the second's grace
    assert slow(1.0, 3, 4.1) and not slow(1.0, 3, 3.9)  # due in 2 s: under twice is not slow
    for nonsense in (0.0, -1.0, float("nan")):  # what a peer may claim judges nobody
        assert not slow(nonsense, 10, 100.0)


@pytest.mark.system
def test_an_actor_plays_on_while_it_fetches_the_next_version(start_broker, tiny_model):  # noqa: F811
    """η = 2: while version 1 cannot be fetched yet (its source holds back every chunk), the
    actor at version 0 keeps starting episodes at version 0; once the chunks are there it swaps
    to version 1 and plays on from there."""
    broker = start_broker({"broker.max_staleness": 2})
    learner = ScriptedLearner(broker.address, "learner")
    learner.server.close()  # one that holds a request for a chunk it lacks for a minute
    learner.server = PeerServer(learner.client.endpoint, "tcp://127.0.0.1:0", park_s=60)
    learner.hello(batch_size=2)
    learner.publish(0)
    cfg = load_config(
        None,
        [f"actor.broker={broker.address}", f"model.path={tiny_model}", "actor.engine=simulated",
         "actor.env=digits", "actor.max_inflight_episodes=4", "actor.id=player",
         "actor.peer_bind=tcp://127.0.0.1:0", "actor.weights_stall_s=60"],
    )  # fmt: skip
    actor = Actor(cfg)
    stop = threading.Event()
    thread = threading.Thread(target=actor.run, args=(stop.is_set,), daemon=True)
    thread.start()
    try:
        wait_until(lambda: actor.engine.version == 0, 30, "version 0")
        manifest1, chunks1 = pack_state_dict(synthetic_weights(4096, 1), 1, 1024)
        held_back = Pieces(manifest1)
        learner.server.offer(held_back)  # the learner "serves" it, without a chunk yet
        learner.request("PUBLISH", {"manifest": manifest1})
        wait_until(lambda: actor.link.weights.busy(), 10, "the fetch of version 1")
        batch: list = []
        wait_until(lambda: bool(batch.append(learner.get_batch(0, 2)) or batch[-1]), 30,
                   "episodes at version 0 while version 1 is fetched", every_s=0.1)  # fmt: skip
        assert actor.engine.version == 0 and all(s.min_version == 0 for s in batch[-1])
        for i, c in enumerate(chunks1):
            held_back.put(i, c)
        wait_until(lambda: actor.engine.version == 1, 30, "the swap to version 1")
        # Train as a learner does: a batch, then the next version. Admission counts on those
        # publishes (a permit is due by a later one), so a learner that only took batches would
        # leave the actor no capacity once the episodes of version 0 had filled it.
        version = [1]

        def played_after_the_swap() -> bool:
            batch = learner.get_batch(version[0], 2)
            if batch is None:
                return False
            if any(s.min_version >= 1 for s in batch):
                return True
            version[0] += 1
            learner.publish(version[0])
            return False

        wait_until(played_after_the_swap, 60, "episodes played after the swap", every_s=0.1)
    finally:
        stop.set()
        thread.join(timeout=30)
        learner.close()
    assert not thread.is_alive()


class Hosts:
    """A learner's chunk server and weight fetchers as real processes on hosts of their own
    (network namespaces, every cable 100 Mbit/s), a real broker on its own host; everything
    started is SIGKILLed and the namespaces removed on exit."""

    def __init__(self, tmp: Path, fetchers: list[str], prefix: str) -> None:
        if os.geteuid() != 0:
            pytest.skip("network namespaces need root")
        self.tmp, self.procs = tmp, {}
        self.net = Network(["broker", "learner", *fetchers], "100mbit", f"{prefix}{os.getpid()}")
        try:
            self.net.build()
        except OSError as exc:
            self.net.remove()
            pytest.skip(f"cannot build network namespaces here: {exc}")
        self.broker_at = f"tcp://{address(0)}:{PORT}"

    def start_broker(self, log: str = "broker.log") -> None:
        args = ["-m", "deploy.cli", "broker", "--set", f"broker.bind={self.broker_at}",
                "--set", "broker.heartbeat_timeout_s=600", "--set", f"run.out_dir={self.tmp}"]  # fmt: skip
        self.procs["broker"] = self.net.start("broker", args, self.tmp / log)

    def publish_16mib(self, fetchers: dict[str, str], stall_s: float) -> None:
        """The learner publishes 16 MiB in 1 MiB chunks (1.3 s a link) once every fetcher is
        ready; fetcher ``name`` asks for it once the file ``fetchers[name]`` exists."""
        self.start_broker()
        time.sleep(2.0)
        go = self.tmp / "go"
        serve = ["-m", "bench.weights", "serve", self.broker_at, str(16 << 20), str(1 << 20)]
        self.procs["learner"] = self.net.start("learner", [*serve, str(go)], self.log("learner"))
        for name, go_file in fetchers.items():
            fetch = ["-m", "bench.weights", "fetch", self.broker_at, name, str(stall_s)]
            self.procs[name] = self.net.start(
                name, [*fetch, str(self.tmp / go_file)], self.log(name)
            )
            last_json(self.log(name), "ready", 120)
        last_json(self.log("learner"), "ready", 120)
        go.write_text("go\n")
        last_json(self.log("learner"), "published", 60)

    def log(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def done(self, names: tuple[str, ...]) -> dict[str, dict]:
        return {name: last_json(self.log(name), "done", 120) for name in names}

    def kill(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        kill_all(self.procs.values())
        self.net.remove()


@pytest.mark.system
def test_a_relay_killed_mid_transfer_and_a_late_joiner_still_get_every_byte(tmp_path):
    """Real processes on hosts of their own: the learner's chunk server publishes 16 MiB down a
    chain of three fetchers; mid-transfer the middle one is SIGKILLed and a fourth joins. The
    fetcher after the dead one gives it up after its stall time and finishes from another
    source, the joiner is served too, and every one that finishes has checked every chunk and
    tensor against the manifest."""
    names = ("f0", "f1", "f2", "f3")
    with Hosts(tmp_path, list(names), "aw") as hosts:
        hosts.publish_16mib({name: f"go-{name}" for name in names}, stall_s=2)
        for name in ("f0", "f1", "f2"):  # they ask in this order: a chain learner-f0-f1-f2
            (tmp_path / f"go-{name}").write_text("go\n")
            time.sleep(0.2)
        time.sleep(0.4)  # f2 is receiving from f1 now: the chain's pipeline is a few chunks deep
        hosts.kill("f1")
        (tmp_path / "go-f3").write_text("go\n")  # a joiner mid-transfer
        done = hosts.done(("f0", "f2", "f3"))
        assert "done" not in hosts.log("f1").read_text()
        assert done["f2"]["sources"][0] == "f1" and done["f2"]["sources"][-1] != "f1", done["f2"]
        assert all("verified" in d for d in done.values()), done


@pytest.mark.system
def test_a_relay_that_serves_slowly_is_routed_around(tmp_path):
    """A relay whose uplink falls to 5 Mbit/s (16 MiB would take 27 s through it) while it
    receives at 100 Mbit/s: the fetcher after it sees it serve far slower than it receives,
    gives it up after a few chunks and finishes from another source, in a fraction of the time
    the slow link needs; every chunk and tensor checked."""
    names = ("f0", "slow", "f2")
    with Hosts(tmp_path, list(names), "sl") as hosts:
        hosts.net.limit_uplink("slow", "5mbit")
        hosts.publish_16mib({name: f"go-{name}" for name in names}, stall_s=30)
        for name in names:  # they ask in this order: a chain learner-f0-slow-f2
            (tmp_path / f"go-{name}").write_text("go\n")
            time.sleep(0.2)
        done = hosts.done(("f0", "f2"))
        # the one before it, or the learner: the slow relay's own downloads crawl too (its
        # requests queue behind what it sends), so it may report f0 as slow in turn
        assert done["f2"]["sources"][0] == "slow" and len(done["f2"]["sources"]) == 2, done["f2"]
        assert done["f2"]["done"] - done["f2"]["started"] < 27 / 2, done["f2"]
        assert all("verified" in d for d in done.values()), done


@pytest.mark.system
def test_a_broker_killed_mid_transfer_does_not_stop_the_bytes(tmp_path):
    """The broker steers and the bytes flow around it: SIGKILLed while a chain of three fetchers
    is mid-version, and restarted on the same address, it stops no transfer: every fetcher
    finishes from the source it had, each chunk and tensor checked against the manifest."""
    names = ("f0", "f1", "f2")
    with Hosts(tmp_path, list(names), "bk") as hosts:
        hosts.publish_16mib(dict.fromkeys(names, "go-f"), stall_s=5)
        (tmp_path / "go-f").write_text("go\n")
        time.sleep(0.5)  # 16 MiB take 1.3 s a link: every fetcher is mid-version
        hosts.kill("broker")
        assert not any("done" in hosts.log(name).read_text() for name in names)
        hosts.start_broker("broker2.log")
        done = hosts.done(names)
        assert all("verified" in d for d in done.values()), done
        assert all(len(d["sources"]) == 1 for d in done.values()), done  # no source lost


def test_the_system_weights_bench_times_each_actor_to_the_version_or_a_newer_one(tmp_path):
    """bench.weights_system's reading of the roles' JSON logs: per version published after
    every actor was up, when each actor had loaded it or one that overtook it."""

    def line(event: str, second: float, **fields) -> str:
        stamp = f"2026-12-07T10:00:{second:06.3f}Z"
        return json.dumps({"event": event, "timestamp": stamp, **fields})

    learner = tmp_path / "learner.log"
    learner.write_text("\n".join(
        ["not json", *(line("published weights", 10.0 * v, version=v, bytes=100) for v in range(4))]
    ))  # fmt: skip
    loaded = lambda s, v, held=0.0: line(  # noqa: E731
        "weights loaded", s, version=v, transfer_s=0.5, rollouts_held_s=held
    )
    a0, a1 = tmp_path / "a0.log", tmp_path / "a1.log"
    a0.write_text("\n".join([loaded(1.0, 0), loaded(12.0, 1), loaded(21.5, 2, 0.25)]))
    a1.write_text("\n".join([loaded(5.0, 0), loaded(14.0, 1), loaded(33.0, 3)]))  # skips 2
    published = events(learner, "published weights")
    assert [e["version"] for e in published] == [0, 1, 2, 3]
    rows = per_version(published, [events(a0, "weights loaded"), events(a1, "weights loaded")])
    assert [r["version"] for r in rows] == [1, 2]  # v0 came before both were up; v3 a0 never had
    assert rows[0]["seconds_to_each"] == pytest.approx([2.0, 4.0])
    assert rows[1]["seconds_to_each"] == pytest.approx([1.5, 13.0]) and rows[1]["skipped_by"] == 1
    assert rows[1]["rollouts_held_s"] == [0.25, 0.0]
