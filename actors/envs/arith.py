"""Single-turn arithmetic phrased for an instruction model, with an exact checker.

The prompt asks a chat model a question in its own register ("What is 23 + 45? Answer with the
number only.") instead of the bare `Add: a+b=` the tiny model learns, so a real instruct model
starts from a sensible policy: it often gets the number right but wraps it in a sentence.
"""

from __future__ import annotations

import operator
import random
import re

from actors.envs.base import StepResult, check_int, check_seed, check_step

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_INTEGER = re.compile(r"(?<!\d)-?\d+")  # "9-2" reads as 9 and 2; " -3" as -3
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # "1,234" -> "1234"


def last_integer(text: str) -> int | None:
    """The last integer written in `text` (thousands separators allowed), or None."""
    found = _INTEGER.findall(_THOUSANDS.sub("", text))
    return int(found[-1]) if found else None


def is_bare_integer(text: str) -> bool:
    """The answer is a number and nothing else (a closing period is tolerated)."""
    return (
        _INTEGER.fullmatch(_THOUSANDS.sub("", text.strip().removesuffix(".").strip())) is not None
    )


def arith_reward(action: str, target: int) -> float:
    """Reward in [0, 1]: the right number, full credit only when given as asked.

        correct = [last integer of the answer == target]
        reward  = correct * (1     if the answer is that bare number
                             0.5   otherwise, e.g. "23 + 45 = 68")

    Judging the *last* number lets a worked answer ("3 + 4 = 7") count as correct; the format
    half is what the instruction asks for, and a wrong bare number earns nothing.
    """
    correct = last_integer(action) == target
    return float(correct) * (1.0 if is_bare_integer(action) else 0.5)


class ArithEnv:
    """`What is a <op> b?` with a, b in 0..max_operand; one step, always terminated."""

    name = "arith"
    stop = ["\n"]

    def __init__(
        self, max_operand: int = 20, operations: str = "+", max_new_tokens: int = 12
    ) -> None:
        self.max_operand = check_int("arith max_operand", max_operand, 1)
        self.max_new_tokens = check_int("arith max_new_tokens", max_new_tokens, 1)
        if not isinstance(operations, str) or not operations or set(operations) - set(OPERATIONS):
            raise ValueError(
                f"arith operations must be a non-empty string of {''.join(OPERATIONS)}, "
                f"got {operations!r}"
            )
        self.operations = operations
        self._prompt = ""
        self._target = 0
        self._running = False

    def reset(self, seed: int) -> str:
        rng = random.Random(check_seed(self.name, seed))
        op = rng.choice(self.operations)
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        if op == "-":
            a, b = max(a, b), min(a, b)  # non-negative results, as a small model expects
        self._target = OPERATIONS[op](a, b)
        self._prompt = f"What is {a} {op} {b}? Answer with the number only."
        self._running = True
        return self._prompt

    def step(self, action: str) -> StepResult:
        action = check_step(self.name, self._running, action)
        self._running = False
        reward = arith_reward(action, self._target)
        info = {
            "success": reward == 1.0,
            "correct": reward > 0.0,
            "turns": 1,
            "target": self._target,
        }
        return StepResult("", reward, terminated=True, truncated=False, info=info)

    def compact(self) -> str:
        """The task is a single turn: the prompt itself is the whole state."""
        return self._prompt
