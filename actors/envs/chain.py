"""Chain: a long-horizon task with one skill per turn, whose horizon and difficulty the seed fixes.

Each turn the observation shows a hint, a move letter (U, D, L or R); the right answer is that
letter. An instance needs N right answers, N log-uniform in [min_turns, max_turns]; the reward is
1 only after the N-th (sparse, terminal). The skill is the same at every horizon, so the horizon
alone sets the difficulty: a policy right with probability p per turn succeeds with p^N, and a
learner must raise p to near 1 to solve the long instances.

Two variants the literature separates ("Learning Without Critics?", arXiv 2511.03527):

* ``early_termination: true``: a wrong answer ends the episode with 0 (the budget is N turns);
* ``early_termination: false``: a wrong answer costs a turn and the same step is shown again; the
  budget is N + ceil(slack * N) turns, and running out of it ends the episode with 0.

Every observation says the step, N, the turn and the budget: what a critic needs to predict the
return. Compaction keeps exactly that. ``min_turns: 1, max_turns: 3`` is the short twin, and
``coin_flip: true`` the control that must not learn: the final reward is a fair coin tossed
per episode, whatever the answers.
"""

from __future__ import annotations

import math
import random

from actors.envs.base import Info, StepResult, check_int, check_seed, check_step

LETTERS = "UDLR"


class ChainEnv:
    name = "chain"
    stop = ["\n"]

    def __init__(
        self,
        min_turns: int = 2,
        max_turns: int = 50,
        early_termination: bool = True,
        slack: float = 0.5,
        action_tokens: int = 2,
        coin_flip: bool = False,
    ) -> None:
        self.min_turns = check_int("chain: min_turns", min_turns, minimum=1)
        self.max_turns = check_int("chain: max_turns", max_turns, minimum=self.min_turns)
        if not isinstance(early_termination, bool):
            raise TypeError(f"chain: early_termination must be a bool, got {early_termination!r}")
        if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not 0 <= slack <= 10:
            raise ValueError(f"chain: slack must be a number in [0, 10], got {slack!r}")
        if not isinstance(coin_flip, bool):
            raise TypeError(f"chain: coin_flip must be a bool, got {coin_flip!r}")
        self.early_termination, self.slack, self.coin_flip = (
            early_termination,
            float(slack),
            coin_flip,
        )
        self.max_new_tokens = check_int("chain: action_tokens", action_tokens, minimum=1)
        self._moves = ""
        self._running = False

    @property
    def horizon(self) -> int | None:
        """N, the right answers the instance needs (evaluation stratifies by it)."""
        return len(self._moves) or None

    def reset(self, seed: int) -> str:
        rng = random.Random(check_seed(self.name, seed))
        # log-uniform N: as many instances of 2-5 turns as of 16-50
        n = round(math.exp(rng.uniform(math.log(self.min_turns), math.log(self.max_turns))))
        self._moves = "".join(rng.choice(LETTERS) for _ in range(n))
        self._budget = n if self.early_termination else n + math.ceil(self.slack * n)
        self._step, self._turns, self._wrong = 0, 0, 0
        # The control's reward: a fresh coin per episode, not per instance (a group of episodes
        # on one instance must not all tie, or GRPO's control would see no signal at all).
        self._coin = float(random.random() < 0.5)
        self._running = True
        return f"{self._rules()} {self._state()}"

    def step(self, action: str) -> StepResult:
        action = check_step(self.name, self._running, action)
        self._turns += 1
        text = action.lstrip()
        right = bool(text) and text[0].upper() == self._moves[self._step]
        if right:
            self._step += 1
        else:
            self._wrong += 1
        success = self._step == len(self._moves)
        failed = not success and (
            (not right and self.early_termination) or self._turns >= self._budget
        )
        self._running = not (success or failed)
        observation = f"{'Right' if right else 'Wrong'}. {self._state()}" if self._running else ""
        reward = float(success)
        if self.coin_flip:  # the control: a coin at the end, whatever the answers were
            reward = 0.0 if self._running else self._coin
        return StepResult(
            observation,
            reward,
            terminated=not self._running,
            truncated=False,
            info=self._info(success),
        )

    def compact(self) -> str:
        """The rules and the state: enough to continue optimally from here."""
        if not self._moves:
            raise RuntimeError("chain.compact: no episode yet, call reset(seed) first")
        return f"{self._rules()} {self._state()}"

    def _rules(self) -> str:
        ending = (
            "A wrong answer ends the game."
            if self.early_termination
            else "A wrong answer costs a turn."
        )
        return (
            f"Answer each turn with the letter in the hint. {len(self._moves)} right answers "
            f"within {self._budget} turns win. {ending}"
        )

    def _state(self) -> str:
        return (
            f"Step {self._step + 1}/{len(self._moves)}, turn {self._turns + 1}/{self._budget}. "
            f"Hint: [{self._moves[self._step]}]."
        )

    def _info(self, success: bool) -> Info:
        return {
            "success": success,
            "turns": self._turns,
            "horizon": len(self._moves),
            "wrong_answers": self._wrong,
        }
