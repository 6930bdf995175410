"""Permit requests waiting for capacity: first come, first served, one per actor.

A ``PERMITS_REQ`` that finds no capacity is parked, not refused (docs/protocol.md §4): it is
answered the moment capacity frees, or with ``WAIT capacity`` at its deadline. An actor's newer
request (or its HELLO, BYE or death) discards its older one, which is never answered. Nobody
overtakes the head of the line.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from common.protocol import Message


class ParkedPermits:
    def __init__(self) -> None:
        # actor id -> (envelope, request, deadline), in arrival order
        self._waiting: OrderedDict[str, tuple[list, Message, float]] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def park(self, actor_id: str, envelope: list, request: Message, deadline: float) -> None:
        self._waiting.pop(actor_id, None)  # a newer request goes to the back of the line
        self._waiting[actor_id] = (envelope, request, deadline)

    def drop(self, actor_id: str) -> None:
        self._waiting.pop(actor_id, None)

    def clear(self) -> None:
        self._waiting.clear()

    def answers(
        self,
        grant: Callable[[Message], list | None],
        expired: Callable[[Message], list],
        now: float,
    ) -> Iterator[tuple[list, list]]:
        """(envelope, reply) for each request that can be answered now, in arrival order:
        ``grant(request)`` (None while capacity is missing), or ``expired(request)`` past its
        deadline. Stops at the first that must keep waiting."""
        while self._waiting:
            actor_id, (envelope, request, deadline) = next(iter(self._waiting.items()))
            reply = grant(request)
            if reply is None:
                if now < deadline:
                    return
                reply = expired(request)
            del self._waiting[actor_id]
            yield envelope, reply
