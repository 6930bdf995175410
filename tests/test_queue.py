"""The broker's episode queue on its own: decisions in memory, no socket, no process.

tests/test_broker.py checks the same rules through a real broker process; here each decision is
read off directly: what a segment is admitted under, what is dropped and why, what a batch holds.
"""

from __future__ import annotations

import pytest

from broker.admission import Admission
from broker.queue import EpisodeQueue
from common.protocol import ProtocolError
from testkit.segments import make_segment


def queue(max_staleness: int = 1, batch_size: int = 4, max_bytes: int = 1 << 30) -> EpisodeQueue:
    return EpisodeQueue(
        Admission(batch_size=batch_size, publish_every=1, max_staleness=max_staleness), max_bytes
    )


def segment(permit, index: int = 0, last: bool = True, version: int = 0, **kw):
    return make_segment(
        permit=permit.id,
        actor_id=permit.actor_id,
        episode_id=f"ep-{permit.id}",
        index=index,
        last=last,
        version=version,
        **kw,
    )


def play(q: EpisodeQueue, permit, segments: int = 1, version: int = 0, **kw) -> None:
    for i in range(segments):
        seg = segment(permit, i, last=i == segments - 1, version=version, **kw)
        assert q.admit(seg, latest_version=version) is permit
        q.accept(permit, seg)


def test_a_group_goes_out_whole_and_only_when_complete():
    q = queue()
    a, b = q.admission.grant("actor", 2, 0, group=2)
    play(q, a, group_id="g")
    assert q.take(0, 1, publishes_after=False) == ([], "1 more whole episodes")
    play(q, b, segments=2, group_id="g")
    drops, batch = q.take(0, 1, publishes_after=False)
    assert drops == [] and [p.id for p, _ in batch] == [a.id, b.id]  # n = 1, but never half a group
    assert q.nbytes == 0 and not q.complete and q.admission.consumed_since_publish == 2


def test_a_too_stale_segment_drops_its_episode_and_the_rest_of_its_group():
    q = queue(max_staleness=1)
    a, b = q.admission.grant("actor", 2, 0, group=2)
    play(q, a, group_id="g")
    first = segment(b, 0, last=False, version=0, group_id="g")
    q.accept(b, first)
    late = segment(b, 1, last=True, version=0, group_id="g")
    drops = q.admit(late, latest_version=2)
    assert [(d.permit.id, d.reason, len(d.segments), len(d.accepted)) for d in drops] == [
        (b.id, "stale", 2, 1),  # the arriving segment was never queued
        (a.id, "incomplete_group", 1, 1),
    ]
    assert q.nbytes == 0 and not q.admission.in_flight and q.admission.queued == 0


def test_order_permit_and_size_errors_change_nothing():
    size = make_segment(permit="p", actor_id="a", episode_id="e", index=0, last=True, version=0)
    q = queue(max_bytes=2 * size.nbytes)
    (p,) = q.admission.grant("actor", 1, 0)
    unknown = make_segment(
        permit="nope", actor_id="actor", episode_id="e", index=0, last=True, version=0
    )
    for bad, code in ((segment(p, index=1), "bad_value"), (unknown, "unknown_permit")):
        with pytest.raises(ProtocolError) as exc:
            q.admit(bad, latest_version=0)
        assert exc.value.code == code
    assert q.nbytes == 0 and not q.partial
    play(q, p, segments=2)
    (p2,) = q.admission.grant("actor", 1, 0)
    with pytest.raises(ProtocolError) as exc:
        q.admit(segment(p2), latest_version=0)
    assert (exc.value.code, exc.value.retryable) == ("busy", True)
    assert q.nbytes == 2 * size.nbytes and p2.id in q.admission.in_flight


def test_before_a_publish_stragglers_are_waited_for_and_due_groups_go_first():
    q = queue(max_staleness=1, batch_size=2)
    old, straggler = q.admission.grant("actor", 2, 0)
    play(q, old)
    reason = q.take(1, 1, publishes_after=True)[1]
    assert reason == "1 episodes of version <= 0 from ['actor']"
    play(q, straggler)
    (new,) = q.admission.grant("actor", 1, 1)
    play(q, new, version=1)
    _, batch = q.take(1, 1, publishes_after=True)
    assert [p.id for p, _ in batch] == [old.id, straggler.id]  # both due, whatever n says
    assert q.take(1, 1, publishes_after=False)[1][0][0] is new


def test_reclaim_drops_open_episodes_and_keeps_held_permits():
    q = queue()
    kept, lost = q.admission.grant("actor", 2, 0)
    for p in (kept, lost):
        q.accept(p, segment(p, last=False))
    permits, drops = q.reclaim("actor", keep={kept.id})
    assert [p.id for p in permits] == [lost.id]
    assert [(d.permit.id, d.reason) for d in drops] == [(lost.id, "incomplete_episode")]
    assert set(q.partial) == {kept.id} and set(q.admission.in_flight) == {kept.id}
