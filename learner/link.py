"""The learner's link to the broker: the one module of ``learner/`` that speaks the protocol.

The learner reads batches from a ``BatchSource`` and writes versions to a ``Publisher``; here
both are served by ``BrokerLink`` (rank 0's DEALER socket, docs/protocol.md §8 *Learner*), and
``share_batch`` hands rank 0's batch to every rank. Everything else in the learner is algorithm.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from typing import Protocol

import msgpack
import structlog
import torch
from prometheus_client import Counter

from common.config import Config
from common.heartbeat import Heartbeat
from common.metrics import Health
from common.peers import PeerServer
from common.pieces import Pieces
from common.protocol import Message, decode, encode
from common.retry import Backoff, call_with_retry
from common.trajectory import Segment
from common.transport import Client, Endpoint, TransportError
from learner.distributed import broadcast_bytes

log = structlog.get_logger()
M_IDLE = Counter("asyncppo_learner_idle_seconds_total", "Seconds spent waiting for batches.")


class BatchSource(Protocol):
    def next_batch(self, version: int, publishes_after: bool) -> Message | None:
        """The next batch of whole episodes for a learner at ``version`` (None once stopping)."""
        ...


class Publisher(Protocol):
    def publish(self, manifest: dict, chunks: list[memoryview]) -> None:
        """Make a version visible to the actors (whole, or not at all)."""
        ...


class BrokerLink:
    """Rank 0's requests to the broker, each retried through broker restarts (common.retry)."""

    def __init__(self, cfg: Config, health: Health, should_stop: Callable[[], bool]):
        self.lc, self.health, self.should_stop = cfg.learner, health, should_stop
        self.batch_timeout_s = cfg.learner.broker_timeout_s + cfg.broker.batch_wait_s
        endpoint = Endpoint(cfg.security, cfg.broker.max_message_bytes)
        # The chunks of what it publishes, served from here: the broker only steers.
        self.server = PeerServer(endpoint, cfg.learner.peer_bind)
        self.client = Client(
            endpoint,
            cfg.learner.broker,
            f"learner-{socket.gethostname()}-{os.getpid()}",
            timeout_s=cfg.learner.broker_timeout_s,
            interrupted=should_stop,
        )
        self.version = 0  # the version the learner trains (its HELLO and HEARTBEAT say so)
        # A long optimiser step or checkpoint must not cost the learner its role's lease: a
        # heartbeat thread from the first WELCOME on.
        self.heartbeat_s = cfg.broker.heartbeat_timeout_s / 3  # until WELCOME says
        self.heartbeat: Heartbeat | None = None
        # The last published version, one host copy of the policy (served to fetchers): a broker
        # that lost it (restarted without a spool) is told of it again.
        self.published: Pieces | None = None

    def _hello_once(self) -> int:
        """One HELLO as the learner; the broker's newest complete version, −1 if none."""
        header = {
            "role": "learner",
            "version": self.version,
            "batch_size": self.lc.batch_size,
            "publish_every": self.lc.publish_every,
            "peer_port": self.server.port,
        }
        welcome = self.client.request("HELLO", header).header
        self.heartbeat_s = welcome["heartbeat_s"]
        return welcome["latest_version"]

    def _rehello(self, exc: TransportError) -> None:
        if exc.code == "not_learner":  # the broker restarted, or the role lapsed
            self.reconnect()

    def reconnect(self) -> None:
        """HELLO again; a broker older than our last version (one restarted without a spool has
        none) gets those weights again, under the same version, never a lower one, so what
        actors already hold stays valid."""
        latest = self._hello_once()
        if self.published is not None and latest < self.published.version:
            log.warning(
                "broker lacks the current weights, publishing them again",
                version=self.version,
                broker_latest=latest,
            )
            self.publish(self.published.manifest, self.published.chunks)

    def _call(self, kind: str, header: dict, **kw: object) -> Message:
        return call_with_retry(
            lambda: self.client.request(kind, header, **kw),
            what=kind,
            should_stop=self.should_stop,
            health=self.health,
            prepare=self._rehello,
        )

    def hello(self, version: int) -> int:
        """Register as the learner (retrying), then keep the role's lease from the heartbeat
        thread; the broker's newest complete version."""
        self.version = version
        latest = call_with_retry(
            self._hello_once,
            what="HELLO",
            should_stop=self.should_stop,
            health=self.health,
        )
        if self.heartbeat is None:
            self.heartbeat = Heartbeat(
                self.client, lambda: self.heartbeat_s, header=lambda: {"version": self.version}
            ).start()
        return latest

    def publish(self, manifest: dict, chunks: list[memoryview]) -> None:
        """Serve the version's chunks from here, then PUBLISH its manifest: the broker makes it
        the latest and sends fetchers here (or to actors that already hold it).

        An interruption (timeout, ``not_learner``) starts it over after a HELLO; it is done
        once the broker has this version (say, only the reply was lost)."""
        self.published = Pieces(manifest, chunks)
        self.server.offer(self.published)
        version = self.version = manifest["version"]
        tries = 0

        def attempt() -> None:
            nonlocal tries
            tries += 1
            if tries > 1 and self._hello_once() >= version:
                return
            self.client.request("PUBLISH", {"manifest": manifest})

        try:
            call_with_retry(
                attempt,
                what=f"publish of version {version}",
                should_stop=self.should_stop,
                health=self.health,
                backoff=Backoff(first_s=0.5, max_s=0.5),
            )
        except TransportError:
            if not self.should_stop():
                raise
            # Stopping with the broker unreachable: retrying would keep the learner from its
            # final checkpoint for ever. The checkpoint holds these weights, and a restarted
            # learner publishes them (connect) under a version newer than any the broker has.
            log.warning("stopping: this version stays unpublished", version=version)

    def next_batch(self, version: int, publishes_after: bool) -> Message | None:
        """Ask until the broker has a batch (it answers WAIT, naming what it waits for)."""
        t0 = time.monotonic()
        header = {"version": version, "n": self.lc.batch_size, "publishes_after": publishes_after}
        try:
            while not self.should_stop():
                self.health.beat("batch from broker")
                reply = self._call("GET_BATCH", header, timeout_s=self.batch_timeout_s)
                if reply.kind == "BATCH":
                    return reply
                log.info("waiting for a batch", broker_says=reply.header["reason"])
            return None
        except TransportError:
            if not self.should_stop():
                raise
            return None  # stopping while the broker does not answer: on to the final checkpoint
        finally:
            M_IDLE.inc(time.monotonic() - t0)

    def hand_over(self, timeout_s: float) -> None:
        """Serve the last published version until an actor holds it (it serves it on: the
        evaluator and late actors fetch it there once this learner is gone), or no actor is
        registered, or ``timeout_s`` passed."""
        if self.published is None:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.should_stop():
            try:
                stats = self.client.request("STATS", timeout_s=5.0).header["stats"]
            except TransportError:
                return
            versions = stats["actor_versions"].values()
            if not stats["actors"] or any(v >= self.published.version for v in versions):
                return
            self.health.beat("handing the last version over to the actors")
            time.sleep(0.2)
        log.warning("no actor took the last version before the learner left",
                    version=self.published.version)  # fmt: skip

    def close(self) -> None:
        """BYE (the role is free at once, and fetchers are sent elsewhere), then the sockets."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        with contextlib.suppress(TransportError):  # a gone broker frees the role by its lease
            self.client.request("BYE", timeout_s=1.0, interruptible=False)
        self.server.close()
        self.client.close()


def share_batch(
    msg: Message | None, rank: int, world: int, device: torch.device | None = None
) -> list[Segment]:
    """Rank 0's batch on every rank, as its raw frames (never pickled), decoded and validated by
    the same wire decoder everywhere."""
    if world > 1:
        frames = [bytes(f) for f in encode("BATCH", msg.header, msg.tensors)] if msg else []
        payload = broadcast_bytes(
            msgpack.packb(frames, use_bin_type=True) if frames else b"", rank, device
        )
        msg = decode(msgpack.unpackb(payload, raw=False)) if payload else None
    if msg is None:
        return []
    return [
        Segment.from_wire(h, msg.tensors, prefix=f"{i}.")
        for i, h in enumerate(msg.header["segments"])
    ]
