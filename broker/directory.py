"""The weights' control plane: which versions exist, and whom each fetcher fetches from.

The broker never holds a version's bytes (docs/protocol.md §6.3). It holds the newest manifests
(the newest and the one before it, as actors mid-download need) and, per version, its **chain**:
the learner that published it first, then every fetcher that serves, in the order it asked. A new
fetcher is handed the chain's last live member (``fanout: chain``): each member receives the
version from one peer and hands it to one peer, chunk by chunk, so every link carries it once and
N fetchers take about as long as one. ``fanout: star`` hands everyone the learner (the star a
broker fan-out is: N copies through one link), for comparison and for networks where actors
cannot reach each other.

A member that a fetcher reports (stalled, refused, or a chunk that did not check) is avoided for
that version by everyone; a fetcher whose source failed gets the nearest live member before it in
the chain. No I/O here: the broker asks, the directory answers or raises the ``ProtocolError``
the broker sends back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.protocol import ProtocolError
from common.weights import validate_manifest

KEEP = 2  # versions kept: the newest, and the one before it for fetches in progress
FANOUTS = ("chain", "star")


@dataclass(frozen=True)
class Peer:
    """A chunk server: its client id, address (``tcp://ip:port``) and Curve key (Z85)."""

    id: str
    address: str
    key: str | None = None

    def wire(self) -> dict:
        return {"id": self.id, "address": self.address, "key": self.key}


@dataclass
class Entry:
    manifest: dict
    chain: list[Peer]  # the root (the learner) first, then fetchers that serve, in order
    failed: set[str] = field(default_factory=set)  # ids reported for this version


class Directory:
    def __init__(self, fanout: str = "chain") -> None:
        if fanout not in FANOUTS:
            raise ValueError(f"broker.weights_fanout must be one of {FANOUTS}, got {fanout!r}")
        self.fanout = fanout
        self.versions: dict[int, Entry] = {}

    @property
    def latest_version(self) -> int:
        return max(self.versions) if self.versions else -1

    @property
    def latest(self) -> dict | None:
        """The newest manifest, None while there is none."""
        return self.versions[self.latest_version].manifest if self.versions else None

    def publish(self, manifest: dict, root: Peer) -> None:
        """A new version, served by ``root`` (the learner): visible at once, the oldest beyond
        ``KEEP`` forgotten. Versions never go backwards; the learner's own republish of its
        current version after a broker restart is the same version again."""
        validate_manifest(manifest)
        version = manifest["version"]
        if version < self.latest_version or (
            version == self.latest_version and self.versions[version].manifest != manifest
        ):
            raise ProtocolError(
                "version_backwards",
                "manifest.version",
                f"version {version} is not newer than the latest {self.latest_version}",
            )
        self.versions[version] = Entry(manifest, [root])
        for old in sorted(self.versions)[:-KEEP]:
            del self.versions[old]

    def source(
        self,
        version: int,
        fetcher: str,
        *,
        serves: Peer | None,
        failed: list[str],
        alive: set[str],
        holders: set[str],
    ) -> Peer:
        """Whom ``fetcher`` fetches ``version`` from. ``serves``: the fetcher's own chunk server
        when it serves (it then joins the chain); ``failed``: the sources it gave up on;
        ``alive``: the registered actors; ``holders``: those whose engine holds the version."""
        entry = self.versions.get(version)
        if entry is None:
            raise ProtocolError(
                "version_gone", "version",
                f"version {version} is not kept (latest {self.latest_version}): start again "
                "from WEIGHTS_INFO", retryable=True,
            )  # fmt: skip
        entry.failed.update(failed)
        root = entry.chain[0]

        def usable(p: Peer) -> bool:  # the root counts until it left or was reported
            return p.id != fetcher and p.id not in entry.failed and (p is root or p.id in alive)

        members = [p.id for p in entry.chain]
        before = entry.chain[: members.index(fetcher)] if fetcher in members else entry.chain
        if self.fanout == "star":
            before = [root]
        found = next((p for p in reversed(before) if usable(p)), None)
        if found is None:  # the chain before it broke: anyone who holds the whole version
            found = next((p for p in entry.chain if usable(p) and p.id in holders), None)
        if found is None:
            raise ProtocolError(
                "no_source", "version",
                f"no live peer serves version {version} now (failed: {sorted(entry.failed)}): "
                "ask again", retryable=True,
            )  # fmt: skip
        if serves is not None and fetcher not in members:
            entry.chain.append(serves)
        return found

    def forget(self, peer_id: str) -> None:
        """A peer that left: out of every chain; a learner that left (BYE) is named no more."""
        for entry in self.versions.values():
            if entry.chain[0].id == peer_id:
                entry.failed.add(peer_id)
            entry.chain[1:] = [p for p in entry.chain[1:] if p.id != peer_id]

    def state(self) -> dict | None:
        """What the spool keeps: the newest manifest and its root."""
        if not self.versions:
            return None
        entry = self.versions[self.latest_version]
        return {"manifest": entry.manifest, "root": entry.chain[0].wire()}

    def restore(self, state: dict | None) -> None:
        if state:
            self.versions[state["manifest"]["version"]] = Entry(
                state["manifest"], [Peer(**state["root"])]
            )
