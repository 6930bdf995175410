"""The broker as it runs in production: a real ``asyncppo broker`` process on a free port, real
ZeroMQ peers (testkit/peers.py), real signals (kill -9, SIGTERM).

Covered: staleness admission asserted on per-token versions, too-stale segments dropped on arrival
and in the queue, backpressure in bytes, permits of dead actors, an actor killed mid-send, the spool
across a kill -9 and a failing disk, every kind of malformed message, CurveZMQ, weight versioning /
fan-out, and GRPO groups handed out whole.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from common.config import SecurityConfig
from common.protocol import PROTO, encode
from common.transport import TransportError
from common.weights import pack_state_dict
from testkit.peers import (
    BYTES_PER_TOKEN,
    ROOT,
    BrokerProcess,
    Peer,
    ScriptedActor,
    ScriptedLearner,
    fetch_chunks,
    hold_permits_until_killed,
    stream_episodes_until_killed,
)
from testkit.segments import make_segment, segment_digest, synthetic_weights, turns

FAST = {"broker.batch_wait_s": 0.5}  # parked GET_BATCHes answer WAIT quickly


@pytest.fixture
def start_broker(tmp_path):
    """Start brokers (real processes) that are killed at teardown, whatever the test did."""
    brokers: list[BrokerProcess] = []

    def start(settings: dict | None = None, **kw) -> BrokerProcess:
        broker = BrokerProcess(
            tmp_path / f"broker{len(brokers)}.log", {**FAST, **(settings or {})}, **kw
        )
        brokers.append(broker)
        broker.start()
        return broker

    yield start
    for broker in brokers:
        broker.close()


def wait_until(cond, timeout_s: float, what: str, every_s: float = 0.02) -> float:
    """Poll ``cond`` until true; returns when (monotonic) it first was."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return time.monotonic()
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def wait_until_permits(
    actor: ScriptedActor, n: int, timeout_s: float = 10.0, *, group: int = 1
) -> list[str]:
    """Ask until ``n`` permits are held (the broker may answer WAIT first)."""
    permits: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(permits) < n:
        assert time.monotonic() < deadline, f"{actor.id} got {len(permits)} of {n} permits"
        permits += actor.permits(n - len(permits), group)
    return permits


def assert_whole_episodes(segments) -> dict[str, list]:
    """Every episode in a batch has contiguous segments 0..k-1 and ends with its ``last`` one."""
    episodes = collections.defaultdict(list)
    for seg in segments:
        episodes[seg.episode_id].append(seg)
    for episode_id, segs in episodes.items():
        assert [s.segment for s in segs] == list(range(len(segs))), episode_id
        assert segs[-1].last and not any(s.last for s in segs[:-1]), episode_id
    return episodes


