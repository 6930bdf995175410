"""ZeroMQ transport: the only module that touches sockets. The rest of the code sees Messages.

One ROUTER on the broker; every actor and learner is a DEALER client that sends requests tagged
with a ``req`` number and matches replies to them. Every socket gets ``linger=0`` (no hang on
exit), ``ZMQ_MAXMSGSIZE`` (no unbounded allocation from the network) and, when configured, Curve
encryption with an allow-list enforced by a ZAP authenticator.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import zmq
import zmq.auth

from common.config import SecurityConfig
from common.protocol import Message, ProtocolError, decode, encode

ZERO_COPY_BYTES = 64 << 10  # frames above this go out with copy=False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (for local launches and tests; racy by nature)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TransportError(RuntimeError):
    """The peer did not answer in time or answered with an ERROR."""

    def __init__(self, message: str, *, code: str = "timeout", retryable: bool = True):
        super().__init__(message)
        self.code = code
        self.retryable = retryable


def _public_key(path: str | None, what: str) -> bytes:
    if not path or not Path(path).is_file():
        raise FileNotFoundError(f"{what}: public key file {path!r} does not exist")
    return zmq.auth.load_certificate(path)[0]


def _keypair(path: str | None, what: str) -> tuple[bytes, bytes]:
    if not path or not Path(path).is_file():
        raise FileNotFoundError(f"{what}: secret key file {path!r} does not exist")
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{what}: {path!r} holds no secret key (use the .key_secret file)")
    return public, secret


def generate_keys(out_dir: str | Path, name: str) -> tuple[Path, Path]:
    """A Curve key pair: NAME.key (public, share it) and NAME.key_secret (keep it)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(out), name)
    return Path(public), Path(secret)


def load_key_roles(security: SecurityConfig) -> dict[str, frozenset[str]]:
    """Z85 public key -> the roles it may take: ``actor`` from ``authorized_keys_dir``,
    ``learner`` from ``learner_keys_dir`` (a key in both may take either)."""
    roles: dict[str, set[str]] = {}
    for role, key in (("actor", "authorized_keys_dir"), ("learner", "learner_keys_dir")):
        keys_dir = getattr(security, key)
        if not keys_dir or not Path(keys_dir).is_dir():
            raise FileNotFoundError(
                f"security.{key} {keys_dir!r} is not a directory (curve needs the public keys of "
                f"the {role}s there: asyncppo keys generate)"
            )
        for public in zmq.auth.load_certificates(str(keys_dir)):
            roles.setdefault(public.decode("ascii"), set()).add(role)
    return {key: frozenset(r) for key, r in roles.items()}


