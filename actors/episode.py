"""Turning an environment interaction into trained segments, token by token.

The policy's own sampled ids are kept exactly (token in, token out: nothing is re-tokenized);
chat-template scaffolding and tool output are observation tokens (mask 0, no log-prob, version
-1); a step's reward sits on its last action token. When the context passes its budget the
environment compacts, the current segment ends ``truncated`` (the learner bootstraps there) and a
new segment starts from the compacted observation.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.engines import Generation
from actors.envs.base import Environment, StepResult
from common.trajectory import Segment

MARK = "\u2063"  # an invisible separator used to locate the assistant's text in a rendered template


class ChatFormat:
    """Token ids of the chat template around actions, computed once per tokenizer.

    ``prompt(obs)`` is the start of a conversation up to the assistant's turn; ``turn(obs, ended)``
    is what follows an assistant action: its end-of-turn marker (unless the engine already sampled
    it), the observation as the next user message, and the next generation prompt.
    """

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        user = [{"role": "user", "content": "x"}]
        one = self._render(user + [{"role": "assistant", "content": MARK}])
        self.end_of_turn = one[one.index(MARK) + len(MARK) :]
        candidates = [
            tokenizer.convert_tokens_to_ids("<|im_end|>"),
            tokenizer.eos_token_id,
        ]  # end of turn first
        self.stop_token_ids = list(
            dict.fromkeys(
                i for i in candidates if isinstance(i, int) and i != tokenizer.unk_token_id
            )
        )

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt(self, observation: str) -> list[int]:
        return self.conversation([{"role": "user", "content": observation}])

    def turn(self, observation: str, action_ids: list[int]) -> list[int]:
        return self.continuation([{"role": "user", "content": observation}], action_ids)

    def conversation(self, messages: list[dict]) -> list[int]:
        """A whole conversation up to the assistant's turn."""
        return self._ids(self._render(messages, generation_prompt=True))

    def continuation(self, messages: list[dict], action_ids: list[int]) -> list[int]:
        """What follows an assistant action that sampled `action_ids`: its end-of-turn marker
        (unless the engine sampled it), `messages`, and the next generation prompt."""
        stub = [{"role": "user", "content": "x"}, {"role": "assistant", "content": MARK}]
        text = self._render(stub + messages, generation_prompt=True)
        text = text[text.index(MARK) + len(MARK) :]
        if action_ids and action_ids[-1] in self.stop_token_ids:
            stop_text = self.tok.decode([action_ids[-1]], skip_special_tokens=False)
            text = text.removeprefix(stop_text)
        return self._ids(text)


def finite_number(value: object) -> bool:
    """A reward from outside (an environment, an agent): an int or float, finite, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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


@dataclass
class SegmentBuilder:
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

    def segment(
        self,
        *,
        episode_id: str,
        index: int,
        actor_id: str,
        task: str,
        group_id: str | None,
        permit: str,
        last: bool,
        terminated: bool,
        truncated: bool,
        metrics: dict,
    ) -> Segment:
        """The validated wire segment of what was built (the `index`-th of its episode)."""
        seg = Segment(
            traj_id=f"{episode_id}.{index}",
            episode_id=episode_id,
            segment=index,
            actor_id=actor_id,
            task=task,
            group_id=group_id,
            permit=permit,
            last=last,
            terminated=terminated,
            truncated=truncated,
            temperature=self.sampling[0],
            top_p=self.sampling[1],
            tokens=np.asarray(self.tokens, dtype="<i4"),
            action_mask=np.asarray(self.mask, dtype="|u1"),
            behavior_logprobs=np.asarray(self.logprobs, dtype="<f4"),
            versions=np.asarray(self.versions, dtype="<i4"),
            rewards=np.asarray(self.rewards, dtype="<f4"),
            metrics=metrics,
        )
        seg.validate()
        return seg


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
        self.permit, self.actor_id, self.group_id = permit, actor_id, group_id
        self.max_turns, self.context_budget = max_turns, context_budget
        self.episode_id = uuid.uuid4().hex
        self.segments: list[Segment] = []
        self.turns = 0
        self.compactions = 0
        self.done = False
        self.info: dict[str, Any] = {}
        self.current = SegmentBuilder()
        self.current.observe(fmt.prompt(checked_text(env.name, "reset", env.reset(seed))))

    @property
    def context(self) -> list[int]:
        return self.current.tokens

    def step(self, gen: Generation) -> list[Segment]:
        """Apply one sampled action; returns segments that are now finished (to be sent)."""
        text = self.fmt.tok.decode(gen.token_ids, skip_special_tokens=True)
        result = checked_step(self.env.name, self.env.step(text))
        self.turns += 1
        self.info = dict(result.info)
        truncated = result.truncated or (self.turns >= self.max_turns and not result.terminated)
        self.current.act(gen, float(result.reward))
        if result.terminated or truncated:
            self.done = True
            return [self._close(terminated=result.terminated, truncated=truncated, last=True)]
        obs_ids = self.fmt.turn(result.observation, gen.token_ids)
        if len(self.current.tokens) + len(obs_ids) + self.env.max_new_tokens > self.context_budget:
            finished = self._close(terminated=False, truncated=True, last=False)
            self.compactions += 1
            self.current = SegmentBuilder()
            summary = checked_text(self.env.name, "compact", self.env.compact())
            self.current.observe(self.fmt.prompt(summary))
            return [finished]
        self.current.observe(obs_ids)
        return []

    def _close(self, *, terminated: bool, truncated: bool, last: bool) -> Segment:
        metrics = {k: v for k, v in self.info.items() if isinstance(v, (int, float, str, bool))}
        metrics.update(
            turns=self.turns, segment_turns=self.current.turns, compactions=self.compactions
        )
        seg = self.current.segment(
            episode_id=self.episode_id,
            index=len(self.segments),
            actor_id=self.actor_id,
            task=self.env.name,
            group_id=self.group_id,
            permit=self.permit,
            last=last,
            terminated=terminated,
            truncated=truncated,
            metrics=metrics,
        )
        self.segments.append(seg)
        return seg