# ------------------------------------------------------------------ 1. admission / staleness
@pytest.mark.parametrize("max_staleness", [0, 1])
@pytest.mark.system
def test_staleness_bound_holds_on_every_trained_token(start_broker, max_staleness):
    batch_size, steps = 4, 6
    capacity = (max_staleness + 1) * batch_size  # publish_every = 1
    broker = start_broker({"broker.max_staleness": max_staleness})
    learner = ScriptedLearner(broker.address, "learner")
    learner.hello(batch_size)
    learner.publish(0)
    stop = threading.Event()
    seen = {"in_flight": 0, "in_flight_or_queued": 0}

    def act(actor_id: str, n: int, pause_s: float) -> None:  # as fast as the broker lets it
        actor = ScriptedActor(broker.address, actor_id)
        actor.hello()
        while not stop.is_set():
            for permit in actor.permits(n):
                actor.play(permit, segments=2, pause_s=pause_s)
        actor.close()

    def watch() -> None:
        monitor = Peer(broker.address, "monitor")
        while not stop.is_set():
            s = monitor.stats()
            seen["in_flight"] = max(seen["in_flight"], s["permits_in_use"])
            both = s["permits_in_use"] + s["queued_episodes"]
            seen["in_flight_or_queued"] = max(seen["in_flight_or_queued"], both)
            time.sleep(0.01)
        monitor.close()

    # The slow actor's episodes outlast a learner step: the broker must wait for them (rule 2).
    actors = [("fast-0", 2, 0.0), ("fast-1", 2, 0.0), ("slow", 1, 0.25)]
    threads = [threading.Thread(target=act, args=a) for a in actors]
    threads.append(threading.Thread(target=watch))
    for t in threads:
        t.start()
    trained = []  # (learner version, segment)
    try:
        for version in range(steps):
            while (batch := learner.get_batch(version, batch_size)) is None:
                pass
            assert len(assert_whole_episodes(batch)) == batch_size
            trained += [(version, seg) for seg in batch]
            time.sleep(0.3)  # a slow learner: actors run ahead as far as admission allows
            learner.publish(version + 1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    staleness = [v - int(seg.versions[seg.action_mask == 1].min()) for v, seg in trained]
    assert max(staleness) == max_staleness  # the bound holds, and with 1 it is really used
    if max_staleness == 0:  # synchronous: every trained token is of the learner's current version
        assert all((seg.versions[seg.action_mask == 1] == v).all() for v, seg in trained)
    assert 0 < seen["in_flight"] <= capacity
    assert seen["in_flight_or_queued"] <= capacity
    stats = learner.stats()
    assert stats["dropped_stale"] == 0  # enforced before generation, not by dropping afterwards
    assert stats["rejected_invalid"] == 0


def learner_and_actor(broker, batch_size: int) -> tuple[ScriptedLearner, ScriptedActor]:
    """A learner that published version 0 (asking for `batch_size` episodes) and an actor synced
    to it."""
    learner = ScriptedLearner(broker.address, "learner")
    learner.hello(batch_size=batch_size)
    learner.publish(0)
    actor = ScriptedActor(broker.address, "actor")
    actor.hello()
    actor.sync_weights()
    return learner, actor


def at_capacity(start_broker, permits_wait_s: float):
    """A synchronous broker (capacity 2 episodes) whose permits the actor `holder` all holds,
    and a second synced actor, `waiter`: (broker, learner, holder, waiter)."""
    broker = start_broker({"broker.max_staleness": 0, "broker.permits_wait_s": permits_wait_s})
    learner = ScriptedLearner(broker.address, "learner")
    learner.hello(batch_size=2)  # capacity 2 episodes
    learner.publish(0)
    holder, waiter = (ScriptedActor(broker.address, name) for name in ("holder", "waiter"))
    for actor in (holder, waiter):
        actor.hello()
        actor.sync_weights()
    assert len(holder.permits(2)) == 2
    return broker, learner, holder, waiter


@pytest.mark.system
def test_a_permit_request_waits_for_capacity_and_is_answered_the_moment_it_frees(start_broker):
    """Credit-based flow: no polling. A PERMITS_REQ that finds no capacity is parked and gets its
    PERMITS as soon as capacity frees (here: the holder leaves), or WAIT after permits_wait_s."""
    wait_s = 3.0
    broker, learner, holder, waiter = at_capacity(start_broker, wait_s)

    asked = time.monotonic()
    reply = waiter.request("PERMITS_REQ", {"n": 2, "version": 0})
    assert reply.kind == "WAIT" and reply.header["reason"] == "capacity"
    assert wait_s - 0.1 <= time.monotonic() - asked < wait_s + 2.0
    assert reply.header["retry_after_s"] == 0  # ask again at once: the next request is parked too

    answer: dict = {}

    def ask() -> None:
        answer["reply"] = waiter.request("PERMITS_REQ", {"n": 2, "version": 0})
        answer["at"] = time.monotonic()

    asker = threading.Thread(target=ask)
    asker.start()
    time.sleep(0.5)  # parked by now
    assert "reply" not in answer
    left = time.monotonic()
    holder.request("BYE")  # frees the capacity it held
    asker.join(timeout=wait_s + 5)
    assert answer["reply"].kind == "PERMITS" and len(answer["reply"].header["permits"]) == 2
    assert answer["at"] - left < 1.0  # answered on the spot, not after the wait ran out
    assert learner.stats()["permits_in_use"] == 2


@pytest.mark.system
def test_a_permit_request_with_wait_false_is_answered_at_once(start_broker):
    """An actor with episodes in flight asks for free slots with wait=false: without capacity it
    gets WAIT capacity on the spot (it has work meanwhile), not after permits_wait_s; a `wait`
    that is not a bool is refused naming the field."""
    wait_s = 5.0
    broker, learner, holder, waiter = at_capacity(start_broker, wait_s)
    asked = time.monotonic()
    reply = waiter.request("PERMITS_REQ", {"n": 2, "version": 0, "wait": False})
    assert reply.kind == "WAIT" and reply.header["reason"] == "capacity"
    assert time.monotonic() - asked < wait_s / 2
    with pytest.raises(TransportError) as exc:
        waiter.request("PERMITS_REQ", {"n": 2, "version": 0, "wait": "no"})
    assert exc.value.code == "bad_type" and "wait" in str(exc.value)
    holder.request("BYE")  # capacity again: wait=false is granted like any request
    reply = waiter.request("PERMITS_REQ", {"n": 2, "version": 0, "wait": False})
    assert reply.kind == "PERMITS" and len(reply.header["permits"]) == 2


@pytest.mark.system
def test_a_busy_actor_tops_up_only_to_its_fair_share(start_broker):
    """wait=false grants at most ceil(capacity / registered actors) minus what the actor holds,
    so an actor with many free slots leaves room for the others; a plain request is not capped."""
    broker = start_broker({"broker.max_staleness": 1})
    learner = ScriptedLearner(broker.address, "learner")
    learner.hello(batch_size=4)  # capacity (1 + 1) * 4 = 8
    learner.publish(0)
    busy, other = (ScriptedActor(broker.address, name) for name in ("busy", "other"))
    for actor in (busy, other):
        actor.hello()
        actor.sync_weights()
    top_up = {"n": 8, "version": 0, "wait": False}
    assert len(busy.request("PERMITS_REQ", top_up).header["permits"]) == 4  # half of 8
    reply = busy.request("PERMITS_REQ", top_up)
    assert reply.kind == "WAIT" and reply.header["reason"] == "capacity"  # its share is used
    assert len(other.permits(8)) == 4  # the rest is there for the other actor


@pytest.mark.system
def test_a_rejected_permit_request_changes_nothing(start_broker):
    """A malformed PERMITS_REQ neither records its version nor discards the actor's parked one."""
    broker, learner, holder, waiter = at_capacity(start_broker, 5.0)
    parked = waiter.submit("PERMITS_REQ", {"n": 2, "version": 0})
    time.sleep(0.5)  # parked by now
    with pytest.raises(TransportError) as exc:  # on the same connection, while the first waits
        waiter.request("PERMITS_REQ", {"n": 0, "version": 7})
    assert exc.value.code == "bad_value"
    assert learner.stats()["actor_versions"]["waiter"] == 0
    holder.request("BYE")  # frees the capacity: the parked request is still there to get it
    reply = waiter.reply_to(parked, "PERMITS_REQ", timeout_s=10)
    assert reply.kind == "PERMITS" and len(reply.header["permits"]) == 2


@pytest.mark.system
def test_a_too_stale_segment_is_dropped_counted_and_never_handed_out(start_broker):
    """What still arrives too old is dropped on both paths, counted per segment in `dropped_stale`,
    and never trained on. On arrival: an actor holding a permit of version 0 sends after the
    learner published version 2 (η = 1): ACK {dropped: stale}, the episode's segment accepted
    earlier goes with it, and its permit is gone. In the queue: an episode accepted whole at
    version 0 is dropped when the learner asks for a batch at version 2; the learner's next batch
    holds only a fresh episode."""
    broker = start_broker({"broker.max_staleness": 1})
    learner, actor = learner_and_actor(broker, batch_size=2)
    queued, playing = wait_until_permits(actor, 2)
    actor.play(queued, segments=2)  # whole, at version 0
    (first,) = actor.play(playing, segments=1, finish=False)
    learner.publish(1)
    learner.publish(2)  # version 0 is now 2 > η versions behind

    late = make_segment(
        permit=playing,
        actor_id=actor.id,
        episode_id=first.episode_id,
        index=1,
        last=True,
        version=0,
    )
    reply = actor.request("TRAJ", late.header(), late.arrays())
    assert reply.kind == "ACK" and reply.header.get("dropped") == "stale"
    stats = learner.stats()
    assert stats["dropped_stale"] == 2  # the late segment and its episode's accepted one
    assert stats["accepted"] == 3 and stats["partial_episodes"] == 0
    assert stats["permits_in_use"] == 0 and stats["queued_episodes"] == 1
    with pytest.raises(TransportError) as exc:  # the episode is over, a resend does not revive it
        actor.request("TRAJ", late.header(), late.arrays())
    assert exc.value.code == "unknown_permit"

    assert learner.get_batch(2, 1) is None  # the queued episode is too old for version 2
    stats = learner.stats()
    assert stats["dropped_stale"] == 4 and stats["handed_out"] == 0
    assert stats["queued_episodes"] == 0 and stats["queue_bytes"] == 0

    actor.sync_weights()
    (fresh,) = wait_until_permits(actor, 1)
    sent = actor.play(fresh, segments=1)
    batch = learner.get_batch(2, 1)
    assert batch is not None and [s.traj_id for s in batch] == [s.traj_id for s in sent]
    stats = learner.stats()
    assert stats["handed_out"] == 1 and stats["dropped_stale"] == 4
    assert stats["rejected_invalid"] == stats["rejected_unknown_permit"] == 1  # the resend


@pytest.mark.system
def test_a_full_byte_queue_pushes_back_until_the_learner_drains_it(start_broker, tmp_path):
    """Backpressure in bytes. A segment that would take the queued bytes past
    `broker.max_queue_bytes` gets the retryable `busy` ERROR and changes nothing, however often
    it is resent: the queued bytes and the broker's memory stay put. A queue over the limit (here
    restored by a restart with a smaller limit) answers PERMITS_REQ with WAIT queue_full. Once the
    learner has taken a batch, the very same message is accepted and permits are granted again."""
    num_tokens = 60_000  # ~1 MB a segment
    seg_bytes = num_tokens * BYTES_PER_TOKEN
    broker = start_broker(
        {
            "broker.max_queue_bytes": 2 * seg_bytes + seg_bytes // 2,  # room for two segments
            "broker.spool_dir": str(tmp_path / "spool"),
        }
    )
    learner = ScriptedLearner(broker.address, "learner")
    learner.hello(batch_size=2)
    learner.publish(0)
    actor = ScriptedActor(broker.address, "actor", num_tokens=num_tokens)
    actor.hello()
    actor.sync_weights()
    first, second = wait_until_permits(actor, 2)
    kept = actor.play(first, segments=2)
    seg = make_segment(
        turns(num_tokens),
        permit=second,
        actor_id=actor.id,
        episode_id="second",
        index=0,
        last=True,
        version=0,
    )
    assert seg.nbytes == seg_bytes

    def refused() -> None:
        with pytest.raises(TransportError) as exc:
            actor.request("TRAJ", seg.header(), seg.arrays())
        assert (exc.value.code, exc.value.retryable) == ("busy", True)

    refused()
    rss = broker.rss_bytes()
    for _ in range(20):
        refused()
    assert broker.rss_bytes() - rss < 4 * seg_bytes  # 20 segments went through it
    stats = learner.stats()
    assert stats["rejected_busy"] == 21 and stats["rejected_invalid"] == 0
    assert stats["accepted"] == 2 and stats["queue_bytes"] == 2 * seg_bytes
    assert stats["partial_episodes"] == 0 and stats["queued_episodes"] == 1

    broker.kill()  # an operator lowers the limit below what is queued, and restarts it
    broker.settings["broker.max_queue_bytes"] = seg_bytes
    assert broker.start()["queue_bytes"] == 2 * seg_bytes
    reply = actor.request("PERMITS_REQ", {"n": 1, "version": 0})
    assert reply.kind == "WAIT" and reply.header["reason"] == "queue_full"
    assert reply.header["retry_after_s"] > 0
    refused()

    learner.hello(batch_size=2)
    batch = learner.get_batch(0, 1)
    assert batch is not None and [s.traj_id for s in batch] == [s.traj_id for s in kept]
    assert learner.stats()["queue_bytes"] == 0
    reply = actor.request("TRAJ", seg.header(), seg.arrays())
    assert reply.kind == "ACK" and not reply.header.get("duplicate")
    assert len(wait_until_permits(actor, 1)) == 1
    batch = learner.get_batch(0, 1)
    assert batch is not None and [s.traj_id for s in batch] == [seg.traj_id]
    assert broker.proc.poll() is None


# ---------------------------------------------------------------- 2. actors that die or go silent
@pytest.mark.system
def test_permits_of_dead_and_silent_actors_are_reclaimed(start_broker):
    timeout_s = 2.0  # the doomed actor heartbeats every timeout_s / 10: a wide margin on a busy CPU
    broker = start_broker({"broker.max_staleness": 0, "broker.heartbeat_timeout_s": timeout_s})
    learner = ScriptedLearner(broker.address, "learner")
    learner.hello(batch_size=4)  # capacity 4 episodes
    learner.publish(0)
    ctx = multiprocessing.get_context("spawn")
    report = ctx.Queue()
    doomed = ctx.Process(
        target=hold_permits_until_killed,
        args=(broker.address, "doomed", 2, timeout_s / 10, report),
    )
    doomed.start()
    silent = ScriptedActor(broker.address, "silent")
    try:
        assert len(report.get(timeout=30)) == 2
        silent.hello()
        silent.sync_weights()
        held = silent.permits(2)
        for permit in held:
            silent.send_segment(permit, f"silent.{permit}", 0, last=False)
        went_silent = time.monotonic()
        healthy = ScriptedActor(broker.address, "healthy")
        healthy.hello()
        healthy.sync_weights()
        assert healthy.permits(4) == []  # capacity is held by the two unfinished actors
        stats = learner.stats()
        assert stats["permits_in_use"] == 4 and stats["partial_episodes"] == 4

        reclaimed = wait_until(
            lambda: learner.stats()["permits_in_use"] == 2, 5, "silent's permits"
        )
        assert reclaimed - went_silent >= timeout_s - 0.1
        time.sleep(timeout_s)  # the doomed actor still heartbeats: its permits stay
        assert learner.stats()["permits_in_use"] == 2
        os.kill(doomed.pid, signal.SIGKILL)
        killed = time.monotonic()
        gone = wait_until(lambda: learner.stats()["permits_in_use"] == 0, 5, "doomed's permits")
        assert gone - killed <= timeout_s + 2.0
    finally:
        if doomed.is_alive():
            doomed.kill()
        doomed.join()
    stats = learner.stats()
    assert stats["permits_reclaimed"] == 4 and stats["dropped_incomplete_episode"] == 4
    assert stats["partial_episodes"] == 0 and stats["queue_bytes"] == 0

    # The silent actor comes back: it must say HELLO again, and its old permit is gone for good.
    with pytest.raises(TransportError) as exc:
        silent.send_segment(held[0], f"silent.{held[0]}", 1, last=True)
    assert exc.value.code == "unknown_actor"
    silent.hello(held=held)
    with pytest.raises(TransportError) as exc:
        silent.send_segment(held[0], f"silent.{held[0]}", 1, last=True)
    assert exc.value.code == "unknown_permit"

    healthy.hello()  # it was silent too, while the test waited
    permits = wait_until_permits(healthy, 4)
    sent = [seg for permit in permits for seg in healthy.play(permit, segments=3)]
    batch = learner.get_batch(0, 4)
    assert batch is not None
    assert_whole_episodes(batch)
    assert {seg.traj_id for seg in batch} == {seg.traj_id for seg in sent}
    assert {seg.actor_id for seg in batch} == {"healthy"}


@pytest.mark.system
def test_an_actor_killed_mid_send_leaves_only_whole_episodes(start_broker):
    """kill -9 of an actor while a multi-MB segment is on the wire, three times, at random moments
    of sending an episode's second segment. ZeroMQ delivers a multipart message whole or not at
    all: the broker receives every segment sent before it and at most that one more, never part of
    one; the learner gets only whole episodes, every tensor byte for byte what the actor sent; the
    dead actor's unfinished episode is dropped as `incomplete_episode` once the heartbeat timeout
    has passed, not before; the broker keeps serving."""
    timeout_s, num_tokens, segments = 1.5, 500_000, 4  # 8.5 MB a segment: ~5-10 ms to arrive
    broker = start_broker({"broker.heartbeat_timeout_s": timeout_s})
    learner = ScriptedLearner(broker.address, "learner", timeout_s=15.0)
    learner.hello(batch_size=8)
    learner.publish(0)
    ctx = multiprocessing.get_context("spawn")
    rng = random.Random(0)
    dropped = 0
    for attempt in range(3):
        before = learner.stats()
        receiver, sender = ctx.Pipe(duplex=False)
        actor = ctx.Process(
            target=stream_episodes_until_killed,
            args=(broker.address, f"streamer-{attempt}", num_tokens, segments, sender),
        )
        actor.start()
        sender.close()
        sent: list[tuple[str, str]] = []  # (traj_id, digest) of each segment it began to send
        try:
            while len(sent) < segments + 2:  # until the second episode's second segment goes out
                assert receiver.poll(30), "the actor stopped sending"
                sent.append(receiver.recv())
            time.sleep(rng.uniform(0.0, 0.015))  # before, while or after its bytes cross
            os.kill(actor.pid, signal.SIGKILL)
            killed = time.monotonic()
        finally:
            if actor.is_alive():
                actor.kill()
            actor.join()
        try:
            while receiver.poll():  # what it began to send before it died
                sent.append(receiver.recv())
        except EOFError:
            pass
        receiver.close()
        stats = learner.stats()
        assert stats["dropped_incomplete_episode"] == before["dropped_incomplete_episode"]
        assert stats["actors"] == 1  # not presumed dead yet

        gone = wait_until(lambda: learner.stats()["actors"] == 0, timeout_s + 5, "the dead actor")
        assert gone - killed >= timeout_s - 0.2
        after = learner.stats()
        assert after["permits_in_use"] == 0 and after["partial_episodes"] == 0
        arrived = after["received"] - before["received"]
        assert len(sent) - 1 <= arrived <= len(sent)  # at most the segment on the wire is lost
        last_index = int(sent[arrived - 1][0].rsplit(".", 1)[1])
        unfinished = 0 if last_index == segments - 1 else last_index + 1
        dropped += unfinished
        assert (
            after["dropped_incomplete_episode"] - before["dropped_incomplete_episode"] == unfinished
        )
        whole = dict(sent[: arrived - unfinished])
        assert after["queued_episodes"] * segments == len(whole) > 0
        batch = learner.get_batch(0, after["queued_episodes"])
        assert batch is not None
        assert_whole_episodes(batch)
        assert {seg.traj_id: segment_digest(seg) for seg in batch} == whole
    assert dropped > 0
    stats = learner.stats()
    assert stats["accepted"] == stats["handed_out"] + stats["dropped_incomplete_episode"]
    assert stats["rejected_invalid"] == 0 and stats["queue_bytes"] == 0
    assert broker.proc.poll() is None


# ------------------------------------------------------------------------------- 3. the spool
@pytest.mark.system
def test_spool_survives_kill_9(start_broker, tmp_path):
    spool = tmp_path / "spool"
    broker = start_broker({"broker.spool_dir": str(spool)})
    learner = ScriptedLearner(broker.address, "learner")
    learner.hello(batch_size=4)
    manifest, chunks = learner.publish(0, nbytes=1 << 20, chunk_bytes=256 << 10)
    actor = ScriptedActor(broker.address, "actor")
    actor.hello()
    actor.sync_weights()
    permits = wait_until_permits(actor, 4)
    acked = [seg for permit in permits[:3] for seg in actor.play(permit, segments=2)]
    unfinished = actor.play(permits[3], segments=1, finish=False)
    acked += unfinished

    broker.kill()
    restored = broker.start()
    assert restored["policy_version"] == 0
    assert restored["queued_episodes"] == 3 and restored["partial_episodes"] == 1

    late = ScriptedActor(broker.address, "late")
    info = late.request("WEIGHTS_INFO")
    assert info.header["manifest"] == manifest  # the same version, chunk for chunk (sha256)
    fetched = fetch_chunks(late, info.header["manifest"])
    assert [bytes(c) for c in fetched] == [bytes(c) for c in chunks]

    # The actor's permits survived: a resent segment is a known duplicate, the open episode can end.
    assert actor.request("TRAJ", acked[0].header(), acked[0].arrays()).header.get("duplicate")
    episode = unfinished[0].episode_id
    acked.append(actor.send_segment(permits[3], episode, 1, last=True))
    learner.hello(batch_size=4)
    batch = learner.get_batch(0, 4)
    assert batch is not None
    assert_whole_episodes(batch)
    assert sorted(seg.traj_id for seg in batch) == sorted(seg.traj_id for seg in acked)
    assert not list((spool / "segments").iterdir())  # handed out, so no longer spooled


@pytest.mark.system
def test_spool_restores_episodes_in_segment_order_whatever_the_file_times(start_broker, tmp_path):
    """Coarse file timestamps must not reorder an episode: restore goes by permit and segment
    index. The episodes form one group, whose size survives the restart too."""
    spool = tmp_path / "spool"
    broker = start_broker({"broker.spool_dir": str(spool)})
    learner, actor = learner_and_actor(broker, batch_size=2)
    done, playing = wait_until_permits(actor, 2, group=2)
    sent = actor.play(done, segments=2, group_id="g")
    sent += actor.play(playing, segments=3, finish=False, group_id="g")

    broker.kill()
    files = sorted((spool / "segments").glob("*.msgpack"))  # permits 0 and 1: names sort right
    assert len(files) == 5
    for age, path in enumerate(files):  # the newest segment gets the oldest time
        os.utime(path, ns=(1_000_000_000 * (100 - age),) * 2)
    restored = broker.start()
    assert restored["queued_episodes"] == 1 and restored["partial_episodes"] == 1

    sent.append(actor.send_segment(playing, sent[-1].episode_id, 3, last=True, group_id="g"))
    learner.hello(batch_size=2)
    batch = learner.get_batch(0, 1)  # one episode asked for, the whole group of two handed out
    assert batch is not None
    assert_whole_episodes(batch)
    assert [seg.traj_id for seg in batch] == [seg.traj_id for seg in sent]


@pytest.mark.system
def test_a_failing_spool_write_is_not_acknowledged_and_survived(start_broker, tmp_path):
    """Disk full or gone: the segment gets a retryable ERROR instead of an ACK, so the actor resends
    it; nothing accepted is lost and the broker keeps serving. Tests run as root, which chmod does
    not stop, so the spool's segment directory is replaced by a file."""
    spool = tmp_path / "spool"
    broker = start_broker({"broker.spool_dir": str(spool)})
    learner, actor = learner_and_actor(broker, batch_size=1)
    first, second = wait_until_permits(actor, 2)
    kept = actor.play(first, segments=2)

    segments, moved = spool / "segments", spool / "moved"
    segments.rename(moved)
    segments.write_bytes(b"")
    seg = make_segment(
        permit=second, actor_id=actor.id, episode_id="second", index=0, last=True, version=0
    )
    with pytest.raises(TransportError) as exc:
        actor.request("TRAJ", seg.header(), seg.arrays())
    assert (exc.value.code, exc.value.retryable) == ("spool_error", True)
    batch = learner.get_batch(0, 1)  # handing out needs the spool too (deleting)
    assert batch is not None and [s.traj_id for s in batch] == [s.traj_id for s in kept]
    stats = learner.stats()
    assert stats["rejected_spool_error"] == 1 and stats["spool_errors"] >= 2
    assert stats["accepted"] == 2 and stats["rejected_invalid"] == 0
    assert broker.proc.poll() is None

    segments.unlink()  # the disk works again
    moved.rename(segments)
    reply = actor.request("TRAJ", seg.header(), seg.arrays())
    assert reply.kind == "ACK" and not reply.header.get("duplicate")
    batch = learner.get_batch(0, 1)
    assert batch is not None and [s.traj_id for s in batch] == [seg.traj_id]
    wait_until(lambda: not list(segments.iterdir()), 5, "handed-out segments to leave the spool")


@pytest.mark.system
def test_sigterm_stops_the_broker_while_a_learner_waits(start_broker, tmp_path):
    broker = start_broker({"broker.spool_dir": str(tmp_path / "spool"), "broker.batch_wait_s": 30})
    learner = ScriptedLearner(broker.address, "learner", timeout_s=1.0)
    learner.hello(batch_size=4)
    learner.publish(0)
    with pytest.raises(TransportError):  # parked: nothing to train on yet
        learner.get_batch(0, 4)
    started = time.monotonic()
    assert broker.terminate() == 0
    assert time.monotonic() - started < 5
    assert (tmp_path / "spool" / "state.json").exists()


# -------------------------------------------------------------------------------- 4. bad input
class Feed:
    """A registered actor with one open episode: each test sends a broken segment, then a valid one
    (which is accepted only if the rejection changed nothing)."""

    def __init__(self, address: str):
        self.learner = ScriptedLearner(address, "learner")
        self.learner.hello(batch_size=1)
        self.learner.publish(0)
        self.actor = ScriptedActor(address, "actor")
        self.actor.hello()
        self.actor.sync_weights()
        (self.permit,) = wait_until_permits(self.actor, 1)
        self.intruder = ScriptedActor(address, "intruder")
        self.next_index = 0

    def segment(self, num_tokens: int = 16):
        return make_segment(
            turns(num_tokens),
            permit=self.permit,
            actor_id=self.actor.id,
            episode_id="bad-input",
            index=self.next_index,
            last=False,
            version=0,
        )

    def frames(self, seg, tensors=None, **header) -> list[bytes]:
        head = {**seg.header(), "id": self.actor.id, "req": 1, **header}
        return [bytes(f) for f in encode("TRAJ", head, tensors or seg.arrays())]

    def forged(self, seg) -> tuple[ScriptedActor, list[bytes]]:
        """The actor's segment, under its permit, sent by another registered actor."""
        self.intruder.hello()  # registered now, whatever the heartbeat timeout did meanwhile
        return self.intruder, self.frames(seg, id=self.intruder.id)

    def impersonated(self, seg) -> list[bytes]:
        """The actor's own connection speaking under another registered actor's id."""
        self.intruder.hello()
        return self.frames(seg, id=self.intruder.id)

    def send_valid(self) -> None:
        seg = self.segment()
        assert self.actor.request("TRAJ", seg.header(), seg.arrays()).kind == "ACK"
        self.next_index += 1


def repack(frames: list[bytes], edit) -> list[bytes]:
    """The frames with their msgpack header edited in place by ``edit``."""
    head = msgpack.unpackb(frames[0])
    edit(head)
    return [msgpack.packb(head), *frames[1:]]


def poke(seg, name: str, index: int, value):
    """The segment with one entry of one array changed."""
    getattr(seg, name)[index] = value
    return seg


ACTION, OBSERVATION = 1, 4  # make_segment: token 0 is the prompt, every 4th an observation
BAD_INPUT = {  # case -> (frames built from a valid segment, expected code, expected field)
    "garbage bytes": (lambda f, s: [b"\xc1\x00garbage"], "bad_header", "frame0"),
    "a later proto": (lambda f, s: f.frames(s, proto=PROTO + 1), "bad_proto", "proto"),
    "unknown kind": (lambda f, s: f.frames(s, kind="SUBMIT"), "unknown_kind", "kind"),
    "missing field": (
        lambda f, s: repack(f.frames(s), lambda h: h.pop("traj_id")),
        "missing_field",
        "traj_id",
    ),
    "wrong type": (lambda f, s: f.frames(s, segment="0"), "bad_type", "segment"),
    "frame count mismatch": (lambda f, s: f.frames(s)[:-1], "frame_count", "tensors"),
    "size mismatch": (
        lambda f, s: repack(f.frames(s), lambda h: h["tensors"]["tokens"].update(shape=[17])),
        "size_mismatch",
        "tensors.tokens",
    ),
    "dtype not on the wire": (
        lambda f, s: repack(f.frames(s), lambda h: h["tensors"]["tokens"].update(dtype=">f8")),
        "bad_dtype",
        "tensors.tokens.dtype",
    ),
    "float tokens": (
        lambda f, s: f.frames(s, tensors={**s.arrays(), "tokens": s.tokens.astype("<f4")}),
        "bad_dtype",
        "tokens",
    ),
    "NaN log-probs": (
        lambda f, s: f.frames(poke(s, "behavior_logprobs", ACTION, np.nan)),
        "non_finite",
        "behavior_logprobs",
    ),
    "reward on an observation token": (
        lambda f, s: f.frames(poke(s, "rewards", OBSERVATION, 1.0)),
        "bad_value",
        "rewards",
    ),
    "future version": (  # the broker's newest version is 0
        lambda f, s: f.frames(poke(s, "versions", ACTION, 1)),
        "future_version",
        "versions",
    ),
    "unknown permit": (
        lambda f, s: f.frames(s, permit="no-such-permit"),
        "unknown_permit",
        "permit",
    ),
    "another actor's segment": (lambda f, s: f.forged(s), "actor_mismatch", "actor_id"),
    "another actor's id": (lambda f, s: f.impersonated(s), "actor_mismatch", "id"),
}


@pytest.fixture(scope="module")
def bad_input_broker(tmp_path_factory):
    log = tmp_path_factory.mktemp("bad-input") / "broker.log"
    with BrokerProcess(log, {**FAST, "broker.max_message_bytes": 1 << 20}) as broker:
        yield broker, Feed(broker.address)


@pytest.mark.parametrize("case", list(BAD_INPUT))
@pytest.mark.system
def test_malformed_message_is_rejected_counted_and_survived(bad_input_broker, case):
    broker, feed = bad_input_broker
    build, code, field = BAD_INPUT[case]
    before = feed.learner.stats()
    built = build(feed, feed.segment())
    sender, frames = built if isinstance(built, tuple) else (feed.actor, built)
    reply = sender.send_raw(frames)
    assert reply is not None and reply.kind == "ERROR", reply
    assert (reply.header["code"], reply.header["field"]) == (code, field), reply.header
    after = feed.learner.stats()
    assert after.get(f"rejected_{code}", 0) == before.get(f"rejected_{code}", 0) + 1
    assert after["rejected_invalid"] == before["rejected_invalid"] + 1
    assert after["accepted"] == before["accepted"]
    feed.send_valid()  # the broker still serves, and the rejection changed nothing
    assert broker.proc.poll() is None


@pytest.mark.system
def test_oversized_frame_is_dropped_by_zeromq(bad_input_broker):
    broker, feed = bad_input_broker
    before = feed.learner.stats()
    seg = feed.segment(num_tokens=300_000)  # its tokens frame alone is 1.2 MB > 1 MiB
    assert feed.actor.send_raw(feed.frames(seg), timeout_s=1.0) is None  # no reply at all
    after = feed.learner.stats()
    assert after["received"] == before["received"]  # it never reached the broker's code
    feed.send_valid()
    assert broker.proc.poll() is None


@pytest.mark.system
def test_oversized_message_of_small_frames_is_rejected(bad_input_broker):
    """ZMQ_MAXMSGSIZE limits each frame; the decoder limits the whole message."""
    broker, feed = bad_input_broker
    before = feed.learner.stats()
    seg = feed.segment(num_tokens=200_000)  # every frame < 1 MiB, 3.4 MB in all
    reply = feed.actor.send_raw(feed.frames(seg))
    assert reply is not None and reply.kind == "ERROR", reply
    assert (reply.header["code"], reply.header["field"]) == ("too_large", "frames")
    after = feed.learner.stats()
    assert after["rejected_too_large"] == before.get("rejected_too_large", 0) + 1
    assert after["received"] == before["received"]
    feed.send_valid()
    assert broker.proc.poll() is None


# ------------------------------------------------------------------------------------ 5. Curve
def generate_keys(out: Path, name: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "deploy.cli", "keys", "generate", "--out", str(out), "--name", name],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )


