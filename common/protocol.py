"""Wire format: a msgpack header frame plus raw tensor frames (docs/protocol.md is the full spec).

Frame 0 is a msgpack map ``{"proto": 1, "kind": KIND, "req": int, ...}``; every tensor travels
as its own raw frame, described in ``header["tensors"][name] = {"dtype", "shape", "frame"}``.
Nothing is ever unpickled: decoding checks the header against the schema of its kind, and each
frame's size against its declared dtype and shape, before any array is built over the bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

PROTO = 2  # docs/protocol.md, Changelog: what each version changed

# Frame dtypes are numpy dtype strings, little-endian only, so every client can read them.
FRAME_DTYPES = {"<i4", "<i8", "|u1", "<f4", "<f2", "<u2", "|b1"}
MAX_TENSORS = 1 << 16  # a BATCH carries 5 per segment
MAX_NDIM = 4
MAX_DIM = (1 << 31) - 1  # one dimension of a tensor shape
# The product of a shape's non-zero dimensions: a 0 beside a 2**63 passes a byte count of 0 but
# not numpy, so every shape is bounded before an array is built over the bytes.
MAX_ELEMENTS = 1 << 40
MAX_CLIENT_ID_LEN = 128
CLIENT_ID = re.compile(r"[A-Za-z0-9._:@+/=-]+")  # no spaces, quotes or control characters


def is_int(value: Any) -> bool:
    """A msgpack integer: Python's bool is an int and ``True == 1``, so it is excluded by name."""
    return isinstance(value, int) and not isinstance(value, bool)


def show(value: Any, limit: int = 60) -> str:
    """A client's value for an error message: its repr, cut short (no reply echoes a megabyte)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ProtocolError(ValueError):
    """A message is malformed. ``field`` names the offending field, ``code`` the reason (a metric label)."""

    def __init__(self, code: str, field: str, message: str, *, retryable: bool = False):
        super().__init__(f"{code}: field '{field}': {message}")
        self.code = code
        self.field = field
        self.detail = message
        self.retryable = retryable
        self.req = 0  # the request number, when the header was readable: the ERROR reply echoes it
        # The version the ERROR reply is encoded in: a client of an earlier version gets its
        # bad_proto answer in a message it can still decode.
        self.proto = PROTO


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
    "HELLO": {
        "role": (_STR, True),
        "id": (_STR, True),
        "version": (_INT, True),
        "peer_port": (_INT, False),
    },
    "PERMITS_REQ": {"n": (_INT, True), "version": (_INT, True), "wait": (_BOOL, False)},
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
        "temperature": (_NUM, True),
        "top_p": (_NUM, True),
        "metrics": ((dict,), True),
    },
    "HEARTBEAT": {"version": (_INT, True)},
    "BYE": {},
    "WEIGHTS_INFO": {},
    "WEIGHTS_WHERE": {"version": (_INT, True), "failed": ((list,), False)},
    "GET_BATCH": {"version": (_INT, True), "n": (_INT, True), "publishes_after": (_BOOL, True)},
    "PUBLISH": {"manifest": ((dict,), True)},
    "STATS": {},
    # fetcher -> peer (a learner's or an actor's chunk server, common.peers)
    "WEIGHTS_GET": {"version": (_INT, True), "chunk": (_INT, True)},
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
    "WEIGHTS_SOURCE": {"version": (_INT, True), "source": ((dict,), True)},
    "WEIGHTS_CHUNK": {"version": (_INT, True), "chunk": (_INT, True), "rate": (_NUM, False)},
    "BATCH": {"batch_id": (_INT, True), "segments": ((list,), True)},
    "OK": {},
    "STATS_REPLY": {"stats": ((dict,), True)},
}


CLIENT_KINDS = frozenset(
    {
        "HELLO",
        "PERMITS_REQ",
        "TRAJ",
        "HEARTBEAT",
        "BYE",
        "WEIGHTS_INFO",
        "WEIGHTS_WHERE",
        "GET_BATCH",
        "PUBLISH",
        "STATS",
    }
)  # the kinds a broker serves
PEER_KINDS = frozenset({"WEIGHTS_GET"})  # the kind a peer's chunk server serves
# the others of SCHEMAS are replies


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
    *,
    proto: int = PROTO,
) -> list:
    """Header + tensors -> frames. Arrays are sent as their own buffers (zero-copy with ``copy=False``)."""
    head = {"proto": proto, "kind": kind, **(header or {})}
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


def _unpack_header(view: memoryview) -> dict:
    """Frame 0 -> the header map; ``bad_header`` says in plain words what is wrong with it."""
    try:
        head = msgpack.unpackb(view, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except msgpack.ExtraData:
        raise ProtocolError(
            "bad_header", "frame0", "trailing bytes after the header map: send one map only"
        ) from None
    except UnicodeDecodeError:
        raise ProtocolError("bad_header", "frame0", "a string is not valid UTF-8") from None
    except ValueError as exc:  # the limits above, and msgpack's malformed-data errors
        text = str(exc)
        reason = (
            "a bin (bytes) value in the header: bytes travel only as tensor frames"
            if "bin" in text
            else "an ext value in the header: msgpack extensions are not allowed"
            if "ext" in text
            else "a map key that is not a string"
            if "map_key" in text or "key" in text
            else "not one complete msgpack value (truncated or malformed)"
        )
        raise ProtocolError("bad_header", "frame0", reason) from None
    except Exception:  # msgpack's other errors: bad type bytes, nesting too deep
        raise ProtocolError(
            "bad_header", "frame0", "not one complete msgpack value (malformed or nested too deep)"
        ) from None
    if not isinstance(head, dict):
        raise ProtocolError(
            "bad_header", "frame0", f"expected a msgpack map, got a {_type_name(head)}"
        )
    return head


def _type_name(value: Any) -> str:
    """The msgpack name of a decoded value's type, as docs/protocol.md uses them."""
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def decode(
    frames: list, *, max_bytes: int | None = None, kinds: frozenset[str] | None = None
) -> Message:
    """Frames -> Message, validated; raises ProtocolError naming the bad field, nothing else.

    ``kinds`` restricts the accepted kinds (a broker serves ``CLIENT_KINDS``: a reply kind sent
    to it is ``unknown_kind`` before its schema is read).
    """
    if not frames:
        raise ProtocolError("empty", "frames", "message has no frames")
    views = [_frame_bytes(f) for f in frames]
    total = sum(v.nbytes for v in views)
    if max_bytes is not None and total > max_bytes:
        raise ProtocolError(
            "too_large", "frames", f"{total} bytes exceeds the limit of {max_bytes}"
        )
    head = _unpack_header(views[0])
    try:
        return _validate(head, views, frames, kinds)
    except ProtocolError as exc:
        req = head.get("req")
        exc.req = req if is_int(req) else 0
        raise


