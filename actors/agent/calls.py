"""What the HTTP server hands the actor's loop: a ``Call`` per request, answered with a reply or
an ``AgentError``. Handler threads only parse and wait; every session belongs to the loop."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


class AgentError(Exception):
    """A request the agent API refuses: ``code`` says why (the server maps it to an HTTP
    status), ``param`` names the parameter at fault."""

    def __init__(self, code: str, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass
class Call:
    """One request handed to the actor's loop; the handler waits for ``done``."""

    route: str  # "start" | "chat" | "complete" | "end"
    session: str | None
    body: dict
    received: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict | None = None
    error: AgentError | None = None

    def answer(self, reply: dict) -> None:
        self.reply = reply
        self.done.set()

    def fail(self, error: AgentError) -> None:
        self.error = error
        self.done.set()
