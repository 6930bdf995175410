"""Wire format: a msgpack header frame plus raw tensor frames (docs/protocol.md is the full spec).

Frame 0 is a msgpack map ``{"proto": 1, "kind": KIND, "req": int, ...}``; every tensor travels
as its own raw frame, described in ``header["tensors"][name] = {"dtype", "shape", "frame"}``.
Nothing is ever unpickled: decoding checks the header against the schema of its kind, and each
frame's size against its declared dtype and shape, before any array is built over the bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

PROTO = 1

# Frame dtypes are numpy dtype strings, little-endian only, so every client can read them.
FRAME_DTYPES = {"<i4", "<i8", "|u1", "<f4", "<f2", "<u2", "|b1"}
MAX_TENSORS = 1 << 16  # a BATCH carries 5 per segment
MAX_NDIM = 4


class ProtocolError(ValueError):
    """A message is malformed. ``field`` names the offending field, ``code`` the reason (a metric label)."""

    def __init__(self, code: str, field: str, message: str, *, retryable: bool = False):
        super().__init__(f"{code}: field '{field}': {message}")
        self.code = code
        self.field = field
        self.detail = message
        self.retryable = retryable
        self.req = 0  # the request number, when the header was readable: the ERROR reply echoes it


@dataclass
class Message:
    kind: str
    header: dict[str, Any]
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    frames: dict[str, Any] = field(default_factory=dict, repr=False)
    """The received frame object behind each tensor (see ``Forward``)."""

    @property
    def req(self) -> int:
        return self.header.get("req", 0)


# Header schema per kind: field -> (accepted python types, required). Extra fields are allowed
# (forward compatibility) but every listed field is type-checked.
_INT, _STR, _BOOL, _NUM = (int,), (str,), (bool,), (int, float)
_OPT_STR = (str, type(None))
SCHEMAS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    # client -> broker
    "HELLO": {"role": (_STR, True), "id": (_STR, True), "version": (_INT, True)},
    "PERMITS_REQ": {"n": (_INT, True), "version": (_INT, True)},
    "TRAJ": {
        "permit": (_STR, True),
        "traj_id": (_STR, True),
        "episode_id": (_STR, True),
        "segment": (_INT, True),
        "actor_id": (_STR, True),
        "task": (_STR, True),
        "group_id": (_OPT_STR, True),
        "last": (_BOOL, True),
        "terminated": (_BOOL, True),
        "truncated": (_BOOL, True),
        "metrics": ((dict,), True),
    },
    "HEARTBEAT": {"version": (_INT, True)},
    "BYE": {},
    "WEIGHTS_INFO": {},
    "WEIGHTS_GET": {"version": (_INT, True), "chunk": (_INT, True)},
    "GET_BATCH": {"version": (_INT, True), "n": (_INT, True), "publishes_after": (_BOOL, True)},
    "PUBLISH_BEGIN": {"manifest": ((dict,), True)},
    "PUBLISH_CHUNK": {"version": (_INT, True), "chunk": (_INT, True)},
    "PUBLISH_COMMIT": {"version": (_INT, True)},
    "STATS": {},
    # broker -> client
    "WELCOME": {
        "latest_version": (_INT, True),
        "max_staleness": (_INT, True),
        "heartbeat_s": (_NUM, True),
    },
    "PERMITS": {"permits": ((list,), True), "latest_version": (_INT, True)},
    "WAIT": {"reason": (_STR, True), "retry_after_s": (_NUM, True), "latest_version": (_INT, True)},
    "ACK": {},
    "ERROR": {
        "code": (_STR, True),
        "field": (_STR, True),
        "message": (_STR, True),
        "retryable": (_BOOL, True),
    },
    "HEARTBEAT_ACK": {"latest_version": (_INT, True)},
    "WEIGHTS_MANIFEST": {"manifest": ((dict,), True)},
    "WEIGHTS_CHUNK": {"version": (_INT, True), "chunk": (_INT, True)},
    "BATCH": {"batch_id": (_INT, True), "segments": ((list,), True)},
    "OK": {},
    "STATS_REPLY": {"stats": ((dict,), True)},
}


@dataclass(frozen=True)
class Forward:
    """A received tensor sent on unchanged: ``frame`` is the transport's frame object behind
    ``array``, and goes out as is. libzmq then shares the buffer instead of copying it, which is
    what lets the broker hand a learner megabytes of trajectories at the cost of a few pointers."""

    array: np.ndarray
    frame: Any


def encode(
    kind: str,
    header: dict[str, Any] | None = None,
    tensors: dict[str, np.ndarray | Forward] | None = None,
) -> list:
    """Header + tensors -> frames. Arrays are sent as their own buffers (zero-copy with ``copy=False``)."""
    head = {"proto": PROTO, "kind": kind, **(header or {})}
    frames: list = [None]
    if tensors:
        descs = {}
        for name, value in tensors.items():
            if isinstance(value, Forward):
                arr, frame = value.array, value.frame
            else:
                arr = np.ascontiguousarray(value)
                frame = memoryview(arr).cast("B") if arr.size else b""
            descs[name] = {"dtype": arr.dtype.str, "shape": list(arr.shape), "frame": len(frames)}
            frames.append(frame)
        head["tensors"] = descs
    frames[0] = msgpack.packb(head, use_bin_type=True)
    return frames


def _frame_bytes(frame: Any) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def decode(frames: list, *, max_bytes: int | None = None) -> Message:
    """Frames -> Message, validated; raises ProtocolError naming the bad field."""
    if not frames:
        raise ProtocolError("empty", "frames", "message has no frames")
    views = [_frame_bytes(f) for f in frames]
    total = sum(v.nbytes for v in views)
    if max_bytes is not None and total > max_bytes:
        raise ProtocolError(
            "too_large", "frames", f"{total} bytes exceeds the limit of {max_bytes}"
        )
    try:
        head = msgpack.unpackb(
            views[0], raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0
        )
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError("bad_header", "frame0", f"not a msgpack map: {exc}") from None
    if not isinstance(head, dict):
        raise ProtocolError("bad_header", "frame0", f"expected a map, got {type(head).__name__}")
    try:
        return _validate(head, views, frames)
    except ProtocolError as exc:
        req = head.get("req")
        exc.req = req if isinstance(req, int) and not isinstance(req, bool) else 0
        raise


def _validate(head: dict, views: list[memoryview], frames: list) -> Message:
    if head.get("proto") != PROTO:
        raise ProtocolError("bad_proto", "proto", f"expected {PROTO}, got {head.get('proto')!r}")
    kind = head.get("kind")
    if kind not in SCHEMAS:
        raise ProtocolError("unknown_kind", "kind", f"unknown message kind {kind!r}")
    if not isinstance(head.get("req", 0), int) or isinstance(head.get("req", 0), bool):
        raise ProtocolError("bad_type", "req", "must be an int")
    for name, (types_, required) in SCHEMAS[kind].items():
        if name not in head:
            if required:
                raise ProtocolError("missing_field", name, f"required in {kind}")
            continue
        value = head[name]
        if not isinstance(value, types_) or (isinstance(value, bool) and bool not in types_):
            raise ProtocolError(
                "bad_type",
                name,
                f"expected {'/'.join(t.__name__ for t in types_)}, got {type(value).__name__}",
            )
    tensors, index = _decode_tensors(head.get("tensors", {}), views)
    return Message(kind, head, tensors, {name: frames[i] for name, i in index.items()})


def _decode_tensors(
    descs: Any, views: list[memoryview]
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """The arrays, and the frame index each one came from."""
    if not isinstance(descs, dict) or len(descs) > MAX_TENSORS:
        raise ProtocolError(
            "bad_tensors", "tensors", f"expected a map of at most {MAX_TENSORS} descriptors"
        )
    if len(descs) != len(views) - 1:
        raise ProtocolError(
            "frame_count",
            "tensors",
            f"{len(descs)} tensors described, {len(views) - 1} frames sent",
        )
    out: dict[str, np.ndarray] = {}
    used: dict[str, int] = {}
    for name, desc in descs.items():
        where = f"tensors.{name}"
        if not isinstance(name, str) or not isinstance(desc, dict):
            raise ProtocolError(
                "bad_tensors", where, "descriptor must be a map under a string name"
            )
        dtype, shape, idx = desc.get("dtype"), desc.get("shape"), desc.get("frame")
        if dtype not in FRAME_DTYPES:
            raise ProtocolError(
                "bad_dtype", f"{where}.dtype", f"{dtype!r} not one of {sorted(FRAME_DTYPES)}"
            )
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise ProtocolError(
                "bad_shape",
                f"{where}.shape",
                f"expected up to {MAX_NDIM} non-negative ints, got {shape!r}",
            )
        if (
            not isinstance(idx, int)
            or isinstance(idx, bool)
            or not 1 <= idx < len(views)
            or idx in used.values()
        ):
            raise ProtocolError(
                "bad_frame", f"{where}.frame", f"frame index {idx!r} invalid or reused"
            )
        used[name] = idx
        np_dtype = np.dtype(dtype)
        expected = math.prod(shape) * np_dtype.itemsize
        if views[idx].nbytes != expected:
            raise ProtocolError(
                "size_mismatch",
                where,
                f"frame has {views[idx].nbytes} bytes, dtype {dtype} "
                f"shape {shape} needs {expected}",
            )
        out[name] = np.frombuffer(views[idx], dtype=np_dtype).reshape(shape)
    return out, used


def error_frames(exc: ProtocolError, req: int = 0) -> list:
    """The ERROR reply to a rejected message."""
    return encode(
        "ERROR",
        {
            "req": req,
            "code": exc.code,
            "field": exc.field,
            "message": exc.detail,
            "retryable": exc.retryable,
        },
    )