class _Zap:
    """The process's ZAP handler, shared by every Curve server socket of the context (the
    broker's ROUTER, a chunk server): the union of their allow-lists, stopped with the last."""

    def __init__(self) -> None:
        self.auth = None
        self.users: list[dict[str, frozenset[str]]] = []
        self.lock = threading.Lock()

    def join(self, ctx: zmq.Context, key_roles: dict[str, frozenset[str]]) -> object:
        from zmq.auth.thread import ThreadAuthenticator

        with self.lock:
            if self.auth is None:
                self.auth = ThreadAuthenticator(ctx)
                self.auth.start()
                self.auth.configure_curve_callback(domain="*", credentials_provider=self)
            self.users.append(key_roles)
            return self.auth

    def leave(self, key_roles: dict[str, frozenset[str]]) -> None:
        with self.lock:
            self.users.remove(key_roles)
            if not self.users and self.auth is not None:
                self.auth.stop()
                self.auth = None

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: a client key may connect when some allow-list has it (``key`` is Z85)."""
        z85 = key.decode("ascii", "replace")
        return any(z85 in roles for roles in self.users)


_ZAP = _Zap()


def new_routing_id() -> bytes:
    """A random routing id (libzmq reserves ids that start with a zero byte)."""
    return bytes([secrets.randbelow(255) + 1]) + secrets.token_bytes(15)


class Endpoint:
    """Owns the process's ZeroMQ context and the Curve authenticator, and makes configured sockets."""

    def __init__(self, security: SecurityConfig, max_message_bytes: int):
        self.ctx = zmq.Context.instance()
        self.security = security
        self.max_message_bytes = max_message_bytes
        self.key_roles: dict[str, frozenset[str]] = {}  # Z85 client key -> roles it may take
        self._auth = None

    def socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.setsockopt(zmq.RCVHWM, 10000)
        return sock

    def server(self, bind: str) -> zmq.Socket:
        """The broker's ROUTER, with Curve server keys and per-role allow-lists when curve is on.

        ``ROUTER_HANDOVER``: a connection that presents a routing id already in use takes it over.
        Reference clients pick a random 16-byte routing id per process and keep it when they
        reopen their socket, so the broker's binding of a client id to its connection survives
        the reopen; nobody else can present that id without knowing it.
        """
        sock = self.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer raises, not vanishes
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self.security.curve:
            self._authenticate()
            public, secret = _keypair(
                self.security.server_secret_key_file, "security.server_secret_key_file"
            )
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_server = True
        sock.bind(bind)
        return sock

    def peer_server(self, bind: str) -> tuple[zmq.Socket, int, str | None]:
        """A ROUTER that serves weight chunks to peers (``common.peers``): the socket, the port
        it got, and its Curve public key (Z85) under Curve, where it is a Curve server with this
        node's own key pair that admits the keys of both allow-lists (actors and learner)."""
        sock = self.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        key = None
        if self.security.curve:
            self._authenticate()
            public, secret = _keypair(
                self.security.client_secret_key_file, "security.client_secret_key_file"
            )
            sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
            key = public.decode("ascii")
        sock.bind(bind)
        port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        return sock, port, key

    def _authenticate(self) -> None:
        """Admit this endpoint's allow-lists to the process's one ZAP handler (libzmq has one
        per context): a key may connect when some role's allow-list has it."""
        if self._auth is not None:
            return
        self.key_roles = load_key_roles(self.security)
        self._auth = _ZAP.join(self.ctx, self.key_roles)

    def client(
        self, connect: str, routing_id: bytes | None = None, server_key: str | None = None
    ) -> zmq.Socket:
        """A DEALER to the broker, or with ``server_key`` (Z85) to a peer's chunk server."""
        sock = self.socket(zmq.DEALER)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if self.security.curve:
            public, secret = _keypair(
                self.security.client_secret_key_file, "security.client_secret_key_file"
            )
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_serverkey = (
                server_key.encode("ascii")
                if server_key is not None
                else _public_key(
                    self.security.server_public_key_file, "security.server_public_key_file"
                )
            )
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)  # exponential backoff up to 5 s
        sock.connect(connect)
        return sock

    def close(self) -> None:
        if self._auth is not None:
            _ZAP.leave(self.key_roles)
            self._auth = None


def send(sock: zmq.Socket, frames: list, envelope: list | None = None) -> None:
    """Send frames; large buffers and received frames go zero-copy."""
    frames = (envelope or []) + frames
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        if isinstance(frame, zmq.Frame):  # a received frame sent on: libzmq shares its buffer
            copy = False
        else:
            copy = (frame.nbytes if isinstance(frame, memoryview) else len(frame)) < ZERO_COPY_BYTES
        sock.send(frame, zmq.SNDMORE if i < last else 0, copy=copy)