@pytest.mark.system
def test_curve_admits_only_authorized_keys_each_to_its_role(start_broker, tmp_path):
    """Two allow-lists: the learner's key may take the learner role, an actor's key may act. An
    actor key can neither become the learner nor publish or take batches; an unknown key gets no
    reply at all."""
    keys, actors, learners = tmp_path / "keys", tmp_path / "actors", tmp_path / "learners"
    for name in ("broker", "trainer", "worker", "intruder"):
        generate_keys(keys, name)
    for folder, name in ((actors, "worker"), (learners, "trainer")):
        folder.mkdir()
        (folder / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())

    def client_security(name: str) -> SecurityConfig:
        return SecurityConfig(
            curve=True,
            server_public_key_file=str(keys / "broker.key"),
            client_secret_key_file=str(keys / f"{name}.key_secret"),
            authorized_keys_dir=str(actors),  # who may fetch from its chunk server
            learner_keys_dir=str(learners),
        )

    broker = start_broker(
        {
            "security.curve": True,
            "security.server_secret_key_file": str(keys / "broker.key_secret"),
            "security.authorized_keys_dir": str(actors),
            "security.learner_keys_dir": str(learners),
        },
        security=client_security("worker"),
    )
    learner = ScriptedLearner(broker.address, "learner", security=client_security("trainer"))
    learner.hello(batch_size=2)
    learner.publish(0)
    actor = ScriptedActor(broker.address, "actor", security=client_security("worker"))
    actor.hello()
    actor.sync_weights()
    (permit,) = wait_until_permits(actor, 1)
    actor.play(permit, segments=1)

    # The actor's key, under any id, cannot take the learner's role or do the learner's work.
    rogue = ScriptedLearner(broker.address, "rogue", security=client_security("worker"))
    with pytest.raises(TransportError) as exc:
        rogue.hello(batch_size=2)
    assert (exc.value.code, exc.value.retryable) == ("forbidden", False)
    manifest, _ = pack_state_dict(synthetic_weights(1000), 1, 1 << 20)
    for kind, header in (
        ("PUBLISH", {"manifest": manifest}),
        ("GET_BATCH", {"version": 0, "n": 1, "publishes_after": False}),
    ):
        for peer in (rogue, Peer(broker.address, "learner", security=client_security("worker"))):
            with pytest.raises(TransportError) as exc:
                peer.request(kind, header)
            assert exc.value.code == "not_learner"
    # The learner's key may not act: no permits for it.
    with pytest.raises(TransportError) as exc:
        ScriptedActor(broker.address, "shadow", security=client_security("trainer")).hello()
    assert exc.value.code == "forbidden"

    for name, security in (("plain", SecurityConfig()), ("intruder", client_security("intruder"))):
        outsider = ScriptedActor(broker.address, name, security=security, timeout_s=1.0)
        outsider.version = 0
        for attempt in (
            outsider.hello,
            lambda o=outsider: o.send_segment(permit, "forged", 1, last=True),
        ):
            with pytest.raises(TransportError) as exc:
                attempt()
            assert exc.value.code == "timeout"  # no reply at all, not even an ERROR
        outsider.close()
    stats = learner.stats()
    assert stats["received"] == 1 and stats["accepted"] == 1  # only the trusted actor's segment
    assert stats["actors"] == 1 and stats["policy_version"] == 0
    assert stats["rejected_forbidden"] == 2 and stats["rejected_not_learner"] == 4


