"""The actors' link to the broker and to their peers: the one module of ``actors/`` that speaks
the protocol.

Three small jobs (docs/protocol.md §8 *Actor*): permits before episodes, an *adder* that streams
finished segments out, and a *variable client* (``WeightsClient``) that brings newer weights in:
the newest manifest from the broker, its chunks from the peers the broker names (§6.3), each
checked as it arrives and served on to the next actor at once, in a thread of its own while the
actor plays on. The evaluator uses the variable client alone, on a connection that registers
nothing. Every request survives broker restarts (``common.retry``); a broker that forgot the
actor gets its HELLO again, naming the permits still being played. Liveness is a heartbeat thread
on the same connection (``common.heartbeat``), whatever the actor's loop is busy with.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from common.config import Config
from common.heartbeat import Heartbeat
from common.metrics import Health
from common.peers import PeerServer, Source, fetch
from common.pieces import Pieces
from common.protocol import Message
from common.retry import call_with_retry
from common.trajectory import Segment
from common.transport import Client, Endpoint, TransportError

log = structlog.get_logger()
HEARTBEAT_EVERY_S = 0.5  # an actor hears of a new version within this (HEARTBEAT_ACK)


def broker_client(
    cfg: Config, client_id: str, interrupted: Callable[[], bool] = lambda: False
) -> Client:
    """A connection to ``actor.broker`` with the actor's security and timeout."""
    return Client(
        Endpoint(cfg.security, cfg.broker.max_message_bytes),
        cfg.actor.broker,
        client_id,
        timeout_s=cfg.actor.broker_timeout_s,
        interrupted=interrupted,
    )


