"""Durable broker state under ``broker.spool_dir``: accepted segments, and the state (permits,
counters, the newest version's manifest and source; never weight bytes, which the broker does
not hold).

``Spool`` is the files: every write goes to a temporary file that is renamed into place, so a
kill -9 at any moment leaves either the old file or the new one, never half of one.
``Durability`` is when they are written: a segment before its ACK, state before the reply that
announces it, and a disk that fails counted instead of fatal.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import msgpack
import structlog

log = structlog.get_logger()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _segment_order(path: Path) -> tuple[str, int, int]:
    permit, _, segment = path.stem.rpartition(".")
    epoch, _, number = permit.rpartition("-")
    return epoch, int(number), int(segment)


class Spool:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.segments = self.root / "segments"
        self.segments.mkdir(parents=True, exist_ok=True)

    def save_segment(self, key: str, frames: list[bytes]) -> None:
        _atomic_write(self.segments / f"{key}.msgpack", msgpack.packb(frames, use_bin_type=True))

    def delete_segment(self, key: str) -> None:
        (self.segments / f"{key}.msgpack").unlink(missing_ok=True)

    def load_segments(self) -> list[tuple[str, list[bytes]]]:
        """Spooled segments by permit in grant order, each episode's in segment order.

        Keys are ``<permit>.<segment>`` and permits ``<epoch>-<n>``. The order comes from the
        names, not from file times: with coarse timestamps an episode's segments share an mtime.
        """
        files = sorted(self.segments.glob("*.msgpack"), key=_segment_order)
        return [(p.stem, msgpack.unpackb(p.read_bytes(), raw=False)) for p in files]

    def save_state(self, state: dict) -> None:
        _atomic_write(self.root / "state.json", json.dumps(state).encode())

    def load_state(self) -> dict | None:
        path = self.root / "state.json"
        return json.loads(path.read_text()) if path.exists() else None


class Durability:
    """The broker's write-ahead discipline over a ``Spool``, or nothing without a spool dir.

    What a reply announces is on disk before the reply (``flush`` before every reply that follows
    a change: ``changed``). A failing disk never ends the broker: every failed write is counted
    (``on_error``) and logged once per outage; a segment that cannot be written is not
    acknowledged (``save_segment`` says False), state writes and deletions are retried at every
    flush (a deletion lost would bring a handed-out segment back, trained twice after a restart).
    """

    def __init__(self, spool_dir: str | None, on_error: Callable[[], None]) -> None:
        self.spool = Spool(spool_dir) if spool_dir else None
        self.on_error = on_error
        self.dirty = False
        self._failing: set[str] = set()  # writes failing now: logged once, not per retry
        self._deleted: set[str] = set()  # keys of handed-out or dropped segments, to delete

    def changed(self) -> None:
        self.dirty = True

    def save_segment(self, key: str, frames: list[bytes]) -> bool:
        """Spool an accepted segment before its ACK; False when the disk failed."""
        return self.spool is None or self._write("segment", self.spool.save_segment, key, frames)

    def forget(self, key: str) -> None:
        """A handed-out or dropped segment leaves the spool at the next flush."""
        if self.spool is not None:
            self._deleted.add(key)

    def flush(self, state: Callable[[], dict]) -> None:
        """Delete what left, and write ``state()`` if anything changed since the last flush."""
        if self.spool is None:
            return
        for key in list(self._deleted):
            if not self._write("delete", self.spool.delete_segment, key):
                break
            self._deleted.discard(key)
        if self.dirty:
            self.dirty = False
            self._write("state", self.spool.save_state, state())

    def _write(self, what: str, write: Callable[..., None], *args: object) -> bool:
        try:
            write(*args)
        except OSError as exc:
            self.on_error()
            self.dirty = True
            if what not in self._failing:
                log.error("spool write failed", what=what, error=str(exc))
                self._failing.add(what)
            return False
        if what in self._failing:
            log.info("spool writes work again", what=what)
            self._failing.discard(what)
        return True
