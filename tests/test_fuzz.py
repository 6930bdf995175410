"""Fuzzing the wire decoder and the broker's socket with malformed messages (> 100k in all).

* In process, hypothesis draws arbitrary frames, arbitrary headers and mutated trajectories
  (6k messages): the decoder (``decode`` + ``Segment.from_wire``, the broker's path) raises
  nothing but ``ProtocolError`` and names a field.
* In process, a seeded mutation sweep (75k messages): every message is invalid by construction
  (a mutation operator breaks exactly one rule of docs/protocol.md), and every one is rejected.
* Over a real socket, 20k messages of the same sweep go to a real ``asyncppo broker`` process:
  each gets an ERROR reply, each is counted under its code in STATS, the broker stays up and its
  resident memory stays bounded; messages over ``broker.max_message_bytes`` are refused by the
  socket itself without costing memory.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator

import msgpack
import numpy as np
import psutil
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_protocol import SEGMENT_ERRORS, make_segment

from common.protocol import PROTO, SCHEMAS, ProtocolError, decode, encode
from common.trajectory import MAX_ID_LEN, MAX_METRICS, Segment
from common.weights import pack_state_dict, validate_manifest
from testkit.peers import BrokerProcess, Peer

LATEST = 10  # the newest policy version the decoder is told about
FUZZ = settings(
    max_examples=2000, database=None, deadline=None, suppress_health_check=list(HealthCheck)
)
ACTOR = "fuzz-actor"  # the registered actor the socket fuzz speaks as, so TRAJ reaches from_wire


def check(frames: list) -> None:
    """What the broker does with a message body: decode, then validate a trajectory."""
    msg = decode(frames, max_bytes=1 << 20)
    if msg.kind == "TRAJ":
        Segment.from_wire(msg.header, msg.tensors, latest_version=LATEST)


def rejection(frames: list) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        check(frames)
    assert info.value.field and info.value.field in str(info.value)
    return info.value


# ---------------------------------------------------------------------------------- hypothesis
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
FIELDS = sorted({name for schema in SCHEMAS.values() for name in schema} | {"id", "req", "tensors"})


@FUZZ
@given(st.lists(st.binary(max_size=96), min_size=1, max_size=5))
def test_arbitrary_frames_are_rejected(frames):
    rejection(frames)


@FUZZ
@given(
    kind=st.sampled_from(sorted(SCHEMAS)),
    header=st.dictionaries(
        st.sampled_from(FIELDS) | st.text(max_size=8), msgpack_values, max_size=8
    ),
    extra=st.lists(st.binary(max_size=16), max_size=2),
)
def test_arbitrary_headers_only_ever_raise_protocol_errors(kind, header, extra):
    frames = [msgpack.packb({**header, "proto": PROTO, "kind": kind}, use_bin_type=True), *extra]
    try:
        check(frames)
    except ProtocolError as exc:
        assert exc.field in str(exc)


@FUZZ
@given(
    key=st.sampled_from(["dtype", "shape", "frame", None]),
    value=msgpack_values | st.lists(st.integers(-(2**63), 2**64 - 1), max_size=5),
)
def test_arbitrary_tensor_descriptors_only_ever_raise_protocol_errors(key, value):
    """Containers, huge and zero dimensions in a descriptor: a ProtocolError, never a crash."""
    frames = [bytes(f) for f in encode("STATS", {"id": "a1"}, {"x": np.zeros(4, np.uint8)})]
    head = head_of(frames)
    head["tensors"]["x"] = value if key is None else {**head["tensors"]["x"], key: value}
    try:
        decode([msgpack.packb(head, use_bin_type=True), *frames[1:]])
    except ProtocolError as exc:
        assert exc.field in str(exc)


@FUZZ
@given(
    where=st.sampled_from(["", "chunks", "tensors"]),
    key=st.sampled_from(
        ["version", "chunk_bytes", "total_bytes", "nbytes", "sha256", "name", "dtype", "shape"]
        + ["offset", "chunks", "tensors"]
    ),
    value=msgpack_values,
)
def test_arbitrary_weight_manifests_only_ever_raise_protocol_errors(where, key, value):
    manifest, _ = pack_state_dict({"w": torch.zeros(8)}, 1, 16)
    if where:
        manifest[where][0] = {**manifest[where][0], key: value}
    else:
        manifest[key] = value
    try:
        validate_manifest(manifest)
    except ProtocolError as exc:
        assert exc.code == "bad_manifest" and exc.field.startswith("manifest")


ARRAY_VALUES = {  # any value each wire dtype can hold, NaN and inf included
    "tokens": st.integers(-(2**31), 2**31 - 1),
    "action_mask": st.integers(0, 255),
    "behavior_logprobs": st.floats(width=32),
    "versions": st.integers(-(2**31), 2**31 - 1),
    "rewards": st.floats(width=32),
}


@FUZZ
@given(data=st.data(), field=st.sampled_from(sorted(SCHEMAS["TRAJ"]) + sorted(ARRAY_VALUES)))
def test_mutated_trajectories_are_rejected_or_valid(data, field):
    """One header field gets any value, or one array any length and values: a Segment or an error."""
    seg = make_segment()
    header, arrays = {"id": "a1", **seg.header()}, seg.arrays()
    if field in ARRAY_VALUES:
        values = data.draw(st.lists(ARRAY_VALUES[field], max_size=10))
        arrays[field] = np.array(values, dtype=arrays[field].dtype)
    else:
        header[field] = data.draw(msgpack_values)
    try:
        check([bytes(f) for f in encode("TRAJ", header, arrays)])
    except ProtocolError as exc:
        assert exc.field in str(exc)
        if len(arrays[field if field in arrays else "tokens"]) != seg.num_tokens:
            assert exc.code in ("length_mismatch", "empty"), exc


# ------------------------------------------------------------------------- the mutation sweep
# Each operator turns a valid message into one that breaks one rule; none can produce a valid one.


def frames_of(kind: str, header: dict, tensors: dict | None = None) -> list[bytes]:
    return [bytes(f) for f in encode(kind, {"id": ACTOR, **header}, tensors)]


SEGMENT = make_segment()
GOOD = {
    "TRAJ": frames_of("TRAJ", SEGMENT.header(), SEGMENT.arrays()),
    "HELLO": frames_of("HELLO", {"role": "actor", "version": 0}),
    "PERMITS_REQ": frames_of("PERMITS_REQ", {"n": 2, "version": 0}),
    "GET_BATCH": frames_of("GET_BATCH", {"version": 0, "n": 4, "publishes_after": True}),
    "WEIGHTS_CHUNK": frames_of(  # what a peer's chunk server answers: untrusted too
        "WEIGHTS_CHUNK", {"version": 1, "chunk": 0}, {"data": np.zeros(64, np.uint8)}
    ),
}
WRONG_TYPES = [None, "x", 1.5, True, [1], {"a": 1}, b"\x00"]  # True is wrong for an int field
BAD_SEGMENTS = [overrides for overrides, _, _ in SEGMENT_ERRORS.values()] + [
    {"permit": "p" * (MAX_ID_LEN + 1)},
    {"metrics": {f"m{i}": i for i in range(MAX_METRICS + 1)}},
]


def head_of(frames: list) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def with_head(frames: list, **changes) -> list:
    return [msgpack.packb({**head_of(frames), **changes}, use_bin_type=True), *frames[1:]]


def garbage_header(rng: random.Random, frames: list) -> list:
    return [bytes([0xC1]) + rng.randbytes(rng.randrange(64)), *frames[1:]]  # 0xC1 is never msgpack


def truncated_header(rng: random.Random, frames: list) -> list:
    return [frames[0][: rng.randrange(len(frames[0]))], *frames[1:]]


def wrong_type(rng: random.Random, frames: list) -> list:
    name, (types_, _) = rng.choice(list(SCHEMAS[head_of(frames)["kind"]].items()))
    wrong = [
        v
        for v in WRONG_TYPES
        if not isinstance(v, types_) or (isinstance(v, bool) and bool not in types_)
    ]
    return with_head(frames, **{name: rng.choice(wrong)})


def missing_field(rng: random.Random, frames: list) -> list:
    head = head_of(frames)  # only a required field's absence breaks the message
    del head[
        rng.choice(sorted(n for n, (_, required) in SCHEMAS[head["kind"]].items() if required))
    ]
    return [msgpack.packb(head, use_bin_type=True), *frames[1:]]


def bad_envelope(rng: random.Random, frames: list) -> list:
    key, values = rng.choice(
        [
            ("proto", [0, 1, PROTO + 1, str(PROTO), None, [PROTO]]),
            ("kind", ["", "traj", "EXPLODE", 7, None]),
            ("req", ["1", 1.5, None, [0]]),
        ]
    )
    return with_head(frames, **{key: rng.choice(values)})


def bad_descriptor(rng: random.Random, frames: list) -> list:
    head = head_of(frames)
    key, values = rng.choice(
        [
            ("dtype", [">i4", "|O", "<f8", "V8", 4, None]),
            ("shape", [[-1], "8", [1, 1, 1, 1, 1], [2**40], [0.5]]),
            ("frame", [0, 99, -1, "1", None]),
        ]
    )
    head["tensors"][rng.choice(sorted(head["tensors"]))][key] = rng.choice(values)
    return [msgpack.packb(head, use_bin_type=True), *frames[1:]]


def bad_frames(rng: random.Random, frames: list) -> list:
    i = rng.randrange(1, len(frames))
    cut = frames[i][: rng.randrange(len(frames[i]))]
    return rng.choice(
        [frames[:i] + frames[i + 1 :], [*frames, b"extra"], [*frames[:i], cut, *frames[i + 1 :]]]
    )


def bad_segment(rng: random.Random, frames: list) -> list:
    """Decodable and schema-valid, but not a trajectory an actor could have produced."""
    seg = make_segment(**rng.choice(BAD_SEGMENTS))
    return frames_of("TRAJ", seg.header(), seg.arrays())


ALL, WITH_TENSORS = tuple(GOOD), ("TRAJ", "WEIGHTS_CHUNK")
OPERATORS: list[tuple[Callable[[random.Random, list], list], tuple[str, ...]]] = [
    (garbage_header, ALL),
    (truncated_header, ALL),
    (wrong_type, ALL),
    (missing_field, ALL),
    (bad_envelope, ALL),
    (bad_descriptor, WITH_TENSORS),
    (bad_frames, WITH_TENSORS),
    (bad_segment, ("TRAJ",)),
]


def malformed(seed: int, count: int) -> Iterator[list]:
    """``count`` invalid messages, reproducible from ``seed``."""
    rng = random.Random(seed)
    for _ in range(count):
        op, kinds = rng.choice(OPERATORS)
        yield op(rng, GOOD[rng.choice(kinds)])


SWEEP_MESSAGES = 75_000


def test_mutation_sweep_rejects_every_message():
    codes = Counter(rejection(frames).code for frames in malformed(seed=1, count=SWEEP_MESSAGES))
    assert sum(codes.values()) == SWEEP_MESSAGES
    for code in (
        "bad_header",
        "bad_type",
        "missing_field",
        "bad_proto",
        "unknown_kind",
        "bad_dtype",
        "bad_shape",
        "bad_frame",
        "frame_count",
        "size_mismatch",
        "non_finite",
        "bad_value",
        "future_version",
        "length_mismatch",
        "no_actions",
    ):
        assert codes[code] > 0, (code, codes)


# ------------------------------------------------------------------------------- the socket
SOCKET_MESSAGES = 20_000


def rejected_counts(stats: dict) -> Counter:
    return Counter(
        {
            k[len("rejected_") :]: v
            for k, v in stats.items()
            if k.startswith("rejected_") and k != "rejected_invalid" and v
        }
    )


@pytest.mark.timeout(300)
@pytest.mark.system
def test_broker_survives_a_socket_fuzz(tmp_path):
    limit = 1 << 20
    with BrokerProcess(tmp_path / "broker.log", {"broker.max_message_bytes": limit}) as broker:
        process = psutil.Process(broker.proc.pid)
        actor = Peer(broker.address, ACTOR)
        actor.request("HELLO", {"role": "actor", "version": 0})
        replies: Counter = Counter()
        for i, frames in enumerate(malformed(seed=2, count=SOCKET_MESSAGES)):
            reply = actor.send_raw(frames, timeout_s=10.0)
            assert reply is not None and reply.kind == "ERROR", (i, reply)
            replies[reply.header["code"]] += 1
            if i == 2_000:  # after warm-up: logging, msgpack and numpy buffers
                baseline = process.memory_info().rss
        grown = process.memory_info().rss - baseline
        stats = actor.stats()
        # Every message answered, and counted under the code it was answered with; trajectories
        # got as far as the segment checks (the fuzzing client is a registered actor).
        assert sum(replies.values()) == SOCKET_MESSAGES
        assert rejected_counts(stats) == replies
        assert replies["non_finite"] > 0 and replies["length_mismatch"] > 0
        assert stats["accepted"] == 0 and stats["queue_bytes"] == 0
        assert grown < 32 << 20, f"broker RSS grew by {grown / 2**20:.1f} MiB"

        # Over the size limit the socket drops the message (and the peer) before the broker sees it.
        flood = zmq.Context.instance().socket(zmq.DEALER)
        flood.setsockopt(zmq.LINGER, 2000)  # close() waits until the messages went out
        flood.connect(broker.address)
        for _ in range(20):
            flood.send_multipart([GOOD["HELLO"][0], b"\x00" * (2 * limit)])
        flood.close()
        assert rejected_counts(actor.stats()) == replies and broker.proc.poll() is None
        assert process.memory_info().rss - baseline < 32 << 20
        actor.close()
