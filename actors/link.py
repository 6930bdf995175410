"""The actors' link to the broker: the one module of ``actors/`` that speaks the protocol.

Three small jobs (docs/protocol.md §8 *Actor*): permits before episodes, an *adder* that streams
finished segments out, and a *variable client* (``WeightsClient``) that brings newer weights in;
the evaluator uses the variable client alone, on a connection that registers nothing. Every
request survives broker restarts (``common.retry``); a broker that forgot the actor gets its
HELLO again, naming the permits still being played. Liveness is a heartbeat thread on the same
connection (``common.heartbeat``), whatever the actor's loop is busy with.
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
    """WEIGHTS_INFO and WEIGHTS_GET, which need no HELLO. ``info()`` sends the WEIGHTS_INFO (with
    its caller's retry policy); chunks are pipelined and every tensor's sha256 checked."""

    def __init__(self, client: Client, info: Callable[[], Message]) -> None:
        self.client, self.info = client, info

    def newest(self) -> dict | None:
        """The manifest of the newest complete version, None while there is none."""
        reply = self.info()
        return reply.header["manifest"] if reply.kind == "WEIGHTS_MANIFEST" else None

    def download(self, manifest: dict) -> dict[str, Any] | None:
        """The version's tensors, None when it went away during the download (a newer one
        replaced it) or the download was interrupted."""
        version = manifest["version"]
        try:
            chunks = self.client.pipeline(
                "WEIGHTS_GET",
                [{"version": version, "chunk": i} for i in range(len(manifest["chunks"]))],
            )
        except TransportError as exc:
            log.warning("weight download interrupted", version=version, error=str(exc))
            return None
        return unpack_state_dict(manifest, [m.tensors["data"] for m in chunks])

    def fetch_newer(self, have: int) -> tuple[dict, dict[str, Any]] | None:
        """The newest version if it is newer than ``have``: (manifest, tensors), else None."""
        manifest = self.newest()
        if manifest is None or manifest["version"] <= have:
            return None
        tensors = self.download(manifest)
        return None if tensors is None else (manifest, tensors)


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
        self.weights = WeightsClient(self.client, lambda: self.call("WEIGHTS_INFO"))
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

    # -------------------------------------------------- the variable client
    def fetch_weights(self, have: int) -> tuple[dict, dict[str, Any]] | None:
        """The newest complete version if it is newer than ``have`` (``WeightsClient``)."""
        fetched = self.weights.fetch_newer(have)
        if fetched is not None:
            self.latest = max(self.latest, fetched[0]["version"])
        return fetched

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        with contextlib.suppress(TransportError):  # a gone broker reclaims by heartbeat timeout
            self.client.request("BYE", timeout_s=1.0, interruptible=False)
        self.client.close()