# ----------------------------------------------------------------------------- 6. weight fan-out
@pytest.mark.system
def test_weight_versions_are_visible_on_publish_never_backwards_two_kept(start_broker):
    """The broker holds manifests, never bytes: a version is visible from its PUBLISH on, the
    learner's chunk server serves it, versions never go backwards, and only the newest two are
    kept (WEIGHTS_WHERE for an older one is version_gone)."""
    broker = start_broker()
    learner = ScriptedLearner(broker.address, "learner")
    learner.hello(batch_size=2)
    manifest0, _ = learner.publish(0, nbytes=64 << 10, chunk_bytes=16 << 10)
    late = ScriptedActor(broker.address, "late")
    assert late.hello() == 0 and late.sync_weights() == 0
    assert late.request("WEIGHTS_INFO").header["manifest"] == manifest0
    assert late.source(0).address.endswith(f":{learner.server.port}")

    manifest1, chunks1 = pack_state_dict(synthetic_weights(64 << 10, seed=1), 1, 16 << 10)
    for old in (manifest0,):  # a restarted learner must not roll the actors back
        learner.send_weights(manifest1, chunks1)
        with pytest.raises(TransportError) as exc:
            learner.request("PUBLISH", {"manifest": old})
        assert exc.value.code == "version_backwards"
    assert learner.stats()["rejected_version_backwards"] == 1
    assert late.heartbeat() == 1 and late.sync_weights() == 1

    learner.publish(2)
    manifest3, chunks3 = learner.publish(3)
    for gone in (0, 1):  # only the newest and the one before it are kept
        with pytest.raises(TransportError) as exc:
            late.source(gone)
        assert exc.value.code == "version_gone"
    newcomer = ScriptedActor(broker.address, "newcomer")
    assert newcomer.hello() == 3
    info = newcomer.request("WEIGHTS_INFO").header["manifest"]
    assert info == manifest3
    assert [bytes(c) for c in fetch_chunks(newcomer, info)] == [bytes(c) for c in chunks3]


