"""The episodes in flight: each at its own turn, all advanced together by one engine.

Continuous batching: an episode's turn is submitted to the engine the moment the previous one
was applied to its environment, so the engine always steps every episode that has a turn to
play, and an episode that ends frees its slot for the next one at once. Nothing here talks to the
broker: the actor adds episodes when it holds permits and sends the segments that come back.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from actors.engines import Engine, Generation, SamplingParams
from actors.episode import Episode
from common.trajectory import Segment


@dataclass
class Turn:
    """One finished turn: the episode it belongs to, what was sampled, the segments it closed,
    and the error when the environment failed on it (the episode is then abandoned)."""

    episode: Episode
    generation: Generation
    segments: list[Segment]
    error: str | None = None


class Rollouts:
    """Owns the in-flight episodes and their turns on the engine.

    With ``reuse_prefix`` (the default) an episode keeps its engine key, and its KV cache, from
    turn to turn; without it each turn is a new request that re-encodes the whole context (the
    benchmark's ablation).
    """

    def __init__(
        self, engine: Engine, *, temperature: float, top_p: float, reuse_prefix: bool = True
    ) -> None:
        self.engine = engine
        self.temperature, self.top_p = temperature, top_p
        self.reuse_prefix = reuse_prefix
        self.episodes: dict[str, Episode] = {}

    def __len__(self) -> int:
        return len(self.episodes)

    def __iter__(self) -> Iterator[Episode]:
        return iter(self.episodes.values())

    def params(self, episode: Episode) -> SamplingParams:
        """The sampling of the episode's next action: the environment's budget and stops, the
        chat format's end-of-turn tokens, the actor's temperature and top-p."""
        env = episode.env
        return SamplingParams(
            max_new_tokens=env.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=list(env.stop),
            stop_token_ids=episode.fmt.stop_token_ids,
        )

    def add(self, episode: Episode) -> None:
        """Put a new episode in flight: its first turn is submitted at once."""
        self.episodes[episode.episode_id] = episode
        self.engine.submit(episode.episode_id, episode.context, self.params(episode))

    def drop(self, episode: Episode) -> None:
        """Stop playing an episode (it ended, or the broker will not take it)."""
        self.episodes.pop(episode.episode_id, None)
        self.engine.release(episode.episode_id)

    def step(self) -> list[Turn]:
        """One engine step; every turn it finished is applied to its environment and the
        episode's next turn submitted, or the episode leaves when it is done."""
        turns = []
        for key, gen in self.engine.step():
            episode = self.episodes[key]
            try:
                segments = episode.step(gen)
            except Exception as exc:  # the environment's code or output: not the actor's to die of
                self.drop(episode)
                turns.append(Turn(episode, gen, [], f"{type(exc).__name__}: {exc}"))
                continue
            if episode.done:
                self.drop(episode)
            else:
                if not self.reuse_prefix:
                    self.engine.release(key)
                self.engine.submit(key, episode.context, self.params(episode))
            turns.append(Turn(episode, gen, segments))
        return turns
