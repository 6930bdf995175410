"""Who is who on the broker: client ids bound to connections, liveness, and the learner role.

A client's ``id`` is a header string anyone can write, so it is bound to the ZeroMQ connection
(routing id) that registered it with HELLO: a request under that id from any other connection is
refused. Under Curve each connection also carries its client's public key, and a key may take only
the roles its allow-list grants. No I/O here: the broker asks, the registry answers or raises the
``ProtocolError`` that the broker sends back.

Takeover rule, the same for an actor id and for the learner role: a HELLO from another connection
takes the id over only once its holder has been silent for the lease (``heartbeat_timeout_s`` for
actors, ``learner_lease_s`` for the learner), or at once when both connections present the same
Curve key (the same principal, typically a restarted process). Reference clients keep their routing
id when they reopen a socket, so a reconnect is never a takeover.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from broker.directory import Peer
from common.protocol import ProtocolError

MAX_LISTED_ACTORS = 1000  # STATS names at most this many actors: the reply stays small


@dataclass(frozen=True)
class Conn:
    """The connection a request came in on: its routing id and, under Curve, its Z85 key."""

    routing_id: bytes
    key: str | None = None


@dataclass
class Holder:
    conn: Conn | None  # None: restored from the spool, not yet bound (the next HELLO binds it)
    seen: float  # monotonic time of its last message on its own connection


class Registry:
    def __init__(
        self,
        *,
        heartbeat_timeout_s: float,
        learner_lease_s: float,
        max_actors: int,
        key_roles: dict[str, frozenset[str]] | None = None,
    ):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.learner_lease_s = learner_lease_s
        self.max_actors = max_actors
        self.key_roles = key_roles  # None: no Curve, every connection may take every role
        self.actors: dict[str, Holder] = {}
        self.versions: dict[str, int] = {}  # actor id -> the version it last reported
        self.peers: dict[str, Peer] = {}  # client id -> the chunk server it announced
        self.learner_id: str | None = None
        self.learner: Holder | None = None

    # ------------------------------------------------------------------ roles
    def _allow(self, conn: Conn, role: str) -> None:
        if self.key_roles is not None and role not in self.key_roles.get(conn.key or "", ()):
            raise ProtocolError(
                "forbidden",
                "role",
                f"this connection's Curve key may not take the {role} role "
                f"(security.{'learner_keys_dir' if role == 'learner' else 'authorized_keys_dir'})",
            )

    def _may_take(self, holder: Holder, conn: Conn, lease_s: float, now: float) -> bool:
        return (
            holder.conn is None
            or holder.conn.routing_id == conn.routing_id
            or (conn.key is not None and conn.key == holder.conn.key)
            or now - holder.seen > lease_s
        )

    def hello_actor(self, client: str, conn: Conn, now: float) -> bool:
        """Register or re-register an actor on ``conn``; True when its binding changed."""
        self._allow(conn, "actor")
        if client == self.learner_id:
            raise ProtocolError("id_taken", "id", f"{client!r} is the learner's id", retryable=True)
        holder = self.actors.get(client)
        if holder is None:
            if len(self.actors) >= self.max_actors:
                raise ProtocolError(
                    "actor_limit",
                    "id",
                    f"{self.max_actors} actors are registered (broker.max_actors)",
                    retryable=True,
                )
        elif not self._may_take(holder, conn, self.heartbeat_timeout_s, now):
            raise ProtocolError(
                "id_taken",
                "id",
                f"actor {client!r} is registered on another connection; it is free once that "
                f"one has been silent {self.heartbeat_timeout_s:g} s",
                retryable=True,
            )
        self.actors[client] = Holder(conn, now)
        return holder is None or holder.conn != conn

    def hello_learner(self, client: str, conn: Conn, now: float) -> bool:
        """Take the learner role on ``conn``; True when it changed hands (a new learner)."""
        self._allow(conn, "learner")
        if client in self.actors:
            raise ProtocolError("id_taken", "id", f"{client!r} is an actor's id", retryable=True)
        if self.learner is not None and not self._may_take(
            self.learner, conn, self.learner_lease_s, now
        ):
            raise ProtocolError(
                "learner_taken",
                "role",
                f"the learner role is held by {self.learner_id!r} on another connection; it is "
                f"free once that one has been silent {self.learner_lease_s:g} s "
                "(broker.learner_lease_s)",
                retryable=True,
            )
        changed = self.learner is None or self.learner.conn != conn or self.learner_id != client
        self.learner_id, self.learner = client, Holder(conn, now)
        return changed

    # --------------------------------------------------------------- requests
    def touch(self, client: str, conn: Conn, now: float) -> None:
        """Any message on a client's own connection is liveness (weight downloads too)."""
        for holder in (
            self.actors.get(client),
            self.learner if client == self.learner_id else None,
        ):
            if holder is not None and holder.conn == conn:
                holder.seen = now

    def release_learner(self) -> None:
        """The learner left (BYE): the role is free for the next HELLO, at once."""
        if self.learner_id is not None:
            self.peers.pop(self.learner_id, None)
        self.learner_id, self.learner = None, None

    def is_learner(self, client: str, conn: Conn) -> bool:
        return self.learner is not None and client == self.learner_id and self.learner.conn == conn

    def check_actor(self, client: str, conn: Conn) -> None:
        """A request only a registered actor may send, on the connection that registered it."""
        holder = self.actors.get(client)
        if holder is None or holder.conn is None:
            raise ProtocolError(
                "unknown_actor",
                "id",
                f"actor {client!r} is not registered; send HELLO",
                retryable=True,
            )
        if holder.conn != conn:
            raise ProtocolError(
                "actor_mismatch",
                "id",
                f"actor {client!r} is registered on another connection",
            )

    def report(self, client: str, version: int) -> None:
        self.versions[client] = version

    def serves(self, client: str, peer: Peer | None) -> None:
        """The chunk server ``client``'s HELLO announced (None: it serves none)."""
        if peer is None:
            self.peers.pop(client, None)
        else:
            self.peers[client] = peer

    # -------------------------------------------------------------- lifetimes
    def bindings(self) -> dict[str, list]:
        """What the spool keeps: actor id -> [routing id (hex), Curve key or None]."""
        return {
            a: [h.conn.routing_id.hex(), h.conn.key]
            for a, h in self.actors.items()
            if h.conn is not None
        }

    def restore_actor(self, client: str, now: float, binding: list | None) -> None:
        """An actor that holds permits restored from the spool: alive, on the connection it had
        (reference clients reconnect with the same routing id), or bound by its next HELLO."""
        conn = Conn(bytes.fromhex(binding[0]), binding[1]) if binding else None
        self.actors.setdefault(client, Holder(conn, now))

    def forget(self, client: str) -> None:
        """The actor left (BYE) or timed out: nothing of it is kept."""
        self.actors.pop(client, None)
        self.versions.pop(client, None)
        self.peers.pop(client, None)

    def silent(self, now: float) -> list[str]:
        """Actors silent longer than ``heartbeat_timeout_s``: presumed dead."""
        return [a for a, h in self.actors.items() if now - h.seen > self.heartbeat_timeout_s]

    def listed_versions(self) -> dict[str, int]:
        """``actor_versions`` for STATS: at most ``MAX_LISTED_ACTORS`` entries, by id."""
        return dict(itertools.islice(sorted(self.versions.items()), MAX_LISTED_ACTORS))
