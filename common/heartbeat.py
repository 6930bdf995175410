"""Liveness apart from the work: a thread that keeps a client's lease at the broker.

The broker presumes a client dead after ``broker.heartbeat_timeout_s`` of silence (an actor's
permits are reclaimed, the learner role may be taken over). A role whose loop is busy in one long
piece of work (an engine step that generates every pending turn at once, loading a large version,
an optimiser step, a checkpoint) sends nothing meanwhile. So the HEARTBEAT goes out from its own
thread, on the role's own connection (``Client`` is shared under its lock, so the identity bound
to the connection is the role's): one HEARTBEAT every ``every_s``, whose ``HEARTBEAT_ACK`` (the
newest version) goes to ``on_reply``. Working hard never looks like being
dead; a hung process still does, since the thread lives only as long as the process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import structlog

from common.protocol import Message
from common.transport import Client, TransportError

log = structlog.get_logger()


class Heartbeat:
    """``header()`` is the HEARTBEAT's body (an actor reports its engine's version)."""

    def __init__(
        self,
        client: Client,
        every_s: Callable[[], float],
        *,
        header: Callable[[], dict[str, Any]],
        on_reply: Callable[[Message], None] = lambda reply: None,
    ) -> None:
        self.client, self.every_s, self.header, self.on_reply = client, every_s, header, on_reply
        self.sent = 0  # HEARTBEATs answered (tests and logs)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s()):
            try:
                reply = self.client.request(
                    "HEARTBEAT", self.header(), timeout_s=max(1.0, self.every_s())
                )
            except TransportError as exc:  # the loop's own requests find out and repair it
                log.debug("heartbeat failed", error=str(exc))
                continue
            self.sent += 1
            self.on_reply(reply)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
