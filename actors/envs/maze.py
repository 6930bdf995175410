"""Key-and-door grid walk: sparse reward, episode lengths from 2 to the turn budget.

The seed fixes a layout whose shortest solution takes a known number of turns (`optimal_turns`),
drawn log-uniformly so that many instances are short (learnable) and a tail reaches the budget.
The door's place is only revealed by the key's tag, a fact that a compaction summary must keep.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from actors.envs.base import Info, StepResult, check_int, check_seed, check_step

Point = tuple[int, int]

# R is x+1, U is y+1. A move is the first letter of the action, so "R", "r." and "Right" agree.
MOVES: dict[str, Point] = {"r": (1, 0), "l": (-1, 0), "u": (0, 1), "d": (0, -1)}


def parse_move(action: str) -> Point | None:
    """The move named by the action's first non-space character, or None.

    Only the first letter counts: a policy that starts its answer with the move is understood
    whatever follows (a word, punctuation, a token cut off by the action budget); the rest of the
    action is ignored, not rewarded. An exact-match rule left a random-init model 0.02% valid turns.
    """
    text = action.lstrip()
    return MOVES.get(text[0].lower()) if text else None


@dataclass(frozen=True)
class MazeLayout:
    size: int  # the grid is size x size, coordinates 0..size-1
    start: Point
    key: Point
    door: Point
    optimal_turns: int  # |start - key|_1 + |key - door|_1: exact on an open grid


def manhattan(p: Point, q: Point) -> int:
    return abs(p[0] - q[0]) + abs(p[1] - q[1])


def next_move(position: Point, target: Point) -> str:
    """First move of a shortest path on an open grid: close the x gap, then the y gap."""
    if target[0] != position[0]:
        return "R" if target[0] > position[0] else "L"
    return "U" if target[1] > position[1] else "D"


def cells_at_distance(center: Point, distance: int, size: int) -> list[Point]:
    """All grid cells exactly `distance` steps (L1) from `center`, in a fixed order."""
    cells = set()
    for dx in range(-distance, distance + 1):
        rest = distance - abs(dx)
        cells.update((center[0] + dx, center[1] + dy) for dy in (rest, -rest))
    return sorted((x, y) for x, y in cells if 0 <= x < size and 0 <= y < size)


def make_layout(rng: random.Random, max_turns: int) -> MazeLayout:
    """Draw a layout whose shortest solution is a log-uniform length in [2, max_turns].

    optimal = round(2 * (max_turns / 2) ** u), u ~ U[0, 1)   (log-uniform)
    With max_turns = 50 about half the instances need <= 10 turns and 1 in 14 needs >= 40.
    """
    optimal = round(2 * (max_turns / 2) ** rng.random())
    # from any cell the farthest corner is >= size - 1 away, so each leg of up to size - 1
    # steps fits wherever the key lands, and two legs cover max_turns
    size = (max_turns + 1) // 2 + 1
    to_key = rng.randint(max(1, optimal - (size - 1)), min(optimal - 1, size - 1))
    key = (rng.randrange(size), rng.randrange(size))
    start = rng.choice(cells_at_distance(key, to_key, size))
    door = rng.choice(cells_at_distance(key, optimal - to_key, size))
    return MazeLayout(size, start, key, door, optimal)


def _fmt(p: Point) -> str:
    return f"({p[0]},{p[1]})"


class MazeEnv:
    """Walk to the key, then to the door it names; reward 1 only on reaching the door with it.

    The episode terminates on success or when the `max_turns` budget is spent (reward 0).
    Invalid actions and bumps into the outer wall waste a turn. Instances that need at most
    `hint_max_turns` turns print the next optimal move, so a tiny model has an easy start;
    `action_tokens` caps the tokens sampled per turn (the move is the first letter).
    """

    name = "maze"
    stop = ["\n"]

    def __init__(
        self, max_turns: int = 50, hint_max_turns: int = 4, action_tokens: int = 8
    ) -> None:
        self.max_turns = check_int("maze: max_turns", max_turns, minimum=2)
        self.hint_max_turns = check_int("maze: hint_max_turns", hint_max_turns, minimum=0)
        self.max_new_tokens = check_int("maze: action_tokens", action_tokens, minimum=1)
        self._layout: MazeLayout | None = None
        self._running = False

    def reset(self, seed: int) -> str:
        rng = random.Random(check_seed(self.name, seed))
        self._layout = layout = make_layout(rng, self.max_turns)
        self._position = layout.start
        self._has_key = False
        self._door_known = False
        self._turns = 0
        self._invalid_actions = 0
        self._compactions = 0
        self._running = True
        return (
            f"{self._rules()} Pick up the key, then reach the door within {self.max_turns} turns. "
            f"{self._facts()} You are at {_fmt(self._position)}.{self._hint()}"
        )

    @property
    def horizon(self) -> int | None:
        """Turns the instance needs (its shortest solution); evaluation stratifies by it."""
        return self._layout.optimal_turns if self._layout is not None else None

    def step(self, action: str) -> StepResult:
        action = check_step(self.name, self._running, action)
        layout = self._layout
        self._turns += 1
        move = parse_move(action)
        if move is None:
            self._invalid_actions += 1
            event = f"Invalid action {action.strip()[:16]!r}; use U, D, L or R."
        else:
            x, y = self._position[0] + move[0], self._position[1] + move[1]
            if 0 <= x < layout.size and 0 <= y < layout.size:
                self._position, event = (x, y), "Moved."
            else:
                event = "Wall, you did not move."
        if self._position == layout.key and not self._has_key:
            self._has_key = self._door_known = True
            event += f" You picked up the key; its tag says the door is at {_fmt(layout.door)}."
        elif self._position == layout.door and not self._has_key:
            self._door_known = True
            event += " A locked door is here; you need the key."

        success = self._has_key and self._position == layout.door
        # The budget is a rule of the task, stated in the prompt and counted in every observation,
        # so running out of it is a terminal failure (return exactly 0), not a cut to bootstrap:
        # bootstrapping here credited failed episodes with the critic's average success value.
        out_of_turns = not success and self._turns >= self.max_turns
        self._running = not (success or out_of_turns)
        observation = ""
        if self._running:
            observation = (
                f"{event} You are at {_fmt(self._position)}. "
                f"Turn {self._turns}/{self.max_turns}.{self._hint()}"
            )
        return StepResult(
            observation,
            float(success),
            terminated=not self._running,
            truncated=False,
            info=self._info(success),
        )

    def compact(self) -> str:
        """Position, key/door facts and turns used: enough to continue optimally from here."""
        if self._layout is None:
            raise RuntimeError("maze.compact: no episode yet, call reset(seed) first")
        self._compactions += 1
        return (
            f"Summary after {self._turns} of {self.max_turns} turns. {self._rules()} "
            f"You are at {_fmt(self._position)}. {self._facts()}{self._hint()}"
        )

    def _rules(self) -> str:
        size = self._layout.size
        return f"Maze {size}x{size}, moves U, D, L, R (R is x+1, U is y+1)."

    def _facts(self) -> str:
        layout = self._layout
        if self._has_key:
            return f"You have the key. The door is at {_fmt(layout.door)}."
        if self._door_known:
            return f"The key is at {_fmt(layout.key)}. A locked door is at {_fmt(layout.door)}."
        return f"The key is at {_fmt(layout.key)}; its tag tells where the door is."

    def _hint(self) -> str:
        layout = self._layout
        if layout.optimal_turns > self.hint_max_turns:
            return ""
        target = layout.door if self._has_key else layout.key
        return f" Hint: [{next_move(self._position, target)}]."  # the letter alone, as it is typed

    def _info(self, success: bool) -> Info:
        return {
            "success": success,
            "turns": self._turns,
            "optimal_turns": self._layout.optimal_turns,
            "compactions": self._compactions,
            "invalid_actions": self._invalid_actions,
            "has_key": self._has_key,
        }
