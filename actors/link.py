"""The actor's link to the broker: the one module of ``actors/`` that speaks the protocol.

Three small jobs behind one socket (docs/protocol.md §8 *Actor*): permits before episodes, an
*adder* that streams finished segments out, and a *variable client* that brings newer weights in.
Every request survives broker restarts (``common.retry``); a broker that forgot the actor gets
its HELLO again, naming the permits still being played.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import structlog

from common.config import Config
from common.heartbeat import Heartbeat
from common.metrics import Health
from common.protocol import Message
from common.retry import call_with_retry
from common.trajectory import Segment
from common.transport import Client, Endpoint, TransportError
from common.weights import unpack_state_dict

log = structlog.get_logger()
HEARTBEAT_EVERY_S = 0.5  # an actor hears of a new version within this (HEARTBEAT_ACK)


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
        self.client = Client(
            Endpoint(cfg.security, cfg.broker.max_message_bytes),
            cfg.actor.broker,
            actor_id,
            timeout_s=cfg.actor.broker_timeout_s,
            interrupted=lambda: self.should_stop(),
        )
        self.latest = -1  # the newest version the broker announced
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
        log.info(
            "registered with the broker",
            latest_version=self.latest,
            heartbeat_s=self.heartbeat_s,
            max_staleness=reply.header["max_staleness"],
        )

    def _hello_header(self) -> dict[str, Any]:
        return {"role": "actor", "version": self.version(), "held_permits": self.held()}

    def register(self) -> None:
        """The first HELLO, retried until the broker takes it (``id_taken`` waits out the lease
        of a previous process under this id); then the heartbeat thread starts."""
        self._welcome(self.call("HELLO", self._hello_header()))
        # Liveness and news of versions from its own thread, whatever the loop is busy with.
        self.heartbeat = Heartbeat(
            self.client,
            lambda: min(HEARTBEAT_EVERY_S, self.heartbeat_s),
            header=lambda: {"version": self.version()},
            on_reply=self._announced,
        ).start()

    def hello(self) -> None:
        """Register again (the broker restarted, or reaped us); a failure is retried by the
        request that needed it."""
        try:
            self._welcome(self.client.request("HELLO", self._hello_header()))
        except TransportError as exc:
            log.warning("HELLO failed; will retry", error=str(exc))

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

    # -------------------------------------------------- the variable client
    def fetch_weights(self, have: int) -> tuple[dict, dict[str, Any]] | None:
        """The newest complete version if it is newer than ``have``: (manifest, tensors), chunks
        pipelined and every tensor's sha256 checked; None when there is none or it went away."""
        fetched = fetch_newer(self.client, self.call("WEIGHTS_INFO"), have)
        if fetched is not None:
            self.latest = max(self.latest, fetched[0]["version"])
        return fetched

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        with contextlib.suppress(TransportError):  # a gone broker reclaims by heartbeat timeout
            self.client.request("BYE", timeout_s=1.0, interruptible=False)
        self.client.close()


def fetch_newer(client: Client, info: Message, have: int) -> tuple[dict, dict[str, Any]] | None:
    """After a WEIGHTS_INFO reply ``info``: the version it names, if newer than ``have``, as
    (manifest, tensors), its chunks pipelined and every tensor's sha256 checked; None when there
    is none or it went away during the download. WEIGHTS_INFO/GET need no HELLO, so the
    evaluator uses this too."""
    if info.kind != "WEIGHTS_MANIFEST" or info.header["manifest"]["version"] <= have:
        return None
    manifest = info.header["manifest"]
    version = manifest["version"]
    try:
        chunks = client.pipeline(
            "WEIGHTS_GET",
            [{"version": version, "chunk": i} for i in range(len(manifest["chunks"]))],
        )
    except TransportError as exc:
        log.warning("weight download interrupted", version=version, error=str(exc))
        return None
    return manifest, unpack_state_dict(manifest, [m.tensors["data"] for m in chunks])
