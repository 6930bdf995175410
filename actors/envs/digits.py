"""Single-turn addition: small enough that a tiny random-init LM visibly learns it with PPO."""

from __future__ import annotations

import random

from actors.envs.base import StepResult, check_seed, check_step

ASCII_DIGITS = frozenset("0123456789")


def digits_reward(action: str, target: int) -> float:
    """Reward in [0, 1] with partial credit so that a random policy already scores a little.

        answer = action.strip()
        format = 1                                   if answer is 1-2 ASCII digits
                 (# ASCII digits in action[:4]) / 4  otherwise
        reward = 0.5 * format + 0.5 * [answer == str(target)]

    The format term gives a smooth path up (any digit, then a short number, then the right one);
    a policy emitting random bytes gets about 0.5 * P(digit) > 0.
    """
    answer = action.strip()
    is_short_number = 1 <= len(answer) <= 2 and set(answer) <= ASCII_DIGITS
    format_score = 1.0 if is_short_number else sum(c in ASCII_DIGITS for c in action[:4]) / 4
    return 0.5 * format_score + 0.5 * float(answer == str(target))


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
