"""Wire protocol: round trips, and every kind of malformed message rejected with a named field."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from common.protocol import ProtocolError, decode, encode
from common.trajectory import Segment
from testkit.segments import make_segment as segment_of


def make_segment(**overrides) -> Segment:
    """Two turns at versions 3 and 4 with rewards 0.5 and 1.0: every field a wire check reads."""
    fields = dict(
        traj_id="t1",
        episode_id="e1",
        actor_id="a1",
        permit="p1",
        task="digits",
        tokens=np.array([5, 6, 7, 8, 9, 10], dtype="<i4"),
        behavior_logprobs=np.array([0, 0, -0.5, -1.0, 0, -0.25], dtype="<f4"),
        versions=np.array([-1, -1, 3, 3, -1, 4], dtype="<i4"),
        rewards=np.array([0, 0, 0, 0.5, 0, 1.0], dtype="<f4"),
        metrics={"success": True, "turns": 2},
    )
    return segment_of("ooaaoa", **{**fields, **overrides})


def wire(seg: Segment) -> list:
    return [bytes(f) for f in encode("TRAJ", {"id": "a1", **seg.header()}, seg.arrays())]


def roundtrip(frames: list, latest: int = 10) -> Segment:
    msg = decode(frames)
    return Segment.from_wire(msg.header, msg.tensors, latest_version=latest)


def test_segment_round_trip_is_exact():
    seg = make_segment()
    back = roundtrip(wire(seg))
    assert back.header() == seg.header()
    for name, arr in seg.arrays().items():
        got = getattr(back, name)
        assert got.dtype == arr.dtype and np.array_equal(got, arr), name
    assert back.min_version == 3 and back.reward == 1.5 and back.num_action_tokens == 3


def test_many_tensors_and_zero_sized_frames_round_trip():
    frames = encode(
        "BATCH",
        {"batch_id": 1, "segments": []},
        {"a": np.zeros(0, dtype="<f4"), "b": np.arange(12, dtype="<i8").reshape(3, 4)},
    )
    msg = decode([bytes(f) for f in frames])
    assert msg.tensors["a"].shape == (0,) and msg.tensors["b"][2, 3] == 11


def header_of(frames: list) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def with_header(frames: list, **changes) -> list:
    head = header_of(frames)
    for key, value in changes.items():
        if value is KeyError:
            head.pop(key)
        else:
            head[key] = value
    return [msgpack.packb(head, use_bin_type=True), *frames[1:]]


def bad_desc(frames: list, name: str, **changes) -> list:
    head = header_of(frames)
    head["tensors"][name].update(changes)
    return [msgpack.packb(head, use_bin_type=True), *frames[1:]]


GOOD = wire(make_segment())
MALFORMED = {
    "garbage": ([b"\xc1\xff\x00garbage"], "bad_header", "frame0"),
    "not a map": ([msgpack.packb([1, 2])], "bad_header", "frame0"),
    "wrong proto": (with_header(GOOD, proto=7), "bad_proto", "proto"),
    "unknown kind": (with_header(GOOD, kind="EXPLODE"), "unknown_kind", "kind"),
    "missing field": (with_header(GOOD, traj_id=KeyError), "missing_field", "traj_id"),
    "wrong type": (with_header(GOOD, segment="zero"), "bad_type", "segment"),
    "bool is not int": (with_header(GOOD, segment=True), "bad_type", "segment"),
    "frame count": (GOOD[:-1], "frame_count", "tensors"),
    "size mismatch": (GOOD[:1] + [GOOD[1][:-4]] + GOOD[2:], "size_mismatch", "tensors.tokens"),
    "bad dtype": (bad_desc(GOOD, "tokens", dtype=">i4"), "bad_dtype", "tensors.tokens.dtype"),
    "object dtype": (bad_desc(GOOD, "tokens", dtype="|O"), "bad_dtype", "tensors.tokens.dtype"),
    "negative shape": (bad_desc(GOOD, "tokens", shape=[-6]), "bad_shape", "tensors.tokens.shape"),
    "header frame index": (bad_desc(GOOD, "tokens", frame=0), "bad_frame", "tensors.tokens.frame"),
    "frame out of range": (bad_desc(GOOD, "tokens", frame=99), "bad_frame", "tensors.tokens.frame"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_envelope_is_rejected_with_the_field(case):
    frames, code, field = MALFORMED[case]
    with pytest.raises(ProtocolError) as info:
        roundtrip(frames)
    assert (info.value.code, info.value.field) == (code, field)
    assert field in str(info.value)


def test_size_limit():
    with pytest.raises(ProtocolError) as info:
        decode(GOOD, max_bytes=10)
    assert info.value.code == "too_large"


SEGMENT_ERRORS = {
    "nan logprob": (
        dict(behavior_logprobs=np.array([0, 0, np.nan, -1, 0, -0.25], "<f4")),
        "non_finite",
        "behavior_logprobs",
    ),
    "inf reward": (dict(rewards=np.array([0, 0, 0, np.inf, 0, 1], "<f4")), "non_finite", "rewards"),
    "positive logprob": (
        dict(behavior_logprobs=np.array([0, 0, 0.5, -1, 0, -0.25], "<f4")),
        "bad_value",
        "behavior_logprobs",
    ),
    "reward on observation": (
        dict(rewards=np.array([0, 0, 0, 0, 1, 1], "<f4")),
        "bad_value",
        "rewards",
    ),
    "logprob on observation": (
        dict(behavior_logprobs=np.array([0, -1, -0.5, -1, 0, -0.25], "<f4")),
        "bad_value",
        "behavior_logprobs",
    ),
    "version on observation": (
        dict(versions=np.array([0, -1, 3, 3, -1, 4], "<i4")),
        "bad_value",
        "versions",
    ),
    "future version": (
        dict(versions=np.array([-1, -1, 3, 11, -1, 4], "<i4")),
        "future_version",
        "versions",
    ),
    "length mismatch": (dict(rewards=np.zeros(5, "<f4")), "length_mismatch", "rewards"),
    "mask not binary": (
        dict(action_mask=np.array([0, 0, 2, 1, 0, 1], "|u1")),
        "bad_value",
        "action_mask",
    ),
    "no actions": (
        dict(
            action_mask=np.zeros(6, "|u1"),
            versions=np.full(6, -1, "<i4"),
            behavior_logprobs=np.zeros(6, "<f4"),
            rewards=np.zeros(6, "<f4"),
        ),
        "no_actions",
        "action_mask",
    ),
    "first token action": (
        dict(action_mask=np.array([1, 0, 1, 1, 0, 1], "|u1")),
        "bad_value",
        "action_mask",
    ),
    "negative token": (dict(tokens=np.array([5, -6, 7, 8, 9, 10], "<i4")), "bad_value", "tokens"),
    "terminated and truncated": (dict(truncated=True), "bad_value", "terminated"),
    "wrong array dtype": (dict(tokens=np.array([5, 6, 7, 8, 9, 10], "<i8")), "bad_dtype", "tokens"),
    "empty id": (dict(traj_id=""), "bad_value", "traj_id"),
    "nan metric": (dict(metrics={"x": float("nan")}), "non_finite", "metrics.x"),
    "nested metric": (dict(metrics={"x": [1, 2]}), "bad_value", "metrics.x"),
}


@pytest.mark.parametrize("case", sorted(SEGMENT_ERRORS))
def test_inconsistent_segment_is_rejected_with_the_field(case):
    overrides, code, field = SEGMENT_ERRORS[case]
    with pytest.raises(ProtocolError) as info:
        roundtrip(wire(make_segment(**overrides)))
    assert (info.value.code, info.value.field) == (code, field)


def test_decoded_arrays_are_read_only_views():
    """Decoding never copies into writable memory the sender could alias; no pickle anywhere."""
    seg = roundtrip(wire(make_segment()))
    assert not seg.tokens.flags.writeable
