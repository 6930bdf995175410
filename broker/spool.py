"""Durable broker state under ``broker.spool_dir``: accepted segments, permit state, newest weights.

Every write goes to a temporary file that is renamed into place, so a kill -9 at any moment
leaves either the old file or the new one, never half of one. A segment is spooled before its
ACK is sent and removed when it is handed to the learner.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgpack


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
        self.weights = self.root / "weights"
        self.segments.mkdir(parents=True, exist_ok=True)
        self.weights.mkdir(parents=True, exist_ok=True)

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

    def save_weights(self, version: int, manifest: dict, chunks: list[bytes]) -> None:
        """Chunks first, the manifest last: a version without a manifest is ignored on load."""
        for i, chunk in enumerate(chunks):
            _atomic_write(self.weights / f"v{version}.chunk{i}", chunk)
        _atomic_write(
            self.weights / f"v{version}.manifest", msgpack.packb(manifest, use_bin_type=True)
        )
        for old in self.weights.iterdir():
            if not old.name.startswith(f"v{version}."):
                old.unlink(missing_ok=True)

    def load_weights(self) -> tuple[dict, list[bytes]] | None:
        manifests = sorted(
            self.weights.glob("v*.manifest"), key=lambda p: int(p.name[1:].split(".")[0])
        )
        if not manifests:
            return None
        manifest = msgpack.unpackb(manifests[-1].read_bytes(), raw=False)
        version = manifest["version"]
        chunks = [
            (self.weights / f"v{version}.chunk{i}").read_bytes()
            for i in range(len(manifest["chunks"]))
        ]
        return manifest, chunks
