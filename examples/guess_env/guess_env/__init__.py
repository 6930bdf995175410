"""Guess the number: an environment that lives outside asyncppo and is trained by import path.

    pip install -e examples/guess_env            # or put examples/guess_env on PYTHONPATH
    asyncppo up --config configs/demo.yaml --set actor.env=guess_env:make_env

It meets asyncppo's Environment protocol (name, max_new_tokens, stop, reset, step, compact) and
imports nothing from asyncppo except the StepResult it returns. Multi-turn with a sparse reward:
each wrong guess is answered "higher" or "lower", reward 1 only for finding the number within the
turn budget. A compaction summary keeps what the guesses so far have shown: the interval left.
"""

from __future__ import annotations

import random
import re

from actors.envs.base import StepResult


class GuessEnv:
    """The secret is uniform in [1, high]; `max_turns` guesses; binary search needs log2(high)."""

    name = "guess"
    stop = ["\n"]

    def __init__(self, high: int = 32, max_turns: int = 8, action_tokens: int = 4) -> None:
        if not isinstance(high, int) or high < 2:
            raise ValueError(f"guess: high must be an int >= 2, got {high!r}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"guess: max_turns must be an int >= 1, got {max_turns!r}")
        self.high, self.max_turns, self.max_new_tokens = high, max_turns, action_tokens
        self._secret: int | None = None

    def reset(self, seed: int) -> str:
        self._secret = random.Random(seed).randint(1, self.high)
        self._low, self._high, self._turns = 1, self.high, 0
        return f"Guess my number from 1 to {self.high}. {self._ask()}"

    def step(self, action: str) -> StepResult:
        if self._secret is None:
            raise RuntimeError("guess.step: call reset(seed) first")
        self._turns += 1
        match = re.search(r"\d+", action)
        guess = int(match.group()) if match else None
        found = guess == self._secret
        out_of_turns = not found and self._turns >= self.max_turns
        info = {"success": found, "turns": self._turns, "valid": guess is not None}
        if found or out_of_turns:
            self._secret = None  # the episode is over
            return StepResult("", 1.0 if found else 0.0, True, False, info)
        if guess is None:
            hint = "That is not a number."
        elif guess < self._secret:
            self._low = max(self._low, guess + 1)
            hint = "Higher."
        else:
            self._high = min(self._high, guess - 1)
            hint = "Lower."
        return StepResult(f"{hint} {self._ask()}", 0.0, False, False, info)

    def compact(self) -> str:
        return f"Summary: my number is from {self._low} to {self._high}. {self._ask()}"

    def _ask(self) -> str:
        return f"Turn {self._turns + 1} of {self.max_turns}. Answer with a number."


def make_env(**kwargs: object) -> GuessEnv:
    """The factory `actor.env` names: `guess_env:make_env` (kwargs from `actor.env_kwargs`)."""
    return GuessEnv(**kwargs)
