"""Single-turn addition: small enough that a tiny random-init LM visibly learns it with PPO."""

from __future__ import annotations

import random
import re

from actors.envs.base import StepResult, check_seed, check_step

LEADING_NUMBER = re.compile(r"\s*([0-9]+)")  # ASCII digits only: "²" is not an answer


def digits_reward(action: str, target: int) -> float:
    """Reward in [0, 1]: half for answering with a number, half for the right one.

        answer = the ASCII digits the action starts with (after whitespace)
        reward = 0.5 * [answer has 1-2 digits] + 0.5 * [answer == str(target)]

    What follows the number does not count, so a random policy already scores (any of the
    tokenizer's short number tokens first). Credit only for a *short* number: the tiny model's
    vocabulary has digit-run tokens ("56789"), and an earlier rule that credited digits anywhere
    in the first four characters paid them as much as an answer; the demo's policy learned to
    repeat "56789".
    """
    match = LEADING_NUMBER.match(action)
    answer = match.group(1) if match else ""
    return 0.5 * float(1 <= len(answer) <= 2) + 0.5 * float(answer == str(target))


class DigitsEnv:
    """`"Add: a+b="` with a, b in 0..9; the action is the sum; one step, always terminated."""

    name = "digits"
    max_new_tokens = 4
    stop = ["\n"]

    def __init__(self) -> None:
        self._prompt = ""
        self._target = -1
        self._running = False

    def reset(self, seed: int) -> str:
        rng = random.Random(check_seed(self.name, seed))
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        self._prompt, self._target, self._running = f"Add: {a}+{b}=", a + b, True
        return self._prompt

    def step(self, action: str) -> StepResult:
        action = check_step(self.name, self._running, action)
        self._running = False
        reward = digits_reward(action, self._target)
        info = {"success": reward == 1.0, "turns": 1, "target": self._target}
        return StepResult("", reward, terminated=True, truncated=False, info=info)

    def compact(self) -> str:
        """The task is a single turn: the prompt itself is the whole state."""
        return self._prompt
