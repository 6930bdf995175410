"""The broker as an attack surface, tested against a real ``asyncppo broker`` process.

* Schema-driven fuzz: from the protocol's own schema (``common.protocol.SCHEMAS``), every field of
  every request kind, every tensor descriptor key and every nested weight-manifest key gets values
  of every wrong type (containers, huge and negative ints, booleans, floats, NaN, bytes, long
  strings, deep nesting) and extreme shapes and dtypes. Each goes over a socket to a live broker
  with a spool, between the valid segments of a real actor. The broker must answer every request,
  never raise internally, keep serving, and after a kill -9 and restart still hold every accepted
  segment and hand each to the learner exactly once.
* Identity: an actor id and the learner role belong to the connection that registered them, and
  are taken over only after their lease; a reconnecting reference client keeps its identity.
* Bounded state: ids are bounded, per-actor state goes with the actor, STATS stays small.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from common.config import load_config
from common.protocol import CLIENT_KINDS, SCHEMAS, encode
from common.transport import Client, Endpoint, TransportError, free_port
from common.weights import pack_state_dict
from testkit.peers import BrokerProcess, Peer, ScriptedActor, ScriptedLearner
from testkit.segments import make_segment, segment_digest, synthetic_weights


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


# Every msgpack type, at its edges. Each is wrong for some field; none may crash the broker.
VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
    1.5,
    -0.0,
    float("nan"),
    float("inf"),
    "",
    "x",
    "é" * 20,
    "x" * 5000,
    b"",
    [],
    [1, "a", None],
    ["p"] * 300,
    {},
    {"k": [1, {"d": None}]},
    nested(400),
]
SHAPES: list[Any] = [
    [0, 2**63],
    [2**63, 0],
    [0, 2**31, 2**31, 2**31],
    [2**40, 2**40],
    [-1],
    [1, 1, 1, 1, 1],
    [1.0],
    [True],
    ["1"],
    [[1]],
    [{}],
    [0] * 4,
]
DTYPES: list[Any] = [">i4", "<f8", "|O", "V8", "<M8", "|b1", "<i4", ["<i4"], {"a": 1}, 4, None]
SEGMENT = make_segment(
    permit="no-such-permit", actor_id="fuzz", episode_id="fz", index=0, last=True, version=0
)


def base_messages(latest: int) -> dict[str, tuple[dict, dict | None]]:
    """A well-formed request of every client kind: (header, tensors). Mutations start here.

    The trajectory names a permit nobody holds, so no mutation of it can be accepted; the rest
    may be valid, and then are served as any valid request is.
    """
    manifest, _ = pack_state_dict(synthetic_weights(64, seed=latest + 1), latest + 1, 32)
    return {
        "HELLO": ({"role": "actor", "version": latest, "held_permits": []}, None),
        "HEARTBEAT": ({"version": latest}, None),
        "PERMITS_REQ": ({"n": 1, "version": latest + 100, "group": 1}, None),
        "TRAJ": (SEGMENT.header(), SEGMENT.arrays()),
        "BYE": ({}, None),
        "WEIGHTS_INFO": ({}, None),
        "WEIGHTS_WHERE": ({"version": latest, "failed": []}, None),
        "STATS": ({}, None),
        "GET_BATCH": ({"version": latest, "n": 1, "publishes_after": False}, None),
        "PUBLISH": ({"manifest": manifest}, None),
    }


def packed(head: dict, frames: list) -> list:
    return [msgpack.packb(head, use_bin_type=True), *frames[1:]]


def header_mutations(kind: str, header: dict, tensors: dict | None, client: str) -> Iterator[list]:
    """Every field of the kind's schema, and the envelope fields, set to every value; each
    field also left out."""
    frames = [bytes(f) for f in encode(kind, {**header, "id": client, "req": 7}, tensors)]
    head = msgpack.unpackb(frames[0], raw=False)
    for name in ["proto", "kind", "req", "id", "tensors", *SCHEMAS[kind]]:
        for value in VALUES:
            yield packed({**head, name: value}, frames)
        yield packed({k: v for k, v in head.items() if k != name}, frames)


def tensor_mutations(kind: str, header: dict, tensors: dict, client: str) -> Iterator[list]:
    """Each descriptor's dtype, shape and frame set to extreme and wrong values; byte frames that
    disagree; ``|b1`` bytes other than 0/1; a 2-D weight chunk."""
    frames = [bytes(f) for f in encode(kind, {**header, "id": client, "req": 8}, tensors)]
    head = msgpack.unpackb(frames[0], raw=False)
    for name in head["tensors"]:
        for key, values in (("dtype", DTYPES), ("shape", SHAPES), ("frame", VALUES)):
            for value in values:
                descs = {**head["tensors"], name: {**head["tensors"][name], key: value}}
                yield packed({**head, "tensors": descs}, frames)
        for value in VALUES:
            yield packed({**head, "tensors": {**head["tensors"], name: value}}, frames)
    first = next(iter(head["tensors"]))
    for dtype, shape, raw in (
        ("|b1", [4], b"\x00\x01\x02\xff"),
        ("|u1", [2, 2], b"\x00\x01\x02\x03"),
        ("|u1", [0, 2**31 - 1], b""),
    ):
        descs = {**head["tensors"], first: {"dtype": dtype, "shape": shape, "frame": 1}}
        yield [msgpack.packb({**head, "tensors": descs}, use_bin_type=True), raw, *frames[2:]]


def manifest_mutations(header: dict, client: str) -> Iterator[list]:
    """Every key of a weight manifest, of its first chunk and of its first tensor, set to every
    value (and extreme shapes)."""
    manifest = header["manifest"]
    frames = [bytes(f) for f in encode("PUBLISH", {"manifest": manifest, "id": client})]

    def with_manifest(m: dict) -> list:
        return packed({**msgpack.unpackb(frames[0], raw=False), "manifest": m}, frames)

    for key in manifest:
        for value in VALUES:
            yield with_manifest({**manifest, key: value})
    for listed in ("chunks", "tensors"):
        entry = manifest[listed][0]
        for key in [*entry, None]:
            for value in VALUES + (SHAPES if key == "shape" else []):
                changed = value if key is None else {**entry, key: value}
                yield with_manifest({**manifest, listed: [changed, *manifest[listed][1:]]})


def schema_fuzz(latest: int, client: str, kinds: set[str]) -> Iterator[tuple[str, list]]:
    """(kind, frames) for every mutation of every base message of ``kinds``."""
    for kind, (header, tensors) in base_messages(latest).items():
        if kind not in kinds:
            continue
        for frames in header_mutations(kind, header, tensors, client):
            yield kind, frames
        if tensors:
            for frames in tensor_mutations(kind, header, tensors, client):
                yield kind, frames
        if kind == "PUBLISH":
            for frames in manifest_mutations(header, client):
                yield kind, frames
    for raw in (b"\x91" * 5000 + b"\xc0", b"\xdf\xff\xff\xff\xff", b"\xc1", b"", b"\x80"):
        yield "frame0", [raw]


ACTOR_SIDE = CLIENT_KINDS - {"GET_BATCH", "PUBLISH"}


def send_all(peer: Peer, messages: Iterator[tuple[str, list]], broker: BrokerProcess) -> Counter:
    """Send each message and wait for its reply; the reply kinds (ERROR codes) seen."""
    seen: Counter = Counter()
    for i, (kind, frames) in enumerate(messages):
        reply = peer.send_raw(frames, timeout_s=10.0)
        assert reply is not None, f"no reply to fuzz message {i} ({kind}): {broker.log_tail()}"
        seen[reply.header["code"] if reply.kind == "ERROR" else reply.kind] += 1
        assert broker.proc.poll() is None, broker.log_tail()
    return seen


@pytest.mark.timeout(300)
@pytest.mark.system
def test_schema_fuzz_never_crashes_the_broker_nor_loses_accepted_data(tmp_path):
    settings = {
        "broker.spool_dir": str(tmp_path / "spool"),
        "broker.max_staleness": 1000,
        "broker.batch_wait_s": 0.2,
        "broker.permits_wait_s": 0.2,
        "broker.max_message_bytes": 1 << 20,
        "broker.heartbeat_timeout_s": 60,
    }
    broker = BrokerProcess(tmp_path / "broker.log", settings)
    broker.start()
    try:
        learner = ScriptedLearner(broker.address, "learner")
        learner.hello(batch_size=4)
        learner.publish(0)
        fuzz = Peer(broker.address, "fuzz")
        fuzz.request("HELLO", {"role": "actor", "version": 0})

        # The learner's own connection fuzzes the learner's kinds (so their handlers see it) ...
        seen = send_all(learner, schema_fuzz(0, "learner", CLIENT_KINDS - ACTOR_SIDE), broker)
        latest = learner.hello(batch_size=4)  # the fuzz may have renamed or re-sized the learner
        latest = learner.publish(latest + 1)[0]["version"]  # the fuzz's versions are not served
        # ... then a real actor plays whole episodes while a registered actor floods the rest.
        good = ScriptedActor(broker.address, "good")
        good.hello()
        good.sync_weights()
        assert good.version == latest
        flood = schema_fuzz(latest, "fuzz", ACTOR_SIDE)
        accepted: dict[str, str] = {}
        for _ in range(6):
            permits: list[str] = []
            while not permits:
                permits = good.permits(1)
            for seg in good.play(permits[0], segments=2):
                accepted[seg.traj_id] = segment_digest(seg)
                fuzz.request("HELLO", {"role": "actor", "version": 0})  # a fuzzed BYE left
                seen += send_all(fuzz, itertools.islice(flood, 150), broker)
        seen += send_all(fuzz, flood, broker)
        stats = Peer(broker.address, "probe").stats()
        assert stats.get("rejected_internal", 0) == 0, broker.log_tail()
        assert stats["accepted"] == len(accepted) == 12
        assert sum(seen.values()) > 2500, seen  # (the broker serves no weight chunks: peers do)
        for code in (
            "bad_type",
            "bad_value",
            "bad_shape",
            "bad_dtype",
            "bad_manifest",
            "bad_header",
        ):
            assert seen[code] > 0, (code, seen)

        # Nothing lost, nothing twice: kill -9, restart from the spool, drain.
        broker.kill()
        broker.start()
        latest = learner.hello(batch_size=4)
        handed: list = []
        deadline = time.monotonic() + 30
        while len(handed) < len(accepted) and time.monotonic() < deadline:
            handed += learner.get_batch(latest, 2, publishes_after=False) or []
        assert sorted(s.traj_id for s in handed) == sorted(accepted)
        assert {s.traj_id: segment_digest(s) for s in handed} == accepted
        assert learner.get_batch(latest, 1, publishes_after=False) is None  # and nothing else
    finally:
        broker.close()


# ------------------------------------------------------------------------------------ identity
@pytest.fixture
def broker(tmp_path):
    settings = {
        "broker.learner_lease_s": 1.0,
        "broker.heartbeat_timeout_s": 2.0,
        "broker.batch_wait_s": 0.2,
        "broker.max_actors": 5,
    }
    with BrokerProcess(tmp_path / "broker.log", settings) as process:
        yield process


@pytest.mark.system
def test_the_learner_role_belongs_to_its_connection_until_its_lease_lapses(broker):
    learner = ScriptedLearner(broker.address, "learner")
    learner.hello(batch_size=2)
    learner.publish(0)
    usurper = ScriptedLearner(broker.address, "usurper")
    namesake = ScriptedLearner(broker.address, "learner")  # the learner's id, another connection
    for claimant in (usurper, namesake):
        with pytest.raises(TransportError) as exc:
            claimant.hello(batch_size=2)
        assert (exc.value.code, exc.value.retryable) == ("learner_taken", True)
    with pytest.raises(TransportError) as exc:
        namesake.publish(1)
    assert exc.value.code == "not_learner"
    for _ in range(3):  # the holder stays in charge while it speaks, whatever the lease
        time.sleep(0.5)
        assert learner.get_batch(0, 1, publishes_after=False) is None  # WAIT: nothing queued
        with pytest.raises(TransportError):
            usurper.hello(batch_size=2)
    time.sleep(1.5)  # silent past learner_lease_s: the role is free
    assert usurper.hello(batch_size=2) == 0
    usurper.publish(1)
    with pytest.raises(TransportError) as exc:
        learner.get_batch(1, 1)
    assert exc.value.code == "not_learner"
    stats = learner.stats()
    assert stats["policy_version"] == 1 and stats["rejected_learner_taken"] == 5


@pytest.mark.system
def test_an_actor_id_belongs_to_its_connection(broker):
    learner = ScriptedLearner(broker.address, "learner")
    learner.hello(batch_size=2)
    learner.publish(0)
    actor = ScriptedActor(broker.address, "a1")
    actor.hello()
    actor.sync_weights()
    (permit,) = actor.permits(1)
    thief = ScriptedActor(broker.address, "a1")
    thief.version = 0
    with pytest.raises(TransportError) as exc:
        thief.hello()
    assert (exc.value.code, exc.value.retryable) == ("id_taken", True)
    for attempt in (
        thief.heartbeat,
        lambda: thief.permits(1),
        lambda: thief.send_segment(permit, "stolen", 0, last=True),
        lambda: thief.request("BYE"),
    ):
        with pytest.raises(TransportError) as exc:
            attempt()
        assert (exc.value.code, exc.value.retryable) == ("actor_mismatch", False)
    with pytest.raises(TransportError) as exc:  # the learner's id is not an actor's
        ScriptedActor(broker.address, "learner").hello()
    assert exc.value.code == "id_taken"
    with pytest.raises(TransportError) as exc:  # and the learner's connection is not an actor
        learner.request("PERMITS_REQ", {"n": 1, "version": 0})
    assert exc.value.code == "unknown_actor"

    # A reference client that reopens its socket keeps its routing id: still the same actor.
    actor.client.reopen()
    actor.play(permit, segments=2)
    stats = learner.stats()
    assert stats["accepted"] == 2 and stats["actors"] == 1 and stats["permits_in_use"] == 0
    # Silent past the heartbeat timeout, the id is reaped and free for another connection.
    time.sleep(2.5)
    assert thief.hello() == 0
    assert learner.stats()["actors"] == 1


@pytest.mark.system
def test_ids_and_per_actor_state_are_bounded(broker):
    learner = ScriptedLearner(broker.address, "learner")
    learner.hello(batch_size=2)
    for bad_id, code in (("a" * 129, "bad_value"), ("a b", "bad_value"), ("", "bad_value")):
        with pytest.raises(TransportError) as exc:
            Peer(broker.address, bad_id).stats()
        assert exc.value.code == code
    actors = [ScriptedActor(broker.address, f"a{i}") for i in range(5)]
    for actor in actors:
        actor.hello()
        actor.heartbeat()
    with pytest.raises(TransportError) as exc:
        ScriptedActor(broker.address, "a5").hello()
    assert (exc.value.code, exc.value.retryable) == ("actor_limit", True)
    assert set(learner.stats()["actor_versions"]) == {f"a{i}" for i in range(5)}
    actors[0].request("BYE")
    stats = learner.stats()
    assert set(stats["actor_versions"]) == {f"a{i}" for i in range(1, 5)}  # nothing kept of a0
    assert stats["actors"] == 4
    ScriptedActor(broker.address, "a5").hello()  # the freed slot is usable


@pytest.mark.system
def test_stats_lists_at_most_a_thousand_actors(tmp_path):
    with BrokerProcess(tmp_path / "broker.log", {"broker.max_actors": 1200}) as process:
        peer = Peer(process.address, "probe")
        for i in range(1100):  # one connection may register many ids
            for kind, header in (("HELLO", {"role": "actor", "version": 0}), ("HEARTBEAT", {})):
                frames = encode(kind, {"version": i, **header, "id": f"actor-{i:05d}"})
                assert peer.send_raw(frames).kind != "ERROR"
        stats = peer.stats()
        assert stats["actors"] == 1100
        assert list(stats["actor_versions"]) == [f"actor-{i:05d}" for i in range(1000)]


# ------------------------------------------------------------------------------ internal errors
def test_an_exception_in_a_handler_is_answered_internal_and_the_broker_serves_on(tmp_path):
    """A bug (not bad input) in one handler: ERROR internal, counted, and the next request served."""
    from broker.server import Broker

    address = f"tcp://127.0.0.1:{free_port()}"
    cfg = load_config(overrides=[f"broker.bind={address}", f"run.out_dir={tmp_path}"])
    server = Broker(cfg)

    def boom(self, msg):
        raise KeyError("a bug")

    server._handlers = {**Broker._handlers, "WEIGHTS_INFO": boom}
    stop = threading.Event()
    loop = threading.Thread(target=server.run, args=(stop.is_set,))
    loop.start()
    client = Client(Endpoint(cfg.security, cfg.broker.max_message_bytes), address, "c1")
    try:
        with pytest.raises(TransportError) as exc:
            client.request("WEIGHTS_INFO")
        assert (exc.value.code, exc.value.retryable) == ("internal", False)
        stats = client.request("STATS").header["stats"]
        assert stats["rejected_internal"] == 1 and stats["rejected_invalid"] == 0
    finally:
        client.close()
        stop.set()
        loop.join(timeout=10)
    assert not loop.is_alive()


def test_documented_limits_match_the_code():
    """docs/protocol.md states each bound the decoder and broker apply."""
    from broker.registry import MAX_LISTED_ACTORS
    from common.protocol import MAX_CLIENT_ID_LEN, MAX_DIM, MAX_ELEMENTS

    doc = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    assert MAX_DIM == 2**31 - 1 and "[0, 2³¹ − 1]" in doc
    assert MAX_ELEMENTS == 2**40 and "at most 2⁴⁰" in doc
    assert f"1 to {MAX_CLIENT_ID_LEN} characters" in doc
    assert f"at most {MAX_LISTED_ACTORS} entries" in doc
    assert math.isclose(load_config().broker.learner_lease_s, 30.0)
    assert "`broker.learner_lease_s` (default 30 s)" in doc
