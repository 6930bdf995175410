"""The trajectory segment: the unit actors send, the broker queues and the learner trains on.

One episode may be cut into several segments (compaction, dynamic truncation); ``last`` marks the
episode's final segment, so the broker can hand out whole episodes and the learner can bootstrap a
segment's end from the first value of the next one. ``Segment.from_wire`` is the single place where
an untrusted trajectory is checked, field by field.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.protocol import Forward, ProtocolError

ARRAYS = {  # name -> dtype on the wire (docs/protocol.md, TRAJ)
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
    "temperature",
    "top_p",
    "metrics",
)
MAX_ID_LEN = 256
MAX_TEMPERATURE = 100.0
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
    temperature: float  # the sampling facts behind behavior_logprobs: the learner scores with them
    top_p: float
    tokens: np.ndarray
    action_mask: np.ndarray
    behavior_logprobs: np.ndarray
    versions: np.ndarray
    rewards: np.ndarray
    metrics: dict[str, Any] = field(default_factory=dict)
    frames: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The received frames behind the arrays, when known: ``wire_tensors`` forwards them."""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum())

    @functools.cached_property
    def min_version(self) -> int:
        """Oldest policy version that sampled any of this segment's action tokens.

        Read as unsigned, the -1 of every non-action token is the largest value, so a plain
        minimum is the minimum over action tokens (one pass, no mask; ``validate`` guarantees the
        layout). Computed once: the broker asks on every batch it assembles.
        """
        return int(self.versions.view(np.uint32).min())

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in ARRAYS)

    @property
    def reward(self) -> float:
        return float(self.rewards.sum())

    def header(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in META}

    def arrays(self, prefix: str = "") -> dict[str, np.ndarray]:
        return {prefix + name: getattr(self, name) for name in ARRAYS}

    def wire_tensors(self, prefix: str = "") -> dict[str, np.ndarray | Forward]:
        """``arrays()`` for sending on: the frames this segment arrived in go out unchanged."""
        return {
            prefix + name: Forward(getattr(self, name), self.frames[name])
            if name in self.frames
            else getattr(self, name)
            for name in ARRAYS
        }

    @classmethod
    def from_wire(
        cls,
        header: dict[str, Any],
        tensors: dict[str, np.ndarray],
        *,
        prefix: str = "",
        latest_version: int | None = None,
        frames: dict[str, Any] | None = None,
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
        if frames:
            seg.frames = {name: frames[prefix + name] for name in ARRAYS}
        seg.validate(latest_version)
        return seg

    def validate(self, latest_version: int | None = None) -> None:
        """The rules of docs/protocol.md §6.1: lengths agree, masks binary, log-probs finite, no future versions.

        Every byte a broker accepts goes through here, so each rule is one vectorized pass without
        gathers (a 4 MB segment takes well under a millisecond); the exact offending rule is worked
        out only once a pass has failed.
        """
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
        if self.action_mask.max() > 1:
            raise ProtocolError("bad_value", "action_mask", "values must be 0 or 1")
        act = self.action_mask.view(np.bool_)  # a view, no copy: every byte is 0 or 1
        if not act.any():
            raise ProtocolError("no_actions", "action_mask", "segment has no action tokens")
        if act[0]:
            raise ProtocolError(
                "bad_value",
                "action_mask",
                "the first token cannot be an action (it has no context)",
            )
        off = ~act
        for name in ("behavior_logprobs", "rewards"):
            values = getattr(self, name)
            lo, hi = values.min(), values.max()  # NaN and inf surface in min or max
            if not (np.isfinite(lo) and np.isfinite(hi)):
                raise ProtocolError("non_finite", name, "contains NaN or inf")
            if np.logical_and(values != 0, off).any():
                raise ProtocolError(
                    "bad_value",
                    name,
                    "must be 0 where action_mask is 0"
                    if name == "behavior_logprobs"
                    else "reward on a non-action token (place it on the step's last action token)",
                )
        if self.behavior_logprobs.max() > 1e-4:  # off-action entries are 0: the max is an action's
            raise ProtocolError("bad_value", "behavior_logprobs", "log-probabilities must be <= 0")
        versions = self.versions
        if ((versions >= 0) != act).any() or versions.min() < -1:
            if (versions[off] != -1).any():
                raise ProtocolError("bad_value", "versions", "must be -1 where action_mask is 0")
            raise ProtocolError("bad_value", "versions", "action tokens need a version >= 0")
        if latest_version is not None and versions.max() > latest_version:
            raise ProtocolError(
                "future_version",
                "versions",
                f"version {int(versions.max())} is newer than the latest {latest_version}",
            )
        if self.terminated and self.truncated:
            raise ProtocolError(
                "bad_value", "terminated", "a segment cannot be both terminated and truncated"
            )
        if self.segment < 0:
            raise ProtocolError("bad_value", "segment", "must be >= 0")
        if not (math.isfinite(self.temperature) and 0 < self.temperature <= MAX_TEMPERATURE):
            raise ProtocolError(
                "bad_value",
                "temperature",
                f"expected a finite number in (0, {MAX_TEMPERATURE}], got {self.temperature!r}",
            )
        if not 0 < self.top_p <= 1:  # NaN fails both comparisons
            raise ProtocolError(
                "bad_value", "top_p", f"expected a number in (0, 1], got {self.top_p!r}"
            )


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
