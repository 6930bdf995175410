"""Weights between peers: the bytes of a version flow around the broker, never through it.

The broker steers (docs/protocol.md §6.3): it knows each version's manifest and who holds or is
fetching it, and tells each fetcher whom to fetch from (``WEIGHTS_WHERE`` -> a ``Source``). The
learner serves the chunks it published; every actor that fetches a version serves, from the
moment each chunk is in and checked, the chunks it holds (``PeerServer``). With the broker handing
each new fetcher the last one to join, the fetchers form a chain: every link carries each chunk
once, in both directions at once, so a version reaches N actors in about the time it reaches one,
plus one chunk per hop.

``fetch`` pulls a version's missing chunks from a source, several in flight, checking each
chunk's sha256 before it is kept; a source that stalls (no chunk within ``stall_s``), refuses,
serves a chunk that does not check, or serves much slower than it receives (``slow``) is reported
to the broker, which names another.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import structlog
import zmq
from prometheus_client import Counter

from common.pieces import Pieces
from common.protocol import PEER_KINDS, Message, ProtocolError, decode, encode, error_frames
from common.transport import Client, Endpoint, TransportError, send

log = structlog.get_logger()

M_SERVED = Counter("asyncppo_weights_bytes_served_total", "Weight bytes served to peers.")
M_FETCHED = Counter("asyncppo_weights_bytes_fetched_total", "Weight bytes fetched from peers.")
M_SOURCE_FAILED = Counter(
    "asyncppo_weights_source_failures_total",
    "Sources abandoned in the middle of a version, by why: stalled, slow, refused, bad chunk.",
    ["reason"],
)


@dataclass(frozen=True)
class Source:
    """Whom to fetch a version from: its id (to report it), address and Curve key (Z85)."""

    id: str
    address: str
    key: str | None = None


class PeerServer:
    """Serves ``WEIGHTS_GET`` for the versions offered here (the newest ``keep``), from a thread
    and a ROUTER of its own. A request for a chunk not in yet is held until it arrives (the
    chain's pipelining), or answered ``not_yet`` after ``park_s``. Nothing a peer sends ends it:
    any other kind is refused (a key that may connect may fetch chunks, nothing else).

    The thread sleeps in one poll on the socket and a doorbell (a pipe) that every chunk kept in
    an offered version rings, so a held request is answered the moment its chunk is in, and an
    idle server costs nothing (a 5 ms polling loop cost an actor 15% of its CPU under
    ``asyncppo up``: bench.insystem)."""

    def __init__(
        self, endpoint: Endpoint, bind: str, *, park_s: float = 10.0, keep: int = 2
    ) -> None:
        self.endpoint, self.park_s, self.keep = endpoint, park_s, keep
        self.sock, self.port, self.key = endpoint.peer_server(bind)
        self._versions: dict[int, Pieces] = {}
        self._lock = threading.Lock()
        self._parked: list[tuple[list, Message, Pieces, int, float]] = []
        self._stop = threading.Event()
        self._bell_out, bell_in = os.pipe()
        self._bell_in: int | None = bell_in
        os.set_blocking(bell_in, False)
        os.set_blocking(self._bell_out, False)
        self._thread = threading.Thread(target=self._run, name="peer-server", daemon=True)
        self._thread.start()

    def offer(self, pieces: Pieces) -> None:
        """Serve this version (as its chunks arrive); only the newest ``keep`` are kept."""
        with self._lock:
            self._versions[pieces.version] = pieces
            for old in sorted(self._versions)[: -self.keep]:
                del self._versions[old]
        pieces.listen(self._ring)

    def _ring(self) -> None:
        with self._lock:  # never after close: the descriptor's number may be another file's
            if self._bell_in is not None:
                with contextlib.suppress(BlockingIOError):  # full: a ring is pending anyway
                    os.write(self._bell_in, b"x")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._bell_out, zmq.POLLIN)
        while not self._stop.is_set():
            # asleep until a request, a chunk, or the nearest parked request's deadline
            deadline = min((p[4] for p in self._parked), default=None)
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = dict(poller.poll(None if timeout is None else int(timeout * 1000) + 1))
            if self._bell_out in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._bell_out, 4096)
            if self.sock in ready:
                while True:
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames)
            self._serve_parked()
        self.sock.close(linger=0)
        os.close(self._bell_out)

    def _handle(self, frames: list) -> None:
        envelope, body = frames[:1], frames[1:]
        msg = None
        try:
            msg = decode(body, max_bytes=self.endpoint.max_message_bytes, kinds=PEER_KINDS)
            version, index = msg.header["version"], msg.header["chunk"]
            with self._lock:
                pieces = self._versions.get(version)
            if pieces is None:
                raise ProtocolError(
                    "version_gone", "version", f"this peer does not hold version {version}",
                    retryable=True,
                )  # fmt: skip
            if not 0 <= index < len(pieces):
                raise ProtocolError(
                    "bad_value", "chunk", f"chunk {index} out of range 0..{len(pieces) - 1}"
                )
        except ProtocolError as exc:
            self._reply(envelope, error_frames(exc, msg.req if msg else exc.req))
            return
        except Exception:  # a bug must not stop the serving thread
            log.exception("peer request failed")
            return
        self._parked.append((envelope, msg, pieces, index, time.monotonic() + self.park_s))

    def _serve_parked(self) -> None:
        now, waiting = time.monotonic(), []
        for envelope, msg, pieces, index, deadline in self._parked:
            data = pieces.get(index)
            if data is not None:
                head = {"req": msg.req, "version": pieces.version, "chunk": index}
                if (rate := pieces.rate()) is not None:  # lets a fetcher see this relay lag
                    head["rate"] = rate
                view = np.frombuffer(data, dtype=np.uint8)
                self._reply(envelope, encode("WEIGHTS_CHUNK", head, {"data": view}))
                M_SERVED.inc(view.nbytes)
            elif now >= deadline:
                exc = ProtocolError(
                    "not_yet", "chunk",
                    f"this peer has not received chunk {index} of version {pieces.version} "
                    "yet: ask the broker for another source", retryable=True,
                )  # fmt: skip
                self._reply(envelope, error_frames(exc, msg.req))
            else:
                waiting.append((envelope, msg, pieces, index, deadline))
        self._parked = waiting

    def _reply(self, envelope: list, frames: list) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the fetcher went away (ROUTER_MANDATORY)
            send(self.sock, frames, envelope)

    def close(self) -> None:
        self._stop.set()
        self._ring()
        self._thread.join()
        with self._lock:
            os.close(self._bell_in)
            self._bell_in = None


SLOW_RATIO = 2.0  # a relay that serves a version this many times slower than it received it
SLOW_GRACE_S = 1.0  # ... and is this far behind what its own rate would have delivered


def slow(source_rate: float, chunks: int, seconds: float) -> bool:
    """Whether a relay serves much slower than it receives: ``chunks`` came from it ``seconds``
    apart (first to latest), under 1/``SLOW_RATIO`` of the ``source_rate`` (chunks a second) it
    reports receiving the version at, and ``SLOW_GRACE_S`` later than that rate would have
    brought them. A relay whose uplink is the narrow part fails this within a few chunks; a
    healthy chain pipelines at one rate from end to end, and a pause of a busy host (under a
    second) decides nothing; a source that holds the whole version from the start (the learner)
    reports no rate and is never slow."""
    if chunks < 3 or not source_rate > 0:  # a peer's nonsense rate judges nobody
        return False
    due = (chunks - 1) / source_rate
    return seconds > max(SLOW_RATIO * due, due + SLOW_GRACE_S)


def fetch(
    pieces: Pieces,
    where: Callable[[list[str]], Source],
    endpoint: Endpoint,
    client_id: str,
    *,
    stall_s: float,
    window: int = 4,
    should_stop: Callable[[], bool] = lambda: False,
) -> bool:
    """Fill ``pieces`` from the sources ``where(failed)`` names, each chunk checked as it
    arrives; True once complete, False when ``should_stop()``. A source that stalls for
    ``stall_s``, refuses, serves a chunk that does not check, or is ``slow`` goes into
    ``failed`` (the broker avoids it) and the next one takes over from the first missing chunk.
    One source per version at most is given up as slow: a fetcher whose own link is the narrow
    one finds every relay ahead of it, and must not report them all. ``where`` raises
    ``TransportError`` when the version is gone (a newer one replaced it)."""
    failed: list[str] = []
    judge_slow = True
    while not pieces.complete:
        if should_stop():
            return False
        source = where(failed)
        client = Client(
            endpoint, source.address, client_id, timeout_s=stall_s, interrupted=should_stop,
            server_key=source.key,
        )  # fmt: skip
        try:
            _pull(client, pieces, window, judge_slow)
        except (TransportError, ProtocolError) as exc:
            reason = "stalled" if getattr(exc, "code", "") == "timeout" else exc.code
            M_SOURCE_FAILED.labels(reason=reason).inc()
            log.warning("weight source failed", source=source.id, version=pieces.version,
                        error=str(exc))  # fmt: skip
            if getattr(exc, "code", "") == "interrupted":
                return False
            judge_slow = judge_slow and reason != "slow"
            failed.append(source.id)
        finally:
            client.close()
    return True


def _pull(client: Client, pieces: Pieces, window: int, judge_slow: bool) -> None:
    """Every missing chunk from one source, ``window`` in flight, each checked and kept; raises
    ``TransportError`` (code ``slow``) when ``judge_slow`` and the source is ``slow``."""
    missing = pieces.missing()
    headers = [{"version": pieces.version, "chunk": i} for i in missing]
    first_at = 0.0
    with contextlib.closing(client.stream("WEIGHTS_GET", headers, window=window)) as replies:
        for n, (i, reply) in enumerate(replies, start=1):
            data = reply.tensors.get("data")
            if data is None:
                raise ProtocolError("missing_field", "data", "WEIGHTS_CHUNK carries 'data'")
            pieces.put(missing[i], data)  # a view of the received frame: no copy
            M_FETCHED.inc(len(data))
            now, rate = time.monotonic(), reply.header.get("rate")
            first_at = first_at or now
            if judge_slow and rate is not None and slow(rate, n, now - first_at):
                raise TransportError(
                    f"the source received version {pieces.version} at {rate:.1f} chunks/s and "
                    f"serves it at {(n - 1) / (now - first_at):.1f}", code="slow",
                )  # fmt: skip
