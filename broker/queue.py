"""The broker's episode queue: segments in, whole groups of whole episodes out. No I/O.

It holds the accepted segments of unfinished episodes (``partial``) and of complete ones
(``complete``, in completion order), and returns decisions: which permit a segment belongs to,
which episodes were dropped and why, which episodes make the next batch or what a batch still
waits for. The server turns those into replies, spool writes, counters and logs. Every staleness
rule is asked of ``Admission``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from broker.admission import Admission, Permit
from common.protocol import ProtocolError, show
from common.trajectory import Segment

SEEN_IDS = 1_000_000  # traj_ids remembered for duplicate detection

Episode = tuple[Permit, list[Segment]]


@dataclass(frozen=True)
class Dropped:
    """An episode discarded by rule: every segment counts, ``accepted`` ones were queued."""

    permit: Permit
    segments: list[Segment]
    accepted: list[Segment]
    reason: str  # stale | incomplete_episode | incomplete_group


class EpisodeQueue:
    def __init__(self, admission: Admission, max_bytes: int):
        self.admission = admission
        self.max_bytes = max_bytes
        self.partial: dict[str, list[Segment]] = {}  # permit id -> segments of an open episode
        self.complete: dict[str, Episode] = {}  # permit id -> a whole episode, completion order
        self.nbytes = 0
        self.seen: OrderedDict[str, None] = OrderedDict()

    @property
    def num_segments(self) -> int:
        return sum(map(len, self.partial.values())) + sum(len(s) for _, s in self.complete.values())

    def is_duplicate(self, seg: Segment) -> bool:
        return seg.traj_id in self.seen

    # ------------------------------------------------------------------ in
    def admit(self, seg: Segment, latest_version: int) -> Permit | list[Dropped]:
        """The permit ``seg`` may be queued under, or the drops when its episode is too stale
        (it, the episode's accepted segments and the rest of its group). Raises what the actor
        did wrong (``unknown_permit``, order, group) or ``busy``; changes nothing then."""
        permit = self.admission.in_flight.get(seg.permit)
        if permit is None or permit.actor_id != seg.actor_id:
            raise ProtocolError(
                "unknown_permit",
                "permit",
                f"{seg.permit!r} is not a permit held by {seg.actor_id!r}",
            )
        done = self.partial.get(permit.id, [])
        if done and done[0].episode_id != seg.episode_id:
            raise ProtocolError(
                "bad_value",
                "episode_id",
                f"permit {permit.id!r} plays episode {done[0].episode_id!r}, "
                f"got {show(seg.episode_id)}",
            )
        if seg.segment != len(done):
            raise ProtocolError(
                "bad_value",
                "segment",
                f"expected segment {len(done)} of episode {seg.episode_id!r}, got {seg.segment}",
            )
        if permit.group_size > 1:  # the learner groups by group_id, the broker by permit group
            first = next((segs[0] for _, segs in self._group(permit) if segs), None)
            if first is not None and first.group_id != seg.group_id:
                raise ProtocolError(
                    "bad_value",
                    "group_id",
                    f"the episodes of one permit group share one group_id: "
                    f"expected {first.group_id!r}, got {seg.group_id!r}",
                )
        if self.admission.too_stale(seg.min_version, latest_version):
            return [self._drop(permit, [*done, seg], "stale"), *self._drop_group(permit)]
        if self.nbytes + seg.nbytes > self.max_bytes:
            raise ProtocolError(
                "busy", "tokens", "broker queue is full; retry later", retryable=True
            )
        return permit

    def accept(self, permit: Permit, seg: Segment) -> None:
        """Queue an admitted segment; its episode is complete with its ``last`` one."""
        self.partial.setdefault(permit.id, []).append(seg)
        self.nbytes += seg.nbytes
        self.seen[seg.traj_id] = None
        if len(self.seen) > SEEN_IDS:
            self.seen.popitem(last=False)
        if seg.last:
            self.admission.complete(permit.id)
            self.complete[permit.id] = (permit, self.partial.pop(permit.id))

    def reclaim(
        self, actor_id: str, keep: set[str] | frozenset[str] = frozenset()
    ) -> tuple[list[Permit], list[Dropped]]:
        """Free a dead or restarted actor's permits (but ``keep``): their partial episodes and
        the rest of their groups go."""
        permits = self.admission.reclaim(actor_id, keep)
        dropped = []
        for p in permits:
            segs = self.partial.pop(p.id, [])
            if segs:
                dropped.append(self._drop(p, segs, "incomplete_episode"))
            dropped += self._drop_group(p)
        return permits, dropped

    # ----------------------------------------------------------------- out
    def take(
        self, v_learner: int, n: int, publishes_after: bool
    ) -> tuple[list[Dropped], list[Episode] | str]:
        """Drops of too-stale queued episodes, and the next batch: whole groups of at least ``n``
        whole episodes (stragglers' groups first before a publish), or what it still waits for.

        GRPO normalises over a group, so a group goes out only once all its episodes are
        complete, and never split: a batch may exceed ``n`` by less than a group.
        """
        stale = [
            (permit, segs)
            for permit, segs in self.complete.values()
            if self.admission.too_stale(min(s.min_version for s in segs), v_learner)
        ]
        dropped = [self._drop(p, segs, "stale") for p, segs in stale]
        for permit, _ in stale:
            dropped += self._drop_group(permit)
        groups: dict[str, list[Episode]] = {}
        for permit, segs in self.complete.values():
            groups.setdefault(permit.group_key, []).append((permit, segs))
        ready = [g for g in groups.values() if len(g) == g[0][0].group_size]
        num_ready = sum(len(g) for g in ready)
        stragglers = self.admission.stragglers(v_learner) if publishes_after else []
        if stragglers:
            oldest = v_learner - self.admission.max_staleness
            actors = sorted({p.actor_id for p in stragglers})
            return dropped, f"{len(stragglers)} episodes of version <= {oldest} from {actors}"
        if num_ready < n:
            return dropped, f"{n - num_ready} more whole episodes"
        # Groups that would be too stale after this publish go first, then arrival order. A
        # group's permits come from one grant, so they share its version.
        due = [publishes_after and self.admission.due(g[0][0], v_learner) for g in ready]
        take = [ep for g, first in zip(ready, due, strict=True) if first for ep in g]
        for g, first in zip(ready, due, strict=True):
            if len(take) >= n:
                break
            if not first:
                take += g
        self.admission.consume(len(take))
        for permit, segs in take:
            del self.complete[permit.id]
            self.nbytes -= sum(s.nbytes for s in segs)
        return dropped, take

    # ------------------------------------------------------------- helpers
    def _group(self, permit: Permit) -> list[Episode]:
        """The episodes of ``permit``'s group still held: complete, then in flight."""
        key = permit.group_key
        return [(p, segs) for p, segs in self.complete.values() if p.group_key == key] + [
            (p, self.partial.get(p.id, []))
            for p in self.admission.in_flight.values()
            if p.group_key == key
        ]

    def _drop_group(self, permit: Permit) -> list[Dropped]:
        """What is left of a group that lost an episode goes too, queued or still being played
        (its actor then gets ``unknown_permit``): it can never be whole, and GRPO must not train
        half a group."""
        if permit.group_size == 1:
            return []
        return [self._drop(p, segs, "incomplete_group") for p, segs in self._group(permit)]

    def _drop(self, permit: Permit, segs: list[Segment], reason: str) -> Dropped:
        accepted = [s for s in segs if s.traj_id in self.seen]
        if permit.id in self.complete:
            self.admission.drop_queued(1)
            del self.complete[permit.id]
        else:
            self.admission.release(permit.id)
            self.partial.pop(permit.id, None)
        self.nbytes -= sum(s.nbytes for s in accepted)
        return Dropped(permit, segs, accepted, reason)
