"""Real ZeroMQ peers of the broker: the scripted actor and learner of the tests and bench/broker.

They talk through ``common.transport.Client``, the code the real roles use, but need no model:
segments come from ``testkit.segments`` and weights are random tensors packed by
``common.weights.pack_state_dict``. ``BrokerProcess`` runs the real ``asyncppo broker`` in its own
process, so a test can kill -9 it and start it again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from common.config import BrokerConfig, SecurityConfig
from common.lifecycle import spawn
from common.peers import PeerServer, Source, fetch
from common.pieces import Pieces
from common.protocol import PROTO, Message, ProtocolError, decode
from common.trajectory import ARRAYS, Segment
from common.transport import Client, Endpoint, TransportError, free_port, send
from common.weights import pack_state_dict
from testkit.segments import make_segment, segment_digest, synthetic_weights, turns

ROOT = Path(__file__).resolve().parents[1]
MAX_MESSAGE_BYTES = BrokerConfig().max_message_bytes
# Wire bytes per token: one entry of each of the segment's arrays (tokens, mask, log-probs, ...).
BYTES_PER_TOKEN = sum(dtype.itemsize for dtype in ARRAYS.values())


class BrokerProcess:
    """``asyncppo broker`` in its own process group, on a port that survives a restart.

    ``settings`` are ``--set`` overrides (``{"broker.max_staleness": 0}``); ``security`` is what
    clients need to reach it, used to wait until it answers.
    """

    def __init__(
        self,
        log: Path,
        settings: dict[str, Any] | None = None,
        *,
        security: SecurityConfig | None = None,
    ):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.log = log
        self.settings = {
            "broker.bind": self.address,
            "run.out_dir": str(log.parent),
            **(settings or {}),
        }
        self.security = security or SecurityConfig()
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> dict:
        """Start the broker and wait until it answers STATS; returns those stats."""
        overrides = [
            arg for key, value in self.settings.items() for arg in ("--set", f"{key}={value}")
        ]
        with open(self.log, "ab") as out:
            self.proc = spawn(
                [sys.executable, "-m", "deploy.cli", "broker", *overrides],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        probe = Peer(self.address, "probe", security=self.security, timeout_s=1.0)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"broker exited with {self.proc.returncode}: {self.log_tail()}"
                    )
                try:
                    return probe.stats()
                except TransportError:
                    continue
            raise TimeoutError(f"broker at {self.address} did not answer in {timeout_s} s")
        finally:
            probe.close()

    def kill(self) -> None:
        """kill -9: no handler runs and nothing is flushed."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def terminate(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, as an operator or Kubernetes stops it; returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def rss_bytes(self) -> int:
        """Resident memory of the broker process now."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # reported in kB
        raise RuntimeError(f"no VmRSS for pid {self.proc.pid}")

    def log_tail(self, nbytes: int = 3000) -> str:
        return self.log.read_bytes()[-nbytes:].decode(errors="replace")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()

    def __enter__(self) -> BrokerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fetch_chunks(peer: Peer, manifest: dict, stall_s: float = 5.0) -> list:
    """Every chunk of a version, from the peers the broker names (``common.peers.fetch``: each
    chunk's sha256 checked against the manifest as it arrives)."""
    pieces = Pieces(manifest)
    done = fetch(pieces, lambda failed: peer.source(manifest["version"], failed),
                 peer.client.endpoint, peer.id, stall_s=stall_s)  # fmt: skip
    assert done
    return pieces.chunks


class Peer:
    """One broker client (a DEALER through ``common.transport.Client``)."""

    def __init__(
        self,
        address: str,
        client_id: str,
        *,
        security: SecurityConfig | None = None,
        timeout_s: float = 5.0,
    ):
        self.id = client_id
        endpoint = Endpoint(security or SecurityConfig(), MAX_MESSAGE_BYTES)
        self.client = Client(endpoint, address, client_id, timeout_s=timeout_s)

    def request(
        self,
        kind: str,
        header: dict[str, Any] | None = None,
        tensors: dict[str, np.ndarray] | None = None,
        **kw: Any,
    ) -> Message:
        return self.client.request(kind, header, tensors, **kw)

    def stats(self) -> dict[str, Any]:
        return self.request("STATS").header["stats"]

    def source(self, version: int, failed: list[str] | None = None) -> Source:
        """Whom the broker says to fetch ``version`` from (WEIGHTS_WHERE)."""
        reply = self.request("WEIGHTS_WHERE", {"version": version, "failed": failed or []})
        return Source(**reply.header["source"])

    def submit(self, kind: str, header: dict[str, Any] | None = None) -> int:
        """Send a request without waiting (say, one the broker parks); its ``req``."""
        return self.client.send_request(kind, header, None)

    def reply_to(self, req: int, kind: str, timeout_s: float = 5.0) -> Message:
        """The reply to a request sent with ``submit``."""
        return self.client.recv_reply(kind, {req}, time.monotonic() + timeout_s)

    def send_raw(self, frames: list, timeout_s: float = 5.0) -> Message | None:
        """Send frames exactly as given (malformed on purpose); the decoded reply, or None."""
        send(self.client.sock, frames)
        if not self.client.sock.poll(int(timeout_s * 1000)):
            self.client.reopen()  # a late reply must not be taken for the next request's
            return None
        reply = self.client.sock.recv_multipart(copy=False)
        try:
            return decode(reply)
        except ProtocolError as exc:  # the answer to a message of an earlier protocol version
            if exc.code != "bad_proto":
                raise
            header = msgpack.unpackb(reply[0].bytes)
            assert header["proto"] < PROTO and header["kind"] == "ERROR", header
            return Message(header["kind"], header)

    def close(self) -> None:
        self.client.close()


class ScriptedActor(Peer):
    """An actor without a model: HELLO, weight download, permits and valid synthetic segments."""

    def __init__(self, address: str, actor_id: str, *, num_tokens: int = 64, **kw: Any):
        super().__init__(address, actor_id, **kw)
        self.version = -1
        self.num_tokens = num_tokens
        self.episodes = 0

    def hello(self, held: list[str] | tuple[str, ...] = ()) -> int:
        header = {"role": "actor", "version": self.version, "held_permits": list(held)}
        return self.request("HELLO", header).header["latest_version"]

    def heartbeat(self) -> int:
        return self.request("HEARTBEAT", {"version": self.version}).header["latest_version"]

    def sync_weights(self) -> int:
        """Download the newest version if it is newer than ours, as a real actor does."""
        reply = self.request("WEIGHTS_INFO")
        if reply.kind == "WEIGHTS_MANIFEST" and reply.header["manifest"]["version"] > self.version:
            fetch_chunks(self, reply.header["manifest"])
            self.version = reply.header["manifest"]["version"]
        return self.version

    def permits(self, n: int, group: int = 1) -> list[str]:
        """Up to n permit ids (in whole groups of ``group``); on WAIT, sync weights or back off as
        the broker says, and get none."""
        reply = self.request("PERMITS_REQ", {"n": n, "version": self.version, "group": group})
        if reply.kind == "PERMITS":
            return [p["id"] for p in reply.header["permits"]]
        if reply.header["reason"] == "stale_weights":
            self.sync_weights()
        else:
            time.sleep(reply.header["retry_after_s"])
        return []

    def send_segment(
        self,
        permit: str,
        episode_id: str,
        index: int,
        *,
        last: bool,
        group_id: str | None = None,
        on_send: Callable[[Segment], None] | None = None,
    ) -> Segment:
        """Build one segment at our current version and send it; returns it once acknowledged.
        ``on_send`` sees the segment once it is built, right before it goes out."""
        seg = make_segment(
            turns(self.num_tokens),
            permit=permit,
            actor_id=self.id,
            episode_id=episode_id,
            index=index,
            last=last,
            version=self.version,
            seed=self.episodes * 1000 + index,
            group_id=group_id,
        )
        if on_send is not None:
            on_send(seg)
        self.request("TRAJ", seg.header(), seg.arrays())
        return seg

    def play(
        self,
        permit: str,
        segments: int = 2,
        *,
        finish: bool = True,
        pause_s: float = 0.0,
        group_id: str | None = None,
        on_send: Callable[[Segment], None] | None = None,
    ) -> list[Segment]:
        """One episode under ``permit``, each segment sent when done (``pause_s`` of "generation"
        before each); weights are swapped between segments when the broker has newer ones, so an
        episode may straddle versions. ``finish=False`` leaves it without its ``last`` segment."""
        episode_id = f"{self.id}.e{self.episodes}"
        self.episodes += 1
        sent = []
        for index in range(segments):
            time.sleep(pause_s)
            if self.heartbeat() > self.version:
                self.sync_weights()
            last = finish and index == segments - 1
            sent.append(
                self.send_segment(
                    permit, episode_id, index, last=last, group_id=group_id, on_send=on_send
                )
            )
        return sent


class ScriptedLearner(Peer):
    """A learner without a model: HELLO, publishing synthetic weights (served from its own chunk
    server, as the learner does), pulling batches."""

    def __init__(self, address: str, client_id: str, **kw: Any):
        super().__init__(address, client_id, **kw)
        self.server = PeerServer(self.client.endpoint, "tcp://127.0.0.1:0")

    def hello(self, batch_size: int, publish_every: int = 1, version: int = 0) -> int:
        header = {
            "role": "learner",
            "version": version,
            "batch_size": batch_size,
            "publish_every": publish_every,
            "peer_port": self.server.port,
        }
        return self.request("HELLO", header).header["latest_version"]

    def close(self) -> None:
        super().close()
        self.server.close()

    def send_weights(self, manifest: dict, chunks: list[memoryview]) -> None:
        """Serve the chunks, then PUBLISH the manifest: the version is visible from then on."""
        self.server.offer(Pieces(manifest, chunks))
        self.request("PUBLISH", {"manifest": manifest})

    def publish(
        self, version: int, nbytes: int = 4096, chunk_bytes: int = 1024
    ) -> tuple[dict, list[memoryview]]:
        """Pack synthetic weights of ``nbytes`` as the learner packs its state dict, and send them."""
        manifest, chunks = pack_state_dict(synthetic_weights(nbytes, version), version, chunk_bytes)
        self.send_weights(manifest, chunks)
        return manifest, chunks

    def get_batch(
        self, version: int, n: int, *, publishes_after: bool = True
    ) -> list[Segment] | None:
        """The next batch of n whole episodes as validated segments, or None when told to WAIT."""
        header = {"version": version, "n": n, "publishes_after": publishes_after}
        reply = self.request("GET_BATCH", header)
        if reply.kind == "WAIT":
            return None
        return [
            Segment.from_wire(h, reply.tensors, prefix=f"{i}.")
            for i, h in enumerate(reply.header["segments"])
        ]


def hold_permits_until_killed(
    address: str, actor_id: str, n: int, heartbeat_s: float, report: Any
) -> None:
    """Child process: start n episodes (first segment each), report the permits, then keep
    heartbeating mid-episode until someone kills the process."""
    actor = ScriptedActor(address, actor_id)
    actor.hello()
    actor.sync_weights()
    permits = actor.permits(n)
    for permit in permits:
        actor.send_segment(permit, f"{actor_id}.{permit}", 0, last=False)
    report.put(permits)
    while True:
        actor.heartbeat()
        time.sleep(heartbeat_s)


def stream_episodes_until_killed(
    address: str, actor_id: str, num_tokens: int, segments: int, sent: Any
) -> None:
    """Child process: play episodes of ``segments`` segments of ``num_tokens`` tokens back to back
    until someone kills the process. Right before each segment goes out, its ``(traj_id, digest)``
    goes down the pipe ``sent``, so the parent can kill it while a given segment is on the wire,
    and check whatever arrived against what was sent."""
    actor = ScriptedActor(address, actor_id, num_tokens=num_tokens)
    actor.hello()
    actor.sync_weights()
    while True:
        for permit in actor.permits(1):
            actor.play(
                permit, segments, on_send=lambda seg: sent.send((seg.traj_id, segment_digest(seg)))
            )
