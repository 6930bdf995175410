"""Weight sets on the wire: a state dict as one byte stream cut into checksummed chunks.

Manifest::

    {"version": int, "chunk_bytes": int, "total_bytes": int,
     "chunks":  [{"nbytes": int, "sha256": hex}, ...],
     "tensors": [{"name": str, "dtype": str, "shape": [int], "offset": int, "nbytes": int, "sha256": hex}, ...]}

Tensors are laid end to end in manifest order (a tensor may span chunks); dtypes are torch names
(``float32``, ``bfloat16``, ...). Bucketing into large chunks is what makes the fan-out fast
(PITFALLS: per-tensor sends are ~10x slower). The broker needs only ``validate_manifest``, so this
module imports torch lazily.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

from common.protocol import ProtocolError

if TYPE_CHECKING:
    import torch

DTYPE_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "uint8": 1,
    "bool": 1,
}
MAX_WEIGHT_TENSORS = 100_000


def validate_manifest(manifest: dict) -> None:
    """Check a manifest from the network: types, sizes and offsets agree; raises ProtocolError."""

    def need(cond: bool, where: str, msg: str) -> None:
        if not cond:
            raise ProtocolError("bad_manifest", f"manifest.{where}", msg)

    for key in ("version", "chunk_bytes", "total_bytes"):
        value = manifest.get(key)
        need(
            isinstance(value, int) and not isinstance(value, bool) and value >= 0,
            key,
            "must be an int >= 0",
        )
    need(manifest["chunk_bytes"] > 0, "chunk_bytes", "must be > 0")
    chunks, tensors = manifest.get("chunks"), manifest.get("tensors")
    need(
        isinstance(chunks, list)
        and isinstance(tensors, list)
        and len(tensors) <= MAX_WEIGHT_TENSORS,
        "chunks",
        "chunks and tensors must be lists",
    )
    total, chunk_bytes = manifest["total_bytes"], manifest["chunk_bytes"]
    need(
        len(chunks) == max(1, math.ceil(total / chunk_bytes)),
        "chunks",
        "chunk count does not match total_bytes",
    )
    for i, c in enumerate(chunks):
        need(
            isinstance(c, dict)
            and isinstance(c.get("nbytes"), int)
            and isinstance(c.get("sha256"), str),
            f"chunks[{i}]",
            "needs nbytes (int) and sha256 (str)",
        )
        expected = min(chunk_bytes, total - i * chunk_bytes)
        need(c["nbytes"] == expected, f"chunks[{i}].nbytes", f"expected {expected}")
    offset = 0
    for i, t in enumerate(tensors):
        need(
            isinstance(t, dict) and isinstance(t.get("name"), str), f"tensors[{i}]", "needs a name"
        )
        need(t.get("dtype") in DTYPE_BYTES, f"tensors[{i}].dtype", f"one of {sorted(DTYPE_BYTES)}")
        shape = t.get("shape")
        need(
            isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape),
            f"tensors[{i}].shape",
            "list of ints >= 0",
        )
        need(t.get("offset") == offset, f"tensors[{i}].offset", f"expected {offset}")
        need(
            t.get("nbytes") == math.prod(shape) * DTYPE_BYTES[t["dtype"]],
            f"tensors[{i}].nbytes",
            "does not match dtype and shape",
        )
        offset += t["nbytes"]
    need(offset == total, "total_bytes", f"tensors add up to {offset} bytes")


def pack_state_dict(
    tensors: dict[str, torch.Tensor], version: int, chunk_bytes: int
) -> tuple[dict, list[memoryview]]:
    """State dict -> (manifest, chunks). One copy into a contiguous buffer; chunks are views of it."""
    import torch

    entries, offset = [], 0
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be exported")
        nbytes = t.numel() * t.element_size()
        entries.append(
            {
                "name": name,
                "dtype": dtype,
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": nbytes,
            }
        )
        offset += nbytes
    buf = torch.empty(offset, dtype=torch.uint8)
    for entry, t in zip(entries, tensors.values(), strict=True):
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        buf[entry["offset"] : entry["offset"] + entry["nbytes"]].copy_(flat)
        entry["sha256"] = hashlib.sha256(
            memoryview(buf[entry["offset"] : entry["offset"] + entry["nbytes"]].numpy())
        ).hexdigest()
    view = memoryview(buf.numpy())
    chunks = [view[i : i + chunk_bytes] for i in range(0, offset, chunk_bytes)] or [view[0:0]]
    manifest = {
        "version": version,
        "chunk_bytes": chunk_bytes,
        "total_bytes": offset,
        "chunks": [{"nbytes": c.nbytes, "sha256": hashlib.sha256(c).hexdigest()} for c in chunks],
        "tensors": entries,
    }
    return manifest, chunks


def unpack_state_dict(
    manifest: dict, chunks: list[bytes], *, verify: bool = True
) -> dict[str, torch.Tensor]:
    """(manifest, chunks) -> state dict of tensors over one buffer; checks every tensor's sha256."""
    import torch

    buf = bytearray(b"".join(chunks))
    if len(buf) != manifest["total_bytes"]:
        raise ProtocolError(
            "size_mismatch",
            "chunks",
            f"{len(buf)} bytes received, manifest says {manifest['total_bytes']}",
        )
    flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    out = {}
    for t in manifest["tensors"]:
        raw = flat[t["offset"] : t["offset"] + t["nbytes"]]
        if verify and hashlib.sha256(memoryview(raw.numpy())).hexdigest() != t["sha256"]:
            raise ProtocolError(
                "checksum", f"tensors.{t['name']}", "sha256 does not match the manifest"
            )
        out[t["name"]] = raw.view(getattr(torch, t["dtype"])).reshape(t["shape"])
    return out
