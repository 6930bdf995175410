"""Weight sets on the wire: a state dict as one byte stream cut into checksummed chunks.

Manifest::

    {"version": int, "chunk_bytes": int, "total_bytes": int,
     "chunks":  [{"nbytes": int, "sha256": hex}, ...],
     "tensors": [{"name": str, "dtype": str, "shape": [int], "offset": int, "nbytes": int, "sha256": hex}, ...],
     "adapter": {"base": hex}}   # only for a LoRA adapter (common.lora): the base it applies to

Tensors are laid end to end in manifest order (a tensor may span chunks); dtypes are torch names
(``float32``, ``bfloat16``, ...). Bucketing into large chunks is what makes the fan-out fast
(PITFALLS: per-tensor sends are ~10x slower). The broker needs only ``validate_manifest``, so this
module imports torch lazily.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import TYPE_CHECKING

from common.protocol import MAX_DIM, ProtocolError, is_int, show

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
MAX_WEIGHT_NDIM = 8
SHA256 = re.compile(r"[0-9a-f]{64}")


def validate_manifest(manifest: dict) -> None:
    """Check a manifest from the network: types first, then sizes and offsets; raises ProtocolError.

    Every value is type-checked before it is used as a key, compared or multiplied, so that no
    input can raise anything but a ``bad_manifest`` naming the field.
    """

    def need(cond: bool, where: str, msg: str) -> None:
        if not cond:
            raise ProtocolError("bad_manifest", f"manifest.{where}", msg)

    def count(value: object) -> bool:  # an int >= 0 (never a bool)
        return is_int(value) and value >= 0  # type: ignore[operator]

    def digest(value: object) -> bool:
        return isinstance(value, str) and SHA256.fullmatch(value) is not None

    for key in ("version", "chunk_bytes", "total_bytes"):
        value = manifest.get(key)
        need(count(value), key, f"expected an int >= 0, got {show(value)}")
    need(manifest["version"] <= MAX_DIM, "version", f"expected at most {MAX_DIM}")
    need(manifest["chunk_bytes"] > 0, "chunk_bytes", "must be > 0")
    chunks, tensors = manifest.get("chunks"), manifest.get("tensors")
    need(isinstance(chunks, list), "chunks", "expected an array")
    need(
        isinstance(tensors, list) and len(tensors) <= MAX_WEIGHT_TENSORS,
        "tensors",
        f"expected an array of at most {MAX_WEIGHT_TENSORS} tensors",
    )
    total, chunk_bytes = manifest["total_bytes"], manifest["chunk_bytes"]
    expected_chunks = max(1, -(-total // chunk_bytes))  # integer ceil: no float rounding
    need(
        len(chunks) == expected_chunks,
        "chunks",
        f"total_bytes {total} in chunks of {chunk_bytes} makes {expected_chunks} chunks, "
        f"got {len(chunks)}",
    )
    for i, c in enumerate(chunks):
        need(isinstance(c, dict), f"chunks[{i}]", "expected a map {nbytes, sha256}")
        need(count(c.get("nbytes")), f"chunks[{i}].nbytes", "expected an int >= 0")
        need(digest(c.get("sha256")), f"chunks[{i}].sha256", "expected 64 lowercase hex digits")
        expected = min(chunk_bytes, total - i * chunk_bytes)
        need(c["nbytes"] == expected, f"chunks[{i}].nbytes", f"expected {expected}")
    offset = 0
    for i, t in enumerate(tensors):
        need(isinstance(t, dict), f"tensors[{i}]", "expected a map")
        need(isinstance(t.get("name"), str), f"tensors[{i}].name", "expected a str")
        dtype = t.get("dtype")
        need(
            isinstance(dtype, str) and dtype in DTYPE_BYTES,
            f"tensors[{i}].dtype",
            f"expected one of {sorted(DTYPE_BYTES)}, got {show(dtype)}",
        )
        shape = t.get("shape")
        need(
            isinstance(shape, list)
            and len(shape) <= MAX_WEIGHT_NDIM
            and all(is_int(d) and 0 <= d <= MAX_DIM for d in shape),
            f"tensors[{i}].shape",
            f"expected an array of at most {MAX_WEIGHT_NDIM} ints in [0, {MAX_DIM}]",
        )
        need(
            t.get("offset") == offset and count(t.get("offset")),
            f"tensors[{i}].offset",
            f"expected {offset}",
        )
        need(
            count(t.get("nbytes")) and t["nbytes"] == math.prod(shape) * DTYPE_BYTES[dtype],
            f"tensors[{i}].nbytes",
            "does not match dtype and shape",
        )
        need(digest(t.get("sha256")), f"tensors[{i}].sha256", "expected 64 lowercase hex digits")
        offset += t["nbytes"]
    need(offset == total, "total_bytes", f"tensors add up to {offset} bytes")
    if "adapter" in manifest:
        adapter = manifest["adapter"]
        need(isinstance(adapter, dict), "adapter", "expected a map {base}")
        need(
            digest(adapter.get("base")),
            "adapter.base",
            "expected the base model's fingerprint, 64 lowercase hex digits",
        )


def pack_state_dict(
    tensors: dict[str, torch.Tensor],
    version: int,
    chunk_bytes: int,
    *,
    adapter_base: str | None = None,
) -> tuple[dict, list[memoryview]]:
    """State dict -> (manifest, chunks). One copy into a contiguous buffer; chunks are views of it.
    ``adapter_base``: the tensors are a LoRA adapter (``common.lora``) for the base model with
    this fingerprint."""
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
    if adapter_base is not None:
        manifest["adapter"] = {"base": adapter_base}
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