# ------------------------------------------------------------------------------ 7. GRPO groups
@pytest.mark.system
def test_groups_are_handed_out_whole(start_broker):
    """GRPO normalises over a group, so a batch holds all of a group's episodes or none of them,
    however their lengths order their completion."""
    broker = start_broker()
    learner, actor = learner_and_actor(broker, batch_size=4)
    a0, a1, b0, b1 = wait_until_permits(actor, 4, group=2)
    for permit, group_id in ((a0, "a"), (b0, "b"), (b1, "b")):
        actor.play(permit, segments=1, group_id=group_id)
    (playing,) = actor.play(a1, segments=1, finish=False, group_id="a")  # a long episode

    batch = learner.get_batch(0, 1)  # more than asked for rather than half a group
    assert batch is not None and [s.group_id for s in batch] == ["b", "b"]
    assert learner.get_batch(0, 1) is None  # a0 waits for a1
    with pytest.raises(TransportError) as exc:  # every episode of a permit group is one group
        actor.send_segment(a1, playing.episode_id, 1, last=True, group_id="b")
    assert exc.value.code == "bad_value"
    actor.send_segment(a1, playing.episode_id, 1, last=True, group_id="a")
    batch = learner.get_batch(0, 2)
    assert batch is not None and [s.group_id for s in batch] == ["a"] * 3
    assert len(assert_whole_episodes(batch)) == 2


@pytest.mark.system
def test_a_group_whose_actor_died_is_dropped_whole(start_broker):
    """The finished episodes of a group that can never be whole are dropped, not trained alone."""
    timeout_s = 1.0
    broker = start_broker({"broker.heartbeat_timeout_s": timeout_s})
    learner, actor = learner_and_actor(broker, batch_size=2)
    done, playing = wait_until_permits(actor, 2, group=2)
    actor.play(done, segments=2, group_id="g")
    actor.play(playing, segments=1, finish=False, group_id="g")  # and then the actor dies

    wait_until(lambda: learner.stats()["permits_reclaimed"] == 1, 10, "the dead actor's permit")
    stats = learner.stats()
    assert stats["dropped_incomplete_episode"] == 1 and stats["dropped_incomplete_group"] == 2
    assert stats["queued_episodes"] == 0 and stats["queue_bytes"] == 0
    assert learner.get_batch(0, 1) is None
