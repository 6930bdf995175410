"""The environment contract: text in, text out, with the terminal/truncation split PPO needs."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

Info = dict[str, float | int | str | bool]

# Instance seeds: bit 31 set on held-out ones (evaluation), clear on training ones.
HELD_OUT = 1 << 31


def train_seed(key: str) -> int:
    """A training instance's seed from a key (base seed, actor, episode count): bit 31 clear,
    so no training episode ever plays a held-out instance."""
    return zlib.crc32(key.encode()) & (HELD_OUT - 1)


@dataclass(frozen=True)
class StepResult:
    """What one action led to.

    `terminated` and `truncated` are kept apart because the learner treats them differently:
    a real end has no future value, a cut episode is bootstrapped from the critic.
    """

    observation: str  # text shown to the policy next (tool output); "" when the episode ended
    reward: float
    terminated: bool  # the task really ended (success, or failure by its own rules): no bootstrap
    truncated: bool  # cut short while the task could still go on (an outside limit): bootstrap
    info: Info  # episode facts for metrics (success, turns, hacks_intercepted, ...)

    def __post_init__(self) -> None:
        if self.terminated and self.truncated:
            raise ValueError("StepResult: terminated and truncated are exclusive, both were True")


@runtime_checkable
class Environment(Protocol):
    """A task an actor plays; the actor owns tokenization and the chat template."""

    name: str
    max_new_tokens: int  # how many tokens one action may take
    stop: list[str]  # stop strings that end an action

    def reset(self, seed: int) -> str:
        """Start the instance fixed by `seed`; return the first observation (the task prompt)."""
        ...

    def step(self, action: str) -> StepResult:
        """Apply one generated action."""
        ...

    def compact(self) -> str:
        """Summarise the decision-relevant state so far; the next segment starts from it."""
        ...


def check_seed(env_name: str, seed: object) -> int:
    """Reject seeds that `random.Random` would silently accept but that are not reproducible ids."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{env_name}.reset: seed must be an int, got {type(seed).__name__}")
    return seed


def check_step(env_name: str, running: bool, action: object) -> str:
    """Shared preconditions of `step`: an episode in progress and a text action."""
    if not running:
        raise RuntimeError(f"{env_name}.step: no episode in progress, call reset(seed) first")
    if not isinstance(action, str):
        raise TypeError(f"{env_name}.step: action must be a str, got {type(action).__name__}")
    return action


def check_int(where: str, value: object, minimum: int) -> int:
    """Validate an integer constructor argument, naming it in the error."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{where} must be >= {minimum}, got {value}")
    return value