def _validate(
    head: dict, views: list[memoryview], frames: list, kinds: frozenset[str] | None
) -> Message:
    proto = head.get("proto")
    if not is_int(proto) or proto != PROTO:
        exc = ProtocolError(
            "bad_proto",
            "proto",
            f"this side speaks asyncppo protocol version {PROTO}, the message says "
            f"{show(proto)} (docs/protocol.md, Changelog: what changed between versions)",
        )
        if is_int(proto) and 1 <= proto < PROTO:
            exc.proto = proto
        raise exc
    kind = head.get("kind")
    if (
        not isinstance(kind, str)
        or kind not in SCHEMAS
        or (kinds is not None and kind not in kinds)
    ):
        what = "a request the broker serves" if kinds is not None else "a message kind"
        raise ProtocolError("unknown_kind", "kind", f"{show(kind)} is not {what}")
    if not is_int(head.get("req", 0)):
        raise ProtocolError("bad_type", "req", f"expected int, got {_type_name(head['req'])}")
    if kind in CLIENT_KINDS or kind in PEER_KINDS:
        check_client_id(head)
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
                f"expected {'/'.join(_TYPE_NAMES[t] for t in types_)}, got {_type_name(value)}",
            )
    tensors, index = _decode_tensors(head.get("tensors", {}), views)
    return Message(kind, head, tensors, {name: frames[i] for name, i in index.items()})


_TYPE_NAMES = {
    int: "int",
    float: "float",
    str: "str",
    bool: "bool",
    dict: "map",
    list: "array",
    type(None): "nil",
}


def check_client_id(head: dict) -> str:
    """The ``id`` every request carries: a short printable name (it keys the broker's state)."""
    if "id" not in head:
        raise ProtocolError("missing_field", "id", "every request carries the client id")
    value = head["id"]
    if not isinstance(value, str):
        raise ProtocolError("bad_type", "id", f"expected str, got {_type_name(value)}")
    if not 0 < len(value) <= MAX_CLIENT_ID_LEN or not CLIENT_ID.fullmatch(value):
        raise ProtocolError(
            "bad_value",
            "id",
            f"expected 1 to {MAX_CLIENT_ID_LEN} characters of A-Z a-z 0-9 . _ : @ + / = -, "
            f"got {show(value)}",
        )
    return value


def _check_shape(shape: Any, where: str) -> None:
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(is_int(d) and 0 <= d <= MAX_DIM for d in shape)
    ):
        raise ProtocolError(
            "bad_shape",
            f"{where}.shape",
            f"expected an array of at most {MAX_NDIM} ints in [0, {MAX_DIM}], got {show(shape)}",
        )
    if math.prod(d for d in shape if d) > MAX_ELEMENTS:
        raise ProtocolError(
            "bad_shape",
            f"{where}.shape",
            f"the product of the non-zero dimensions of {show(shape)} exceeds {MAX_ELEMENTS}",
        )


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
    taken: set[int] = set()
    for name, desc in descs.items():
        where = f"tensors.{name if len(name) <= 40 else name[:37] + '...'}"
        if not isinstance(name, str) or not isinstance(desc, dict):
            raise ProtocolError(
                "bad_tensors",
                where,
                f"a descriptor is a map under a string name, got a {_type_name(desc)} "
                f"under a {_type_name(name)}",
            )
        dtype, shape, idx = desc.get("dtype"), desc.get("shape"), desc.get("frame")
        if not isinstance(dtype, str) or dtype not in FRAME_DTYPES:
            raise ProtocolError(
                "bad_dtype",
                f"{where}.dtype",
                f"expected one of {sorted(FRAME_DTYPES)}, got {show(dtype)}",
            )
        _check_shape(shape, where)
        if not is_int(idx) or not 1 <= idx < len(views) or idx in taken:
            raise ProtocolError(
                "bad_frame",
                f"{where}.frame",
                f"expected an unused frame index in [1, {len(views) - 1}], got {show(idx)}",
            )
        taken.add(idx)
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
        if dtype == "|b1" and expected and np.frombuffer(views[idx], dtype=np.uint8).max() > 1:
            raise ProtocolError("bad_value", where, "a |b1 (bool) byte is 0 or 1")
        out[name] = np.frombuffer(views[idx], dtype=np_dtype).reshape(shape)
    return out, used


def error_frames(exc: ProtocolError, req: int = 0) -> list:
    """The ERROR reply to a rejected message, in the protocol version ``exc`` names (the ERROR's
    fields are the same in every version)."""
    return encode(
        "ERROR",
        {
            "req": req,
            "code": exc.code,
            "field": exc.field,
            "message": exc.detail,
            "retryable": exc.retryable,
        },
        proto=exc.proto,
    )
