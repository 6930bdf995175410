"""The one place a trained segment is built and cut: tokens in, wire segments out.

An episode's context is recorded token by token: observation tokens (prompt, chat template, tool
output: mask 0, no log-prob, version -1) and action tokens (the engine's own ids, each with its
log-prob μ and the version that sampled it; a step's reward on its last action token). Where the
context restarts (an environment compacts its history, an agent rewrites its conversation) the
current segment is **cut**: it ends ``truncated`` (the learner bootstraps across the cut, never a
terminal) and a new segment starts from the new context. The episode's last segment ends
``terminated`` or ``truncated`` as its driver says. Both drivers (``actors.episode`` for
environments, ``actors.agent.sessions`` for agents) cut here and nowhere else: the learner's GAE
depends on this one rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.engines import Generation
from common.trajectory import Segment


def finite_number(value: object) -> bool:
    """A reward from outside (an environment, an agent): an int or float, finite, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SegmentBuilder:
    """The rectangular arrays of one segment, grown token by token."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    sampling: tuple[float, float] | None = None  # (temperature, top_p) of every action in it

    def observe(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.rewards += [0.0] * len(ids)

    def act(self, gen: Generation, reward: float) -> None:
        sampling = (gen.temperature, gen.top_p)
        if self.sampling not in (None, sampling):
            raise ValueError(
                f"one segment sampled with two settings (temperature, top_p): {self.sampling} "
                f"and {sampling}; the learner scores a segment under one"
            )
        self.sampling = sampling
        self.tokens += gen.token_ids
        self.mask += [1] * len(gen.token_ids)
        self.logprobs += gen.logprobs
        self.versions += gen.versions
        self.rewards += [0.0] * (len(gen.token_ids) - 1) + [reward]
        self.turns += 1


class Recorder:
    """One episode's segments under one permit: what is recorded, and where it is cut."""

    def __init__(
        self,
        *,
        episode_id: str,
        permit: str,
        actor_id: str,
        task: str,
        group_id: str | None,
    ) -> None:
        self.episode_id, self.permit, self.actor_id = episode_id, permit, actor_id
        self.task, self.group_id = task, group_id
        self.current = SegmentBuilder()
        self.segments: list[Segment] = []  # the finished ones, in order
        self.turns = 0
        self.cuts = 0

    @property
    def context(self) -> list[int]:
        """The current segment's tokens: what the engine continues."""
        return self.current.tokens

    def observe(self, ids: list[int]) -> None:
        self.current.observe(ids)

    def act(self, gen: Generation, reward: float = 0.0) -> None:
        self.current.act(gen, reward)
        self.turns += 1

    def cut(self, metrics: dict[str, Any]) -> Segment | None:
        """End the current segment ``truncated`` and start an empty one; the finished segment,
        or None when it holds no action (nothing to train: it is dropped)."""
        finished = None
        if self.current.turns:
            finished = self._close(metrics, last=False, terminated=False, truncated=True)
            self.cuts += 1
        self.current = SegmentBuilder()
        return finished

    def finish(
        self, metrics: dict[str, Any], *, terminated: bool, truncated: bool, reward: float = 0.0
    ) -> Segment:
        """The episode's last segment; ``reward`` is added on its last action token."""
        self.current.rewards[-1] += reward
        return self._close(metrics, last=True, terminated=terminated, truncated=truncated)

    def _close(
        self, metrics: dict[str, Any], *, last: bool, terminated: bool, truncated: bool
    ) -> Segment:
        """The validated wire segment of what was built."""
        b = self.current
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))}
        scalars.update(turns=self.turns, segment_turns=b.turns, compactions=self.cuts)
        index = len(self.segments)
        seg = Segment(
            traj_id=f"{self.episode_id}.{index}",
            episode_id=self.episode_id,
            segment=index,
            actor_id=self.actor_id,
            task=self.task,
            group_id=self.group_id,
            permit=self.permit,
            last=last,
            terminated=terminated,
            truncated=truncated,
            temperature=b.sampling[0],
            top_p=b.sampling[1],
            tokens=np.asarray(b.tokens, dtype="<i4"),
            action_mask=np.asarray(b.mask, dtype="|u1"),
            behavior_logprobs=np.asarray(b.logprobs, dtype="<f4"),
            versions=np.asarray(b.versions, dtype="<i4"),
            rewards=np.asarray(b.rewards, dtype="<f4"),
            metrics=scalars,
        )
        seg.validate()
        self.segments.append(seg)
        return seg
