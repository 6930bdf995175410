"""One weight version's chunks, as they arrive: each checked before it is kept, served at once.

A version travels as the chunks of its manifest (``common.weights``): a fetcher keeps a chunk only
if its length and sha256 match the manifest, and its own peer server hands it on from that moment
(``common.peers``), so a chain of actors pipelines a version chunk by chunk. Nothing is loaded
before every chunk is in and every tensor's sha256 checks too (``tensors``): no version is ever
used half-written or mixed with another.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from common.protocol import ProtocolError
from common.weights import unpack_state_dict

if TYPE_CHECKING:
    import torch


class Pieces:
    """The chunks of version ``manifest["version"]``; ``chunks`` given: all of them (a learner's
    own, already packed), else none yet. Thread-safe: one thread puts, others get and wait."""

    def __init__(self, manifest: dict, chunks: list[Any] | None = None) -> None:
        self.manifest = manifest
        self.version: int = manifest["version"]
        self.specs: list[dict] = manifest["chunks"]
        self._chunks: list[Any] = list(chunks) if chunks is not None else [None] * len(self.specs)
        self._held = sum(c is not None for c in self._chunks)
        self._changed = threading.Condition()
        self._listeners: list[Callable[[], None]] = []  # told of every chunk kept
        now = time.monotonic() if self.complete else 0.0
        self.first_at, self.last_at, self.done_at = now, now, now  # first, latest, last chunk in

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def held(self) -> int:
        return self._held

    @property
    def complete(self) -> bool:
        return self._held == len(self.specs)

    @property
    def nbytes(self) -> int:
        return int(self.manifest["total_bytes"])

    @property
    def chunks(self) -> list:
        """Every chunk (only once complete)."""
        if not self.complete:
            raise ValueError(f"version {self.version}: {len(self.missing())} chunks missing")
        return list(self._chunks)

    def rate(self) -> float | None:
        """Chunks a second this version came in at, from its first chunk to its latest; None
        while that is not known (under two chunks, or all of them given at once)."""
        with self._changed:
            span = self.last_at - self.first_at
            return (self._held - 1) / span if self._held >= 2 and span > 0 else None

    def missing(self) -> list[int]:
        with self._changed:
            return [i for i, c in enumerate(self._chunks) if c is None]

    def check(self, index: int, data: Any) -> None:
        """Raise ``ProtocolError`` unless ``data`` is chunk ``index`` as the manifest says."""
        if not 0 <= index < len(self.specs):
            raise ProtocolError(
                "bad_value", "chunk", f"chunk {index} out of range 0..{len(self.specs) - 1}"
            )
        spec, view = self.specs[index], memoryview(data)
        if view.nbytes != spec["nbytes"]:
            raise ProtocolError(
                "size_mismatch",
                "data",
                f"chunk {index} of version {self.version} has {view.nbytes} bytes, the manifest "
                f"says {spec['nbytes']}",
            )
        if hashlib.sha256(view).hexdigest() != spec["sha256"]:
            raise ProtocolError(
                "checksum", "data", f"chunk {index} of version {self.version}: sha256 differs"
            )

    def put(self, index: int, data: Any) -> None:
        """Keep chunk ``index`` once it checks (``check``); a chunk already held is kept."""
        self.check(index, data)
        with self._changed:
            if self._chunks[index] is None:
                self._chunks[index] = data
                self._held += 1
                now = time.monotonic()
                self.first_at, self.last_at = self.first_at or now, now
                if self.complete:
                    self.done_at = now
                self._changed.notify_all()
                listeners = list(self._listeners)
        for tell in listeners:
            tell()

    def listen(self, tell: Callable[[], None]) -> None:
        """Call ``tell()`` (from the putting thread) whenever a chunk is kept."""
        with self._changed:
            self._listeners.append(tell)

    def get(self, index: int) -> Any | None:
        """Chunk ``index`` if it is held, else None (never waits)."""
        with self._changed:
            return self._chunks[index]

    def wait(self, timeout_s: float) -> None:
        """Until a chunk arrives or ``timeout_s`` passes."""
        with self._changed:
            self._changed.wait(timeout_s)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The version's tensors, every tensor's sha256 checked (only once complete)."""
        return unpack_state_dict(self.manifest, self.chunks)
