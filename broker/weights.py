"""Weight store: versions arrive in chunks and become visible only when complete and verified.

The manifest (see ``common.weights``) names every chunk's size and sha256; a chunk that does not
match is refused, a version is published only by COMMIT after every chunk is in, and versions
never go backwards. The newest version and the one before it are kept (actors mid-download of
the previous one can finish); older ones are freed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from common.protocol import ProtocolError
from common.weights import validate_manifest


@dataclass
class WeightVersion:
    version: int
    manifest: dict
    chunks: list[bytes | None] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return all(c is not None for c in self.chunks)


class WeightStore:
    def __init__(self) -> None:
        self.versions: dict[int, WeightVersion] = {}  # committed, newest last
        self.pending: WeightVersion | None = None

    @property
    def latest(self) -> WeightVersion | None:
        return self.versions[max(self.versions)] if self.versions else None

    @property
    def latest_version(self) -> int:
        return max(self.versions) if self.versions else -1

    def begin(self, manifest: dict) -> None:
        validate_manifest(manifest)
        version = manifest["version"]
        if version <= self.latest_version:
            raise ProtocolError(
                "version_backwards",
                "manifest.version",
                f"version {version} is not newer than the latest {self.latest_version}",
            )
        self.pending = WeightVersion(version, manifest, [None] * len(manifest["chunks"]))

    def put(self, version: int, index: int, data: bytes) -> None:
        pending = self._pending(version)
        if not 0 <= index < len(pending.chunks):
            raise ProtocolError(
                "bad_value", "chunk", f"chunk {index} out of range 0..{len(pending.chunks) - 1}"
            )
        spec = pending.manifest["chunks"][index]
        if len(data) != spec["nbytes"]:
            raise ProtocolError(
                "size_mismatch",
                "data",
                f"chunk {index} has {len(data)} bytes, manifest says {spec['nbytes']}",
            )
        if hashlib.sha256(data).hexdigest() != spec["sha256"]:
            raise ProtocolError(
                "checksum", "data", f"chunk {index} sha256 does not match the manifest"
            )
        pending.chunks[index] = data

    def commit(self, version: int) -> WeightVersion:
        pending = self._pending(version)
        if not pending.complete:
            missing = [i for i, c in enumerate(pending.chunks) if c is None]
            raise ProtocolError(
                "incomplete", "chunk", f"version {version} is missing chunks {missing[:10]}"
            )
        self.install(pending)
        self.pending = None
        return pending

    def install(self, wv: WeightVersion) -> None:
        """Make a complete version the latest and free all but the previous one."""
        self.versions[wv.version] = wv
        for old in sorted(self.versions)[:-2]:
            del self.versions[old]

    def chunk(self, version: int, index: int) -> bytes:
        wv = self.versions.get(version)
        if wv is None:
            raise ProtocolError(
                "version_gone",
                "version",
                f"version {version} is not available (latest {self.latest_version})",
                retryable=True,
            )
        if not 0 <= index < len(wv.chunks):
            raise ProtocolError(
                "bad_value", "chunk", f"chunk {index} out of range 0..{len(wv.chunks) - 1}"
            )
        return wv.chunks[index]  # type: ignore[return-value]

    def _pending(self, version: int) -> WeightVersion:
        if self.pending is None or self.pending.version != version:
            raise ProtocolError(
                "no_publish",
                "version",
                f"no publish of version {version} is in progress "
                "(the broker restarted?): start again with PUBLISH_BEGIN",
                retryable=True,
            )
        return self.pending