class WeightsClient:
    """Versions in: WEIGHTS_INFO for the newest manifest (``info()``, with its caller's retry
    policy), WEIGHTS_WHERE for whom to fetch it from, the chunks from there (``common.peers``).
    With a ``server`` (this actor's chunk server) every chunk is served on the moment it is in.
    ``start`` fetches in a thread, so the actor plays on; ``take`` hands a finished version over
    once."""

    def __init__(
        self,
        cfg: Config,
        client: Client,
        info: Callable[[], Message],
        *,
        server: PeerServer | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        self.client, self.info, self.server, self.should_stop = client, info, server, should_stop
        self.stall_s = cfg.actor.weights_stall_s
        self.downloading: Pieces | None = None
        self.started_at = 0.0
        self._done: Pieces | None = None
        self._thread: threading.Thread | None = None

    def newest(self) -> dict | None:
        """The manifest of the newest complete version, None while there is none."""
        reply = self.info()
        return reply.header["manifest"] if reply.kind == "WEIGHTS_MANIFEST" else None

    def where(self, version: int, failed: list[str]) -> Source:
        """Whom to fetch ``version`` from (the broker's choice). Waits out ``no_source`` while
        ``version`` is the newest; raises ``TransportError`` once a newer one replaced it
        (``version_gone``, or ``no_source`` with a newer one out: a learner that died before
        anyone had its version, and restarted, publishes the next one and serves no other)."""

        def give_up_when_replaced(exc: TransportError) -> None:
            newest = self.newest() if exc.code == "no_source" else None
            if exc.code == "version_gone" or (newest and newest["version"] > version):
                raise TransportError(f"version {version} was replaced: {exc}", retryable=False)

        reply = call_with_retry(
            lambda: self.client.request("WEIGHTS_WHERE", {"version": version, "failed": failed}),
            what="WEIGHTS_WHERE",
            health=Health(),  # the fetching thread's waits are not the loop's
            should_stop=self.should_stop,
            prepare=give_up_when_replaced,
        )
        return Source(**reply.header["source"])

    def download(self, pieces: Pieces) -> Pieces | None:
        """Every chunk of ``pieces``' version, checked; None when it went away meanwhile (a newer
        one replaced it) or the actor is stopping."""
        if self.server is not None:
            self.server.offer(pieces)
        try:
            done = fetch(
                pieces, lambda failed: self.where(pieces.version, failed), self.client.endpoint,
                self.client.client_id, stall_s=self.stall_s, should_stop=self.should_stop,
            )  # fmt: skip
        except TransportError as exc:
            log.warning("weight download abandoned", version=pieces.version, error=str(exc))
            return None
        return pieces if done else None

    def fetch_newer(self, have: int) -> tuple[dict, dict[str, Any]] | None:
        """The newest version if it is newer than ``have``: (manifest, tensors), else None."""
        manifest = self.newest()
        if manifest is None or manifest["version"] <= have:
            return None
        pieces = self.download(Pieces(manifest))
        return None if pieces is None else (manifest, pieces.tensors())

    def start(self, manifest: dict) -> None:
        """Fetch ``manifest``'s version in a thread (unless one is being fetched)."""
        if self.busy():
            return
        self.started_at = time.monotonic()
        pieces = self.downloading = Pieces(manifest)

        def run() -> None:
            self._done = self.download(pieces)

        self._thread = threading.Thread(target=run, name="weights", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def take(self) -> Pieces | None:
        """A version whose download finished since the last call, once."""
        if self._thread is None or self._thread.is_alive():
            return None
        done, self._done, self._thread = self._done, None, None
        return done


class BrokerLink:
    """``version()`` is the engine's version (HEARTBEAT and HELLO report it, the former from the
    heartbeat thread), ``held()`` the permits still being played (HELLO reports them)."""

    def __init__(
        self,
        cfg: Config,
        actor_id: str,
        health: Health,
        *,
        version: Callable[[], int],
        held: Callable[[], list[str]],
    ):
        self.health, self.version, self.held = health, version, held
        self.should_stop: Callable[[], bool] = lambda: False
        self.client = broker_client(cfg, actor_id, lambda: self.should_stop())
        bind = cfg.actor.peer_bind
        self.server = PeerServer(self.client.endpoint, bind) if bind else None
        self.weights = WeightsClient(
            cfg, self.client, lambda: self.call("WEIGHTS_INFO"), server=self.server,
            should_stop=lambda: self.should_stop(),
        )  # fmt: skip
        self.latest = -1  # the newest version the broker announced
        self.max_staleness = 0  # η, as WELCOME says
        self.heartbeat_s = cfg.broker.heartbeat_timeout_s / 3  # until WELCOME says
        self.heartbeat: Heartbeat | None = None  # from the first WELCOME on

    def _announced(self, reply: Message) -> None:
        if "latest_version" in reply.header:
            self.latest = reply.header["latest_version"]

    def call(self, kind: str, header: dict | None = None, tensors: dict | None = None) -> Message:
        """A request that survives broker restarts: retry with backoff, re-HELLO when forgotten."""
        reply = call_with_retry(
            lambda: self.client.request(kind, header, tensors),
            what=kind,
            should_stop=self.should_stop,
            health=self.health,
            prepare=lambda exc: self.hello() if exc.code == "unknown_actor" else None,
        )
        self._announced(reply)
        return reply

    def _welcome(self, reply: Message) -> None:
        """WELCOME: the newest version, how often the broker needs to hear from us, and the
        staleness bound our episodes are held to (logged for the operator)."""
        self.latest = reply.header["latest_version"]
        self.heartbeat_s = reply.header["heartbeat_s"]
        self.max_staleness = reply.header["max_staleness"]
        log.info(
            "registered with the broker",
            latest_version=self.latest,
            heartbeat_s=self.heartbeat_s,
            max_staleness=reply.header["max_staleness"],
        )

    def _hello_header(self) -> dict[str, Any]:
        header = {"role": "actor", "version": self.version(), "held_permits": self.held()}
        return header | ({"peer_port": self.server.port} if self.server is not None else {})

    def register(self) -> None:
        """The first HELLO, retried until the broker takes it (``id_taken`` waits out the lease
        of a previous process under this id); then the heartbeat thread starts."""
        self._welcome(self.call("HELLO", self._hello_header()))
        self.heartbeat = Heartbeat(
            self.client,
            lambda: min(HEARTBEAT_EVERY_S, self.heartbeat_s),
            header=lambda: {"version": self.version()},
            on_reply=self._announced,
        ).start()

    def hello(self) -> None:
        """Register again (the broker restarted, or reaped us), or tell it which permits are
        still held (it frees the rest); a failure is retried by the request that needed it."""
        try:
            self._welcome(self.client.request("HELLO", self._hello_header()))
        except TransportError as exc:
            log.warning("HELLO failed; will retry", error=str(exc))

    def permits(self, n: int, group: int, version: int, *, wait: bool) -> Message:
        """PERMITS_REQ: PERMITS, or a WAIT saying why not."""
        return self.call("PERMITS_REQ", {"n": n, "version": version, "group": group, "wait": wait})

    # ------------------------------------------------------------ the adder
    def add(self, seg: Segment) -> str | None:
        """Stream one segment: None once the broker holds it, else why the broker will never
        take its episode (an error code, or the drop rule): the actor stops playing it."""
        try:
            reply = self.call("TRAJ", seg.header(), seg.arrays())
        except TransportError as exc:  # refused for good (unknown permit after a restart, ...)
            log.warning(
                "segment refused; abandoning its episode", traj_id=seg.traj_id, error=str(exc)
            )
            return exc.code
        dropped = reply.header.get("dropped")
        if dropped:
            log.info("episode dropped by the broker", traj_id=seg.traj_id, reason=dropped)
        return dropped

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.server is not None:
            self.server.close()
        with contextlib.suppress(TransportError):  # a gone broker reclaims by heartbeat timeout
            self.client.request("BYE", timeout_s=1.0, interruptible=False)
        self.client.close()