class Client:
    """A DEALER that does request/reply with timeouts, and reopens its socket after a timeout.

    Reopening (the "lazy pirate" pattern) discards replies to abandoned requests. The socket
    keeps its routing id, so the broker still knows the connection as the one that registered
    this client's id (docs/protocol.md, Identity).

    Two threads may use one client: each request (or pipeline) holds the client's lock from its
    first send to its last reply, so a ``Heartbeat`` thread shares the connection, and the
    identity bound to it, with the role's loop. Once ``interrupted()`` (a role's stop flag), a
    wait lasts at most ``STOPPING_S`` more: a live broker still answers what is in flight (the
    learner's last version gets published), one that is gone does not hold a stopping role up.
    """

    POLL_S = 0.1  # how often a wait looks at interrupted()
    STOPPING_S = 2.0

    def __init__(
        self,
        endpoint: Endpoint,
        connect: str,
        client_id: str,
        *,
        timeout_s: float = 10.0,
        interrupted: Callable[[], bool] = lambda: False,
        server_key: str | None = None,
    ):
        self.endpoint = endpoint
        self.connect = connect
        self.server_key = server_key  # a peer's Curve key (Z85); None: the broker's
        self.client_id = client_id
        self.timeout_s = timeout_s
        self.interrupted = interrupted
        self.lock = threading.Lock()
        self._req = 0
        self.routing_id = new_routing_id()  # kept across reopen: the broker binds our id to it
        self.sock = self._open()

    def _open(self) -> zmq.Socket:
        sock = self.endpoint.client(self.connect, self.routing_id, self.server_key)
        # A DEALER with no live connection (a broker that refused our Curve handshake, one that
        # is gone) blocks on send; bounded, the request times out like a missing reply.
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.timeout_s * 1000)))
        return sock

    def reopen(self) -> None:
        self.sock.close(linger=0)
        self.sock = self._open()

    def send_request(
        self, kind: str, header: dict[str, Any] | None, tensors: dict[str, np.ndarray] | None
    ) -> int:
        self._req += 1
        try:
            send(
                self.sock,
                encode(kind, {**(header or {}), "id": self.client_id, "req": self._req}, tensors),
            )
        except zmq.Again:
            self.reopen()
            raise TransportError(f"{kind}: could not send to {self.connect} in time") from None
        return self._req

    def recv_reply(
        self, kind: str, wanted: set[int], deadline: float, *, interruptible: bool = True
    ) -> Message:
        """The next reply whose req is in ``wanted``; replies to abandoned requests are skipped."""
        stopping = False
        while True:
            if interruptible and not stopping and self.interrupted():
                stopping, deadline = True, min(deadline, time.monotonic() + self.STOPPING_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.reopen()  # a reply still on its way must not be read as another's
                if stopping:
                    raise TransportError(
                        f"{kind}: no reply from {self.connect} while stopping",
                        code="interrupted",
                        retryable=False,
                    )
                raise TransportError(f"{kind}: no reply from {self.connect} in time")
            if not self.sock.poll(max(1, int(min(remaining, self.POLL_S) * 1000))):
                continue
            frames = self.sock.recv_multipart(copy=False)
            try:
                msg = decode(frames, max_bytes=self.endpoint.max_message_bytes)
            except ProtocolError as exc:
                if exc.code == "bad_proto":  # another release of the broker: retrying cannot help
                    raise TransportError(
                        f"{kind}: the broker at {self.connect} speaks another protocol: {exc}",
                        code="bad_proto",
                        retryable=False,
                    ) from None
                raise TransportError(
                    f"{kind}: bad reply from {self.connect}: {exc}", code="bad_reply"
                ) from None
            if msg.req not in wanted:
                continue
            if msg.kind == "ERROR":
                raise TransportError(
                    f"{kind} rejected: {msg.header['code']} in field "
                    f"'{msg.header['field']}': {msg.header['message']}",
                    code=msg.header["code"],
                    retryable=msg.header["retryable"],
                )
            return msg

    def request(
        self,
        kind: str,
        header: dict[str, Any] | None = None,
        tensors: dict[str, np.ndarray] | None = None,
        *,
        timeout_s: float | None = None,
        interruptible: bool = True,
    ) -> Message:
        """Send one request and wait for its reply. ERROR replies raise TransportError, and so
        does ``interrupted()`` while it waits (unless not ``interruptible``: a farewell BYE)."""
        with self.lock:
            req = self.send_request(kind, header, tensors)
            deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
            return self.recv_reply(kind, {req}, deadline, interruptible=interruptible)

    def stream(
        self,
        kind: str,
        headers: list[dict[str, Any]],
        *,
        window: int = 4,
        tensors: list[dict[str, np.ndarray] | None] | None = None,
    ) -> Iterator[tuple[int, Message]]:
        """Many requests with up to ``window`` in flight (credit-based); (index of the request,
        its reply) as each reply arrives. Each reply has ``timeout_s`` from the one before."""
        index: dict[int, int] = {}
        with self.lock:
            for i, header in enumerate(headers):
                if len(index) >= window:
                    msg = self.recv_reply(kind, set(index), time.monotonic() + self.timeout_s)
                    yield index.pop(msg.req), msg
                index[self.send_request(kind, header, tensors[i] if tensors else None)] = i
            while index:
                msg = self.recv_reply(kind, set(index), time.monotonic() + self.timeout_s)
                yield index.pop(msg.req), msg

    def pipeline(
        self,
        kind: str,
        headers: list[dict[str, Any]],
        *,
        window: int = 4,
        tensors: list[dict[str, np.ndarray] | None] | None = None,
    ) -> list[Message]:
        """``stream``'s replies, in request order."""
        replies = dict(self.stream(kind, headers, window=window, tensors=tensors))
        return [replies[i] for i in range(len(headers))]

    def close(self) -> None:
        with self.lock:
            self.sock.close(linger=0)
