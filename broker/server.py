"""The broker: one ROUTER socket, one thread, a loop of small handlers (docs/protocol.md).

Actors ask for permits, stream segments and fetch weights; the learner asks for batches and
publishes weights. The broker never blocks on anyone: a GET_BATCH that cannot be served yet is
parked and answered when enough whole episodes, in whole groups, are queued (or with WAIT after
``batch_wait_s``, naming what it waits for). Every rejection is an ERROR reply plus a counter,
and changes nothing.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import structlog
import zmq
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge

from broker.admission import Admission, Permit, restore_permit
from broker.directory import Directory, Peer
from broker.parked import ParkedPermits
from broker.queue import Dropped, EpisodeQueue
from broker.registry import Conn, Registry
from broker.spool import Durability
from common.config import Config
from common.log import bind_version
from common.metrics import Health
from common.protocol import (
    CLIENT_KINDS,
    Message,
    ProtocolError,
    decode,
    encode,
    error_frames,
    is_int,
    show,
)
from common.trajectory import Segment
from common.transport import Endpoint, send

log = structlog.get_logger()

M_RECEIVED = PromCounter(
    "asyncppo_broker_trajectories_received_total", "Trajectory segments received."
)
M_ACCEPTED = PromCounter(
    "asyncppo_broker_trajectories_accepted_total", "Segments accepted (acknowledged)."
)
M_REJECTED = PromCounter(
    "asyncppo_broker_trajectories_rejected_total", "Messages rejected, by reason.", ["reason"]
)
M_DROPPED = PromCounter(
    "asyncppo_broker_trajectories_dropped_total", "Accepted segments dropped by rule.", ["reason"]
)
M_HANDED = PromCounter(
    "asyncppo_broker_trajectories_handed_out_total", "Segments handed to the learner."
)
M_QUEUE_ITEMS = Gauge(
    "asyncppo_broker_queue_items", "Segments queued (complete and partial episodes)."
)
M_QUEUE_BYTES = Gauge("asyncppo_broker_queue_bytes", "Bytes of queued segments.")
M_PERMITS = PromCounter("asyncppo_broker_permits_granted_total", "Rollout permits granted.")
M_PERMITS_USE = Gauge(
    "asyncppo_broker_permits_in_use", "Permits granted whose episode is not complete."
)
M_ACTORS = Gauge("asyncppo_broker_actors_connected", "Actors seen within the heartbeat timeout.")
M_VERSION = Gauge("asyncppo_broker_policy_version", "Newest complete policy version.")
M_BYTES_IN = PromCounter("asyncppo_broker_bytes_received_total", "Bytes received on the socket.")
M_BYTES_OUT = PromCounter("asyncppo_broker_bytes_sent_total", "Bytes sent on the socket.")
M_SPOOL_ERRORS = PromCounter(
    "asyncppo_broker_spool_errors_total", "Spool writes that failed (disk full, permissions)."
)
M_INTERNAL = PromCounter(
    "asyncppo_broker_internal_errors_total",
    "Requests whose handling raised an unexpected exception (answered ERROR internal; served on).",
)
M_SOURCES = PromCounter(
    "asyncppo_broker_weight_sources_total",
    "Sources named to weight fetchers (WEIGHTS_WHERE), by whether one was reported failed.",
    ["after_failure"],
)

ACTOR_KINDS = {"PERMITS_REQ", "TRAJ", "HEARTBEAT"}  # a registered actor on its own connection
FREES_CAPACITY = {"GET_BATCH", "PUBLISH", "TRAJ", "BYE", "HELLO"}  # may end a permit wait
LEARNER_KINDS = {"GET_BATCH", "PUBLISH"}
NOT_INVALID = {  # not the sender's fault
    "busy",
    "no_source",
    "unknown_actor",
    "version_gone",
    "spool_error",
    "id_taken",
    "learner_taken",
    "actor_limit",
    "internal",
}
STAT_COUNTS = (
    "received",
    "accepted",
    "rejected_invalid",
    "dropped_stale",
    "dropped_incomplete_episode",
    "dropped_incomplete_group",
    "handed_out",
    "episodes_handed_out",
    "permits_reclaimed",
    "spool_errors",
)  # always present in STATS


def _nbytes(frames: list) -> int:
    return sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames)


def _count(head: dict[str, Any], key: str, *, default: int | None = None) -> int:
    """A header field that counts something: an int >= 1. Absent, it is ``default``, or
    ``missing_field`` when there is none; then ``bad_type`` and ``bad_value`` name the field."""
    if key not in head:
        if default is None:
            raise ProtocolError("missing_field", key, "required: an int >= 1")
        return default
    value = head[key]
    if not is_int(value):
        raise ProtocolError("bad_type", key, f"expected int, got {show(value)}")
    if value < 1:
        raise ProtocolError("bad_value", key, f"expected an int >= 1, got {value}")
    return value


MAX_FAILED = 64  # sources a WEIGHTS_WHERE may report at once


def _peer(head: dict[str, Any], client: str, conn: Conn, body: list) -> Peer | None:
    """The chunk server a HELLO announces (``peer_port``), at the address this connection comes
    from: peers are reached by address, never by host name. None when it serves none."""
    if "peer_port" not in head:
        return None
    port = head["peer_port"]
    if not 0 < port < 65536:
        raise ProtocolError("bad_value", "peer_port", f"expected a TCP port 1-65535, got {port}")
    ip = body[0].get("Peer-Address")
    if not ip:
        raise ProtocolError(
            "bad_value", "peer_port", "this connection has no IP address (not TCP) to serve from"
        )
    host = f"[{ip}]" if ":" in ip else ip
    return Peer(client, f"tcp://{host}:{port}", conn.key)


def _check_permits_req(head: dict[str, Any]) -> None:
    _count(head, "n")
    _count(head, "group", default=1)


class Broker:
    def __init__(self, cfg: Config, health: Health | None = None):
        self.cfg = cfg.broker
        self.health = health or Health()
        self.endpoint = Endpoint(cfg.security, cfg.broker.max_message_bytes)
        self.sock = self.endpoint.server(cfg.broker.bind)
        self.curve = cfg.security.curve
        self.registry = Registry(
            heartbeat_timeout_s=cfg.broker.heartbeat_timeout_s,
            learner_lease_s=cfg.broker.learner_lease_s,
            max_actors=cfg.broker.max_actors,
            key_roles=self.endpoint.key_roles if self.curve else None,
        )
        self.admission = Admission(
            batch_size=cfg.learner.batch_size,
            publish_every=cfg.learner.publish_every,
            max_staleness=cfg.broker.max_staleness,
        )
        self.weights = Directory(cfg.broker.weights_fanout)
        self.queue = EpisodeQueue(self.admission, self.cfg.max_queue_bytes)
        self.pending_batch: tuple[list, Message, float] | None = None
        self.parked_permits = ParkedPermits()
        self.batch_id = 0
        self.counts: Counter[str] = Counter(dict.fromkeys(STAT_COUNTS, 0))
        self.durable = Durability(self.cfg.spool_dir, self._spool_failed)
        if self.durable.spool is not None:
            self._restore()
        M_VERSION.set(self.weights.latest_version)
        bind_version(self.weights.latest_version)
        log.info(
            "broker listening",
            bind=self.cfg.bind,
            max_staleness=self.cfg.max_staleness,
            spool=self.cfg.spool_dir,
            curve=cfg.security.curve,
            version=self.weights.latest_version,
        )

    # ------------------------------------------------------------------ loop
    def run(self, should_stop: Any) -> None:
        """Serve until ``should_stop()`` is true."""
        self.health.ready = True
        while not should_stop():
            if self.sock.poll(50):
                for _ in range(512):
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.handle(frames)
            self.tick()
        self.close()

    def close(self) -> None:
        self._flush_state()
        self.sock.close(linger=0)
        self.endpoint.close()

    def tick(self) -> None:
        """Periodic work: reap silent actors, answer a parked GET_BATCH, export gauges, persist state."""
        for actor_id in self.registry.silent(time.monotonic()):
            self._forget_actor(actor_id, reason="actor_timeout")
        if self.pending_batch is not None:
            self._guarded("GET_BATCH", self.pending_batch[0], self._try_batch)
        self._guarded("PERMITS_REQ", None, self._serve_parked_permits)
        M_QUEUE_ITEMS.set(self.queue.num_segments)
        M_QUEUE_BYTES.set(self.queue.nbytes)
        M_PERMITS_USE.set(len(self.admission.in_flight))
        M_ACTORS.set(len(self.registry.actors))
        self.health.beat("messages")
        self._flush_state()

    def handle(self, frames: list) -> None:
        """One request: decode, dispatch, reply. Nothing a client sends can end the process: a
        handler that raises anything but ProtocolError is logged, counted and answered
        ``internal`` (not retryable), and the broker serves on."""
        envelope, body = frames[:1], frames[1:]
        M_BYTES_IN.inc(sum(f.buffer.nbytes for f in frames))
        msg = None
        try:
            msg = decode(body, max_bytes=self.cfg.max_message_bytes, kinds=CLIENT_KINDS)
            reply = self._dispatch(msg, self._conn(envelope, body), envelope, body)
        except ProtocolError as exc:
            self._count_reject(exc, msg)
            self._send(envelope, error_frames(exc, msg.req if msg else exc.req))
            return
        except Exception:
            self._internal_error(msg.kind if msg else None, envelope, msg.req if msg else 0)
            return
        if reply is not None:
            self._flush_state()  # write-ahead: what a reply announces (ACK, PERMITS) is on disk first
            self._send(envelope, reply)
        if self.parked_permits and msg.kind in FREES_CAPACITY:
            self._guarded("PERMITS_REQ", None, self._serve_parked_permits)

    def _internal_error(self, kind: str | None, envelope: list | None, req: int) -> None:
        """A bug, not bad input: log the traceback, count it, answer ERROR internal if we can."""
        M_INTERNAL.inc()
        log.exception("internal error while handling a request", kind=kind)
        exc = ProtocolError("internal", "kind", f"the broker failed handling {kind}; see its log")
        self._count_reject(exc, None)
        if envelope is not None:
            self._send(envelope, error_frames(exc, req))

    def _guarded(self, kind: str, envelope: list | None, work: Callable[[], None]) -> None:
        """Deferred work (a parked request answered on a tick): an exception is an internal error
        of that request, which is then dropped, never a crash of the loop."""
        try:
            work()
        except Exception:
            if kind == "GET_BATCH":
                self.pending_batch = None
            else:
                self.parked_permits.clear()
            self._internal_error(kind, envelope, 0)

    def _conn(self, envelope: list, body: list) -> Conn:
        """The connection a request came in on; under Curve, the client key ZAP authenticated."""
        key = body[0].get("User-Id") if self.curve else None
        return Conn(envelope[0].bytes, key)

    def _dispatch(self, msg: Message, conn: Conn, envelope: list, body: list) -> list | None:
        """Role and identity checks (docs/protocol.md §4), then the kind's handler."""
        client, now = msg.header["id"], time.monotonic()
        self.registry.touch(client, conn, now)
        learner = self.registry.is_learner(client, conn)
        if msg.kind in LEARNER_KINDS and not learner:
            raise ProtocolError(
                "not_learner",
                "id",
                f"{client!r} is not the registered learner on this connection; send HELLO",
                retryable=True,
            )
        if (msg.kind in ACTOR_KINDS and not (msg.kind == "HEARTBEAT" and learner)) or (
            msg.kind == "BYE" and client in self.registry.actors
        ):
            self.registry.check_actor(client, conn)
        if msg.kind == "HELLO":
            return self._on_hello(msg, conn, now, body)
        if msg.kind == "BYE":
            return self._on_bye(msg, conn)
        if msg.kind == "TRAJ":
            return self._on_traj(msg, body)
        if msg.kind == "GET_BATCH":  # parked until a batch is ready (or batch_wait_s passes)
            self._check_get_batch(msg.header)
            self.pending_batch = (envelope, msg, now + self.cfg.batch_wait_s)
            self._try_batch()
            return None
        if msg.kind == "PERMITS_REQ":  # parked while there is no capacity (or permits_wait_s)
            _check_permits_req(msg.header)  # before the version is recorded or parked
            self.registry.report(client, msg.header["version"])
            self.parked_permits.drop(client)
            reply = self._on_permits_req(msg)
            if reply is None and not msg.header.get("wait", True):
                return self._wait(msg, "capacity", 0.0)  # the actor has episodes to play meanwhile
            if reply is None:
                self.parked_permits.park(client, envelope, msg, now + self.cfg.permits_wait_s)
            return reply
        return self._handlers[msg.kind](self, msg)

    def _send(self, envelope: list, frames: list) -> None:
        try:
            send(self.sock, frames, envelope)
            M_BYTES_OUT.inc(_nbytes(frames))
        except zmq.ZMQError as exc:  # the peer vanished (ROUTER_MANDATORY): nothing to deliver to
            log.debug("reply undeliverable", error=str(exc))

    def _reply(
        self, msg: Message, kind: str, header: dict | None = None, tensors: dict | None = None
    ) -> list:
        return encode(kind, {"req": msg.req, **(header or {})}, tensors)

    def _count_reject(self, exc: ProtocolError, msg: Message | None) -> None:
        M_REJECTED.labels(reason=exc.code).inc()
        self.counts[f"rejected_{exc.code}"] += 1
        self.counts["rejected_invalid"] += exc.code not in NOT_INVALID
        self.durable.changed()
        log.warning(
            "rejected message",
            kind=msg.kind if msg else None,
            code=exc.code,
            field=exc.field,
            detail=exc.detail,
            client=msg.header.get("id") if msg else None,
        )

    # ------------------------------------------------------------ handlers
    def _on_hello(self, msg: Message, conn: Conn, now: float, body: list) -> list:
        head, client = msg.header, msg.header["id"]
        peer = _peer(head, client, conn, body)  # checked before anything changes
        if head["role"] == "learner":
            for key in ("batch_size", "publish_every"):
                _count(head, key)
            if self.registry.hello_learner(client, conn, now):
                self.pending_batch = None  # a replaced learner's parked GET_BATCH goes unanswered
            self.admission.configure(
                batch_size=head["batch_size"], publish_every=head["publish_every"]
            )
            self.registry.serves(client, peer)
            log.info(
                "learner connected",
                learner=client,
                version=head["version"],
                batch_size=head["batch_size"],
            )
        elif head["role"] == "actor":
            held = head.get("held_permits", [])
            if not isinstance(held, list) or not all(isinstance(p, str) for p in held):
                raise ProtocolError(
                    "bad_type", "held_permits", "expected an array of permit ids (str)"
                )
            if self.registry.hello_actor(client, conn, now):
                self.durable.changed()  # bindings are spooled
            self.registry.serves(client, peer)
            self.parked_permits.drop(client)  # the restarted actor no longer waits on it
            self._reclaim(client, keep=set(held), reason="actor_restart")
            log.info(
                "actor connected",
                actor=client,
                version=head["version"],
                actors=len(self.registry.actors),
            )
        else:
            raise ProtocolError(
                "bad_value", "role", f"expected 'actor' or 'learner', got {show(head['role'])}"
            )
        return self._reply(
            msg,
            "WELCOME",
            {
                "latest_version": self.weights.latest_version,
                "max_staleness": self.cfg.max_staleness,
                "heartbeat_s": self.cfg.heartbeat_timeout_s / 3,
            },
        )

    def _on_heartbeat(self, msg: Message) -> list:
        """Liveness (the dispatch refreshed it); an actor's engine version is recorded."""
        if msg.header["id"] in self.registry.actors:
            self.registry.report(msg.header["id"], msg.header["version"])
        return self._reply(msg, "HEARTBEAT_ACK", {"latest_version": self.weights.latest_version})

    def _on_bye(self, msg: Message, conn: Conn) -> list:
        """A clean departure: an actor's permits go back; the learner's role is free at once
        (and its chunk server is named no more)."""
        if self.registry.is_learner(msg.header["id"], conn):
            self.registry.release_learner()
            self.weights.forget(msg.header["id"])
            self.pending_batch = None
        else:
            self._forget_actor(msg.header["id"], reason="actor_left")
        return self._reply(msg, "OK")

    def _forget_actor(self, actor_id: str, reason: str) -> None:
        """The actor left or went silent: its permits are freed and nothing of it is kept."""
        self.registry.forget(actor_id)
        self.weights.forget(actor_id)
        self.parked_permits.drop(actor_id)
        self._reclaim(actor_id, reason=reason)

    def _wait(self, msg: Message, reason: str, retry_after_s: float) -> list:
        return self._reply(
            msg,
            "WAIT",
            {
                "reason": reason,
                "retry_after_s": retry_after_s,
                "latest_version": self.weights.latest_version,
            },
        )

    def _on_permits_req(self, msg: Message) -> list | None:
        """PERMITS or WAIT; None when only capacity is missing (the request is then parked)."""
        head, latest = msg.header, self.weights.latest_version
        if latest < 0:
            return self._wait(msg, "no_weights", 0.5)
        if not self.admission.playable(head["version"], latest):
            return self._wait(msg, "stale_weights", 0.0)
        if self.queue.nbytes > self.cfg.max_queue_bytes:
            return self._wait(msg, "queue_full", 0.5)
        group, n = head.get("group", 1), head["n"]
        if not head.get("wait", True):  # a busy actor topping up: at most its fair share
            n = min(n, self.admission.fair_share(head["id"], len(self.registry.actors), group))
        version = head["version"]  # the engine's: every token of the episode is at least that
        permits = self.admission.grant(head["id"], n, version, group=group) if n >= group else []
        if not permits:
            return None
        M_PERMITS.inc(len(permits))
        self.durable.changed()
        return self._reply(
            msg,
            "PERMITS",
            {
                "permits": [{"id": p.id, "version": p.version} for p in permits],
                "latest_version": latest,
            },
        )

    def _serve_parked_permits(self) -> None:
        """Answer parked PERMITS_REQs in arrival order while capacity lasts; past its deadline a
        request gets WAIT capacity (ask again at once: the next request is parked again)."""
        for envelope, reply in self.parked_permits.answers(
            self._on_permits_req, lambda msg: self._wait(msg, "capacity", 0.0), time.monotonic()
        ):
            self._flush_state()
            self._send(envelope, reply)

    def _check_get_batch(self, head: dict[str, Any]) -> None:
        _count(head, "n")
        if head["version"] > self.weights.latest_version:
            raise ProtocolError(
                "future_version",
                "version",
                f"version {head['version']} is newer than the latest "
                f"{self.weights.latest_version}: publish it first",
            )

    def _on_traj(self, msg: Message, body: list) -> list:
        M_RECEIVED.inc()
        self.counts["received"] += 1
        seg = Segment.from_wire(
            msg.header, msg.tensors, latest_version=self.weights.latest_version, frames=msg.frames
        )
        if seg.actor_id != msg.header["id"]:  # no client sends data under another actor's name
            raise ProtocolError(
                "actor_mismatch",
                "actor_id",
                f"{seg.actor_id!r} is not the sender {msg.header['id']!r}",
            )
        if self.queue.is_duplicate(seg):
            return self._reply(msg, "ACK", {"duplicate": True})
        admitted = self.queue.admit(seg, self.weights.latest_version)
        if isinstance(admitted, list):  # too stale: the episode (and its group) went
            self._dropped(admitted)
            return self._reply(msg, "ACK", {"dropped": "stale"})
        if not self.durable.save_segment(f"{admitted.id}.{seg.segment}", [f.bytes for f in body]):
            raise ProtocolError(
                "spool_error",
                "spool",
                "the broker could not store the segment; resend it later",
                retryable=True,
            )
        self.queue.accept(admitted, seg)
        self.durable.changed()  # the accepted counter moved, even when the episode goes on
        M_ACCEPTED.inc()
        self.counts["accepted"] += 1
        return self._reply(msg, "ACK")

    def _dropped(self, drops: list[Dropped]) -> None:
        """Episodes the queue discarded by rule: counted per segment, unspooled and logged."""
        for d in drops:
            for seg in d.accepted:
                self._unspool(d.permit, seg)
            M_DROPPED.labels(reason=d.reason).inc(len(d.segments))
            self.counts[f"dropped_{d.reason}"] += len(d.segments)
            self.durable.changed()
            log.info(
                "episode dropped",
                reason=d.reason,
                permit=d.permit.id,
                actor=d.permit.actor_id,
                segments=len(d.segments),
            )

    def _reclaim(
        self,
        actor_id: str,
        keep: set[str] | frozenset[str] = frozenset(),
        reason: str = "actor_timeout",
    ) -> None:
        permits, drops = self.queue.reclaim(actor_id, keep)
        self._dropped(drops)
        if permits:
            self.counts["permits_reclaimed"] += len(permits)
            self.durable.changed()
            log.warning("permits reclaimed", actor=actor_id, reason=reason, permits=len(permits))

    # -------------------------------------------------------------- learner
    def _try_batch(self) -> None:
        """Answer the parked GET_BATCH with the queue's next batch, or keep it parked (WAIT,
        saying what it waits for, once ``batch_wait_s`` has passed)."""
        envelope, msg, deadline = self.pending_batch  # type: ignore[misc]
        head = msg.header
        drops, batch = self.queue.take(head["version"], head["n"], head["publishes_after"])
        self._dropped(drops)
        if isinstance(batch, str):
            if time.monotonic() >= deadline:
                self.pending_batch = None
                self._send(envelope, self._wait(msg, batch, 0.0))
            return
        headers, tensors = [], {}
        for permit, segs in batch:
            for seg in segs:
                tensors.update(seg.wire_tensors(prefix=f"{len(headers)}."))
                headers.append(seg.header())
                self._unspool(permit, seg)
        self.batch_id += 1
        M_HANDED.inc(len(headers))
        self.counts["handed_out"] += len(headers)
        self.counts["episodes_handed_out"] += len(batch)
        self.durable.changed()
        self.pending_batch = None
        self._flush_state()
        self._send(
            envelope,
            self._reply(msg, "BATCH", {"batch_id": self.batch_id, "segments": headers}, tensors),
        )

    def _on_publish(self, msg: Message) -> list:
        """A new version: its manifest, served by the learner's chunk server (HELLO
        ``peer_port``). The broker never sees its bytes."""
        root = self.registry.peers.get(msg.header["id"])
        if root is None:
            raise ProtocolError(
                "no_peer_port", "peer_port",
                "the learner said no peer_port in its HELLO: nobody could fetch this version",
            )  # fmt: skip
        manifest = msg.header["manifest"]
        self.weights.publish(manifest, root)
        self.admission.published()
        self.durable.changed()
        M_VERSION.set(manifest["version"])
        bind_version(manifest["version"])
        log.info(
            "policy version published",
            version=manifest["version"],
            bytes=manifest["total_bytes"],
            chunks=len(manifest["chunks"]),
            source=root.address,
        )
        return self._reply(msg, "OK", {"version": manifest["version"]})

    # --------------------------------------------------------------- actors
    def _on_weights_info(self, msg: Message) -> list:
        latest = self.weights.latest
        if latest is None:
            return self._wait(msg, "no_weights", 0.5)
        return self._reply(msg, "WEIGHTS_MANIFEST", {"manifest": latest})

    def _on_weights_where(self, msg: Message) -> list:
        """Whom to fetch a version from (``broker.directory``); a registered actor with a chunk
        server joins the version's chain."""
        head, client = msg.header, msg.header["id"]
        failed = head.get("failed", [])
        if not all(isinstance(f, str) for f in failed) or len(failed) > MAX_FAILED:
            raise ProtocolError(
                "bad_value", "failed", f"expected at most {MAX_FAILED} peer ids (str)"
            )
        actors = self.registry.actors
        source = self.weights.source(
            head["version"],
            client,
            serves=self.registry.peers.get(client) if client in actors else None,
            failed=failed,
            alive=set(actors),
            holders={a for a, v in self.registry.versions.items() if v >= head["version"]},
        )
        M_SOURCES.labels(after_failure=str(bool(failed)).lower()).inc()
        return self._reply(
            msg, "WEIGHTS_SOURCE", {"version": head["version"], "source": source.wire()}
        )

    def _on_stats(self, msg: Message) -> list:
        return self._reply(msg, "STATS_REPLY", {"stats": self.stats()})

    def stats(self) -> dict[str, Any]:
        return {
            **self.counts,
            "policy_version": self.weights.latest_version,
            "actors": len(self.registry.actors),
            "permits_in_use": len(self.admission.in_flight),
            "permits_granted": self.admission.granted_total,
            "queued_episodes": len(self.queue.complete),
            "queue_bytes": self.queue.nbytes,
            "partial_episodes": len(self.queue.partial),
            "actor_versions": self.registry.listed_versions(),
        }

    # ----------------------------------------------------------- durability
    def _spool_failed(self) -> None:
        """A spool write or deletion failed (``Durability`` logged it)."""
        M_SPOOL_ERRORS.inc()
        self.counts["spool_errors"] += 1

    def _unspool(self, permit: Permit, seg: Segment) -> None:
        self.durable.forget(f"{permit.id}.{seg.segment}")

    def _flush_state(self) -> None:
        """Persist what changed (``Durability.flush``)."""
        self.durable.flush(
            lambda: {
                "admission": self.admission.state(),
                "queued": [vars(p) for p, _ in self.queue.complete.values()],  # their groups
                "counts": dict(self.counts),
                "batch_id": self.batch_id,
                "bindings": self.registry.bindings(),
                "weights": self.weights.state(),
            }
        )

    def _restore(self) -> None:
        """Reload weights, permits and acknowledged segments after a restart (kill -9 included)."""
        spool = self.durable.spool
        assert spool is not None
        state = spool.load_state() or {}
        self.weights.restore(state.get("weights"))
        if state:
            self.admission.restore(state["admission"])
            self.counts.update(state["counts"])
            self.batch_id = state["batch_id"]
        queued = {p["id"]: restore_permit(p) for p in state.get("queued", [])}
        restored = 0
        for _key, frames in spool.load_segments():
            msg = decode(frames, max_bytes=self.cfg.max_message_bytes)
            seg = Segment.from_wire(msg.header, msg.tensors)
            permit = self.admission.in_flight.get(seg.permit)
            if permit is None:  # its episode was complete at the last state flush
                permit = queued.get(seg.permit) or Permit(
                    seg.permit, seg.actor_id, seg.min_version, time.monotonic()
                )
                self.admission.readmit(permit)
            self.queue.accept(permit, seg)
            restored += 1
        bindings = state.get("bindings", {})
        for actor_id in {p.actor_id for p in self.admission.in_flight.values()}:
            self.registry.restore_actor(actor_id, time.monotonic(), bindings.get(actor_id))
        log.info(
            "broker state restored",
            segments=restored,
            episodes=len(self.queue.complete),
            permits=len(self.admission.in_flight),
            version=self.weights.latest_version,
        )

    _handlers: dict[str, Callable[[Broker, Message], list]] = {
        "HEARTBEAT": _on_heartbeat,
        "WEIGHTS_INFO": _on_weights_info,
        "WEIGHTS_WHERE": _on_weights_where,
        "PUBLISH": _on_publish,
        "STATS": _on_stats,
    }  # the kinds without a step of their own in _dispatch
