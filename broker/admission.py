"""Staleness admission control: rollout permits granted *before* generation (AReaL-style).

The learner consumes ``batch_size`` episodes per step and publishes a version every
``publish_every`` steps, so ``k·B`` episodes are trained per version. An episode started under
version v is safe while it is trained no later than version v + η. Two rules make that a bound:

1. Capacity: grant only while ``in_flight + queued + consumed_since_publish < (η+1)·k·B``. Every
   granted episode is then among the next (η+1)·k·B episodes the learner consumes, i.e. trained
   within η versions of its start.
2. Stragglers: before the learner's last batch of a version (``publishes_after``), every permit
   granted at version ≤ v_learner − η must be in that batch, so the broker waits for it (or for
   its actor to be declared dead). With η = 0 this is exactly synchronous PPO, on the same path.

Anything that still arrives too stale is dropped and counted by the broker, never trained on.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass


@dataclass
class Permit:
    id: str
    actor_id: str
    version: int
    granted_at: float
    group: str = ""  # id of the first permit of its group (one prompt's samples); "" alone
    group_size: int = 1  # episodes in the group: the learner must get all of them or none

    @property
    def group_key(self) -> str:
        return self.group or self.id


class Admission:
    def __init__(self, *, batch_size: int, publish_every: int, max_staleness: int):
        self.max_staleness = max_staleness
        self.configure(batch_size=batch_size, publish_every=publish_every)
        self.in_flight: dict[str, Permit] = {}
        self.queued = 0
        self.consumed_since_publish = 0
        self.granted_total = 0
        self._ids = itertools.count()
        self._epoch = f"{time.time_ns():x}"  # permit ids stay unique across broker restarts

    def configure(self, *, batch_size: int, publish_every: int) -> None:
        """The learner announces its batch size and publish period (HELLO)."""
        self.batch_size = batch_size
        self.publish_every = publish_every
        self.capacity = (self.max_staleness + 1) * publish_every * batch_size

    def grantable(self) -> int:
        """Permits that may be granted now under rule 1."""
        return max(
            0, self.capacity - self.consumed_since_publish - len(self.in_flight) - self.queued
        )

    def fair_share(self, actor_id: str, actors: int, group: int) -> int:
        """Permits an actor that already plays episodes may add: ceil(capacity / actors), in
        whole groups, minus what it holds. So one actor with many slots cannot keep the whole
        capacity from actors that join later (their first request, parked, is served first)."""
        share = -(-self.capacity // max(1, actors))
        share = -(-share // group) * group
        held = sum(1 for p in self.in_flight.values() if p.actor_id == actor_id)
        return max(0, share - held)

    def grant(self, actor_id: str, n: int, version: int, *, group: int = 1) -> list[Permit]:
        """Up to n permits at the actor's engine's version (``playable``), in whole groups.

        The actor plays each run of ``group`` consecutive permits as one prompt's samples, so the
        broker knows every group's members from the grant, even before any segment arrives.
        """
        n = min(n, self.grantable()) // group * group
        now = time.monotonic()
        ids = [f"{self._epoch}-{next(self._ids)}" for _ in range(n)]
        permits = [
            Permit(pid, actor_id, version, now, ids[i - i % group] if group > 1 else "", group)
            for i, pid in enumerate(ids)
        ]
        self.in_flight.update((p.id, p) for p in permits)
        self.granted_total += n
        return permits

    def playable(self, version: int, latest: int) -> bool:
        """Whether an engine at ``version`` may start episodes (its permits carry ``version``):
        the latest, or one of the η − 1 before it. Such a permit is due (rule 2) at the earliest
        when the learner's last batch of ``latest`` is built, so an actor keeps playing while it
        fetches the next version; with η ≤ 1 only the latest will do."""
        return 0 <= latest - version <= max(self.max_staleness - 1, 0)

    def too_stale(self, min_version: int, at_version: int) -> bool:
        """The backstop: a token sampled by ``min_version`` may not be trained at ``at_version``."""
        return at_version - min_version > self.max_staleness

    def due(self, permit: Permit, learner_version: int) -> bool:
        """Rule 2: the permit's episode must be trained before the learner publishes past
        ``learner_version``."""
        return permit.version <= learner_version - self.max_staleness

    def readmit(self, permit: Permit) -> None:
        """A permit restored from the spool whose episode was complete: in flight again until its
        segments are queued once more (then ``complete`` moves it to queued)."""
        self.in_flight[permit.id] = permit

    def release(self, permit_id: str) -> None:
        """An in-flight episode dropped by rule: its permit no longer counts."""
        self.in_flight.pop(permit_id, None)

    def complete(self, permit_id: str) -> Permit:
        """The permit's episode has all its segments: it moves from in flight to queued."""
        permit = self.in_flight.pop(permit_id)
        self.queued += 1
        return permit

    def reclaim(self, actor_id: str, keep: set[str] | frozenset = frozenset()) -> list[Permit]:
        """Free the permits of a dead or restarted actor (except those it says it still holds)."""
        gone = [p for p in self.in_flight.values() if p.actor_id == actor_id and p.id not in keep]
        for p in gone:
            del self.in_flight[p.id]
        return gone

    def drop_queued(self, n: int) -> None:
        """Queued episodes discarded by rule (too stale): they free capacity like consumed ones."""
        self.queued -= n

    def consume(self, n: int) -> None:
        self.queued -= n
        self.consumed_since_publish += n

    def published(self) -> None:
        self.consumed_since_publish = 0

    def stragglers(self, learner_version: int) -> list[Permit]:
        """Permits that must be in the learner's batch before it publishes past ``learner_version`` (rule 2)."""
        return [p for p in self.in_flight.values() if self.due(p, learner_version)]

    def state(self) -> dict:
        return {
            "in_flight": [vars(p) for p in self.in_flight.values()],
            "queued": self.queued,
            "consumed_since_publish": self.consumed_since_publish,
            "granted_total": self.granted_total,
        }

    def restore(self, state: dict) -> None:
        """Resume after a broker restart: in-flight permits get a fresh liveness clock."""
        self.in_flight = {p["id"]: restore_permit(p) for p in state["in_flight"]}
        self.consumed_since_publish = state["consumed_since_publish"]
        self.granted_total = state["granted_total"]


def restore_permit(saved: dict) -> Permit:
    """A permit from the spool, with a fresh liveness clock (monotonic time does not survive)."""
    return Permit(**{**saved, "granted_at": time.monotonic()})
