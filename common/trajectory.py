"""The trajectory segment: the unit actors send, the broker queues and the learner trains on.

One episode may be cut into several segments (compaction, dynamic truncation); ``last`` marks the
episode's final segment, so the broker can hand out whole episodes and the learner can bootstrap a
segment's end from the first value of the next one. ``Segment.from_wire`` is the single place where
an untrusted trajectory is checked, field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.protocol import ProtocolError

ARRAYS = {  # name -> dtype on the wire (DESIGN.md's trajectory table)
    "tokens": np.dtype("<i4"),
    "action_mask": np.dtype("|u1"),
    "behavior_logprobs": np.dtype("<f4"),
    "versions": np.dtype("<i4"),
    "rewards": np.dtype("<f4"),
}
META = (
    "traj_id",
    "episode_id",
    "segment",
    "actor_id",
    "task",
    "group_id",
    "permit",
    "last",
    "terminated",
    "truncated",
    "metrics",
)
MAX_ID_LEN = 256
MAX_METRICS = 64


@dataclass
class Segment:
    traj_id: str
    episode_id: str
    segment: int
    actor_id: str
    task: str
    group_id: str | None
    permit: str
    last: bool
    terminated: bool
    truncated: bool
    tokens: np.ndarray
    action_mask: np.ndarray
    behavior_logprobs: np.ndarray
    versions: np.ndarray
    rewards: np.ndarray
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum())

    @property
    def min_version(self) -> int:
        """Oldest policy version that sampled any of this segment's action tokens."""
        return int(self.versions[self.action_mask.astype(bool)].min())

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in ARRAYS)

    @property
    def reward(self) -> float:
        return float(self.rewards.sum())

    def header(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in META}

    def arrays(self, prefix: str = "") -> dict[str, np.ndarray]:
        return {prefix + name: getattr(self, name) for name in ARRAYS}

    @classmethod
    def from_wire(
        cls,
        header: dict[str, Any],
        tensors: dict[str, np.ndarray],
        *,
        prefix: str = "",
        latest_version: int | None = None,
    ) -> Segment:
        """Build a segment from an untrusted header and arrays; ProtocolError names the first bad field."""
        _check_ids(header)
        arrays = {}
        for name, dtype in ARRAYS.items():
            arr = tensors.get(prefix + name)
            if arr is None:
                raise ProtocolError("missing_field", name, "tensor is required")
            if arr.dtype != dtype or arr.ndim != 1:
                raise ProtocolError(
                    "bad_dtype", name, f"expected 1-D {dtype.str}, got {arr.ndim}-D {arr.dtype.str}"
                )
            arrays[name] = arr
        seg = cls(**{k: header[k] for k in META}, **arrays)
        seg.validate(latest_version)
        return seg

    def validate(self, latest_version: int | None = None) -> None:
        """Consistency rules of DESIGN.md: lengths agree, masks binary, log-probs finite, no future versions."""
        n = self.num_tokens
        if n == 0:
            raise ProtocolError("empty", "tokens", "segment has no tokens")
        for name in ARRAYS:
            if getattr(self, name).shape[0] != n:
                raise ProtocolError(
                    "length_mismatch",
                    name,
                    f"has {getattr(self, name).shape[0]} entries, tokens has {n}",
                )
        if self.tokens.min() < 0:
            raise ProtocolError("bad_value", "tokens", "negative token id")
        mask = self.action_mask
        if mask.max() > 1:
            raise ProtocolError("bad_value", "action_mask", "values must be 0 or 1")
        act = mask.astype(bool)
        if not act.any():
            raise ProtocolError("no_actions", "action_mask", "segment has no action tokens")
        if act[0]:
            raise ProtocolError(
                "bad_value",
                "action_mask",
                "the first token cannot be an action (it has no context)",
            )
        for name in ("behavior_logprobs", "rewards"):
            if not np.isfinite(getattr(self, name)).all():
                raise ProtocolError("non_finite", name, "contains NaN or inf")
        if (self.behavior_logprobs[act] > 1e-4).any():
            raise ProtocolError("bad_value", "behavior_logprobs", "log-probabilities must be <= 0")
        if (self.behavior_logprobs[~act] != 0).any():
            raise ProtocolError(
                "bad_value", "behavior_logprobs", "must be 0 where action_mask is 0"
            )
        if (self.rewards[~act] != 0).any():
            raise ProtocolError(
                "bad_value",
                "rewards",
                "reward on a non-action token (place it on the step's last action token)",
            )
        if (self.versions[~act] != -1).any():
            raise ProtocolError("bad_value", "versions", "must be -1 where action_mask is 0")
        if self.versions[act].min() < 0:
            raise ProtocolError("bad_value", "versions", "action tokens need a version >= 0")
        if latest_version is not None and self.versions[act].max() > latest_version:
            raise ProtocolError(
                "future_version",
                "versions",
                f"version {int(self.versions[act].max())} is newer than the latest {latest_version}",
            )
        if self.terminated and self.truncated:
            raise ProtocolError(
                "bad_value", "terminated", "a segment cannot be both terminated and truncated"
            )
        if self.segment < 0:
            raise ProtocolError("bad_value", "segment", "must be >= 0")


def _check_ids(header: dict[str, Any]) -> None:
    for name in ("traj_id", "episode_id", "actor_id", "task", "permit", "group_id"):
        value = header.get(name)
        if value is None and name == "group_id":
            continue
        if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_LEN:
            raise ProtocolError(
                "bad_value", name, f"must be a non-empty string of at most {MAX_ID_LEN} characters"
            )
    metrics = header.get("metrics")
    if not isinstance(metrics, dict) or len(metrics) > MAX_METRICS:
        raise ProtocolError(
            "bad_value", "metrics", f"must be a map of at most {MAX_METRICS} entries"
        )
    for key, value in metrics.items():
        if not isinstance(key, str) or not isinstance(value, (int, float, str, bool)):
            raise ProtocolError(
                "bad_value", f"metrics.{key}", "keys are strings, values numbers/strings/booleans"
            )
        if isinstance(value, float) and not np.isfinite(value):
            raise ProtocolError("non_finite", f"metrics.{key}", "contains NaN or inf")
