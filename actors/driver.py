"""What the actor's loop drives: episodes of an environment, or agent sessions, behind one face.

A driver owns the episodes in flight and the engine they share; the actor owns the link, the
weights, the permits and the metrics. The driver never calls back into the actor: it says what
it can use (``wants``), takes what it was granted (``start``), advances by one engine step
(``step``) and hands back what happened (an ``Outcome``: segments to send, episodes that ended,
permits it let go of); the actor sends the segments and tells it the broker's verdict
(``delivered``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from common.trajectory import Segment


@dataclass(frozen=True)
class Wants:
    """Permits a driver can use now, in whole groups of ``group``; ``wait``: it has nothing else
    to do, so the broker may hold the request until capacity frees."""

    n: int
    group: int = 1
    wait: bool = False


@dataclass(frozen=True)
class Ended:
    """An episode that ended whole (its last segment among the outcome's)."""

    reward: float
    hacks: int = 0  # tool calls the reward-hacking guard intercepted in it


@dataclass
class Outcome:
    segments: list[Segment] = field(default_factory=list)  # to send, in order
    tokens: int = 0  # tokens sampled
    ended: list[Ended] = field(default_factory=list)
    failures: list[str] = field(
        default_factory=list
    )  # when an environment failed: its episode went
    released: bool = False  # a permit was let go of without its last segment: say which are held

    def add(self, other: Outcome) -> None:
        self.segments += other.segments
        self.tokens += other.tokens
        self.ended += other.ended
        self.failures += other.failures
        self.released |= other.released


class Driver(Protocol):
    def __len__(self) -> int:
        """Episodes (or sessions) in flight."""
        ...

    def held_permits(self) -> list[str]: ...

    def wants(self) -> Wants: ...

    def start(self, permits: list[dict]) -> Outcome: ...

    def step(self) -> Outcome:
        """One engine step (an agent driver answers its API calls first)."""
        ...

    def delivered(self, segment: Segment, accepted: bool) -> None:
        """The broker took ``segment``, or will never take its episode (stop playing it)."""
        ...

    def close(self) -> None: ...
