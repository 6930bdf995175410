"""An environment episode played by the policy, recorded as trained segments.

The environment's output is checked as it comes (text observations, finite rewards, a dict of
info): a broken environment costs its episode, never the actor. When the context would outgrow
``context_budget`` the environment compacts its history and the recorder cuts the segment there
(``actors.recorder``: the learner bootstraps across the cut).
"""

from __future__ import annotations

import uuid
from typing import Any

from actors.chat import ChatFormat
from actors.engines import Generation
from actors.envs.base import Environment, StepResult
from actors.recorder import Recorder, finite_number
from common.trajectory import Segment


def checked_text(env_name: str, method: str, value: object) -> str:
    """An environment's observation must be text: say which environment and call returned what."""
    if not isinstance(value, str):
        raise TypeError(
            f"environment {env_name!r}: {method} returned {type(value).__name__}, expected str"
        )
    return value


def checked_step(env_name: str, result: object) -> StepResult:
    """Refuse a step result the segment could not be built from, naming the environment."""
    if not isinstance(result, StepResult):
        raise TypeError(
            f"environment {env_name!r}: step returned {type(result).__name__}, expected StepResult"
        )
    checked_text(env_name, "step (observation)", result.observation)
    reward = result.reward
    if not finite_number(reward):
        raise ValueError(
            f"environment {env_name!r}: step returned reward {reward!r}, expected a finite number"
        )
    if not isinstance(result.info, dict):
        raise TypeError(
            f"environment {env_name!r}: step returned info {type(result.info).__name__}, expected dict"
        )
    return result


class Episode:
    """One environment episode played by the policy; emits finished segments as it goes."""

    def __init__(
        self,
        env: Environment,
        fmt: ChatFormat,
        *,
        seed: int,
        permit: str,
        actor_id: str,
        group_id: str | None,
        max_turns: int,
        context_budget: int,
    ):
        self.env, self.fmt = env, fmt
        self.max_turns, self.context_budget = max_turns, context_budget
        self.episode_id = uuid.uuid4().hex
        self.recorder = Recorder(
            episode_id=self.episode_id,
            permit=permit,
            actor_id=actor_id,
            task=env.name,
            group_id=group_id,
        )
        self.done = False
        self.info: dict[str, Any] = {}
        self.recorder.observe(fmt.prompt(checked_text(env.name, "reset", env.reset(seed))))

    @property
    def permit(self) -> str:
        return self.recorder.permit

    @property
    def context(self) -> list[int]:
        return self.recorder.context

    @property
    def segments(self) -> list[Segment]:
        return self.recorder.segments

    @property
    def turns(self) -> int:
        return self.recorder.turns

    @property
    def reward(self) -> float:
        return sum(s.reward for s in self.segments)

    def step(self, gen: Generation) -> list[Segment]:
        """Apply one sampled action; returns segments that are now finished (to be sent)."""
        result = checked_step(self.env.name, self.env.step(self.fmt.decode(gen.token_ids)))
        self.info = dict(result.info)
        self.recorder.act(gen, float(result.reward))
        truncated = result.truncated or (self.turns >= self.max_turns and not result.terminated)
        if result.terminated or truncated:
            self.done = True
            return [
                self.recorder.finish(self.info, terminated=result.terminated, truncated=truncated)
            ]
        obs_ids = self.fmt.turn(result.observation, gen.token_ids)
        if len(self.context) + len(obs_ids) + self.env.max_new_tokens > self.context_budget:
            finished = self.recorder.cut(self.info)  # compaction: a new segment starts
            summary = checked_text(self.env.name, "compact", self.env.compact())
            self.recorder.observe(self.fmt.prompt(summary))
            return [finished] if finished is not None else []
        self.recorder.observe(obs_ids)
        return []
