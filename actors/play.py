"""Environment episodes on one engine: continuous batching, for the actor and without a broker.

``Rollouts`` keeps the episodes in flight, each at its own turn: a turn is submitted the moment
the previous one was applied to its environment, one engine step samples a token for every
episode, and an episode that ends frees its slot at once. ``EnvDriver`` is the actor's driver
over it (``actors.driver``): one episode per permit, seeds from the training half. ``play`` plays
given instances with no broker at all (held-out evaluation, critic pre-training).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import structlog

from actors.chat import ChatFormat
from actors.driver import Ended, Outcome, Wants
from actors.engines import Engine, Generation, SamplingParams
from actors.envs import make_env
from actors.envs.base import train_seed
from actors.episode import Episode
from common.config import ActorConfig
from common.trajectory import Segment

log = structlog.get_logger()


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
        self,
        engine: Engine,
        *,
        temperature: float,
        top_p: float,
        reuse_prefix: bool = True,
        seed_of: Callable[[Episode], int | None] = lambda episode: None,
    ) -> None:
        self.engine, self.seed_of = engine, seed_of
        self.temperature, self.top_p = temperature, top_p
        self.reuse_prefix = reuse_prefix
        self.episodes: dict[str, Episode] = {}

    def __len__(self) -> int:
        return len(self.episodes)

    def __iter__(self) -> Iterator[Episode]:
        return iter(self.episodes.values())

    def params(self, episode: Episode) -> SamplingParams:
        """The sampling of the episode's next action: the environment's budget and stops, the
        chat format's end-of-turn tokens, the actor's temperature and top-p, and ``seed_of``'s
        seed (None: the engine draws one)."""
        env = episode.env
        return SamplingParams(
            max_new_tokens=env.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=list(env.stop),
            stop_token_ids=episode.fmt.stop_token_ids,
            seed=self.seed_of(episode),
        )

    def add(self, episode: Episode) -> None:
        """Put a new episode in flight: its first turn is submitted at once."""
        self.episodes[episode.episode_id] = episode
        self.engine.submit(episode.episode_id, episode.context, self.params(episode))

    def drop(self, episode_id: str) -> None:
        """Stop playing an episode (it ended, or the broker will not take it)."""
        self.episodes.pop(episode_id, None)
        self.engine.release(episode_id)

    def step(self) -> list[Turn]:
        """One engine step; every turn it finished is applied to its environment and the
        episode's next turn submitted, or the episode leaves when it is done."""
        turns = []
        for key, gen in self.engine.step():
            episode = self.episodes[key]
            try:
                segments = episode.step(gen)
            except Exception as exc:  # the environment's code or output: not the actor's to die of
                self.drop(key)
                turns.append(Turn(episode, gen, [], f"{type(exc).__name__}: {exc}"))
                continue
            if episode.done:
                self.drop(key)
            else:
                if not self.reuse_prefix:
                    self.engine.release(key)
                self.engine.submit(key, episode.context, self.params(episode))
            turns.append(Turn(episode, gen, segments))
        return turns


def new_episode(
    ac: ActorConfig, fmt: ChatFormat, seed: int, *, permit: str, actor_id: str, group_id: str | None
) -> Episode:
    """An episode of ``actor.env`` on instance ``seed``, under the actor's turn and context budgets."""
    return Episode(
        make_env(ac.env, **ac.env_kwargs),
        fmt,
        seed=seed,
        permit=permit,
        actor_id=actor_id,
        group_id=group_id,
        max_turns=ac.max_turns,
        context_budget=ac.context_budget_tokens,
    )


class EnvDriver:
    """The actor's environment episodes: one per permit, the ``group_size`` episodes of a group
    on one seed (a training seed: never one of the held-out instances evaluation plays)."""

    def __init__(self, ac: ActorConfig, engine: Engine, fmt: ChatFormat, actor_id: str) -> None:
        self.ac, self.fmt, self.actor_id = ac, fmt, actor_id
        self.rollouts = Rollouts(engine, temperature=ac.temperature, top_p=ac.top_p)
        self.started = 0

    def __len__(self) -> int:
        return len(self.rollouts)

    def held_permits(self) -> list[str]:
        return [ep.permit for ep in self.rollouts]

    def wants(self) -> Wants:
        """Permits for the free slots, in whole groups; with nothing in flight the broker may
        hold the request until capacity frees."""
        group = self.ac.group_size
        free = self.ac.max_inflight_episodes - len(self.rollouts)
        n = min(self.ac.permits_per_request, free - free % group)
        return Wants(max(n, 0), group, wait=not self.rollouts)

    def start(self, permits: list[dict]) -> Outcome:
        outcome, group = Outcome(), self.ac.group_size
        for i, permit in enumerate(permits):
            if i % group == 0:
                seed = train_seed(f"{self.ac.seed}/{self.actor_id}/{self.started}")
                group_id = f"{self.actor_id}.{self.started}" if group > 1 else None
            self.started += 1
            try:
                episode = new_episode(
                    self.ac, self.fmt, seed, permit=permit["id"], actor_id=self.actor_id,
                    group_id=group_id,
                )  # fmt: skip
            except Exception as exc:  # the environment's code: its episode is abandoned
                self._failed(outcome, permit["id"], "reset", exc)
                continue
            self.rollouts.add(episode)
        return outcome

    def step(self) -> Outcome:
        outcome = Outcome()
        for turn in self.rollouts.step():
            outcome.tokens += len(turn.generation.token_ids)
            episode = turn.episode
            if turn.error is not None:
                self._failed(outcome, episode.permit, "step", turn.error)
                continue
            outcome.segments += turn.segments
            if episode.done:
                hacks = int(episode.info.get("hacks_intercepted", 0))
                outcome.ended.append(Ended(episode.reward, hacks))
        return outcome

    def delivered(self, segment: Segment, accepted: bool) -> None:
        if not accepted:
            self.rollouts.drop(segment.episode_id)

    def close(self) -> None:
        return None

    def _failed(self, outcome: Outcome, permit: str, during: str, error: object) -> None:
        """An environment failed: its episode is abandoned, and HELLO frees the permit."""
        outcome.failures.append(during)
        outcome.released = True
        log.warning(
            "environment failed; episode abandoned",
            env=self.ac.env,
            during=during,
            permit=permit,
            error=str(error),
        )


def turn_seed(base: int, position: int, turn: int) -> int:
    """A sampling seed for one turn of one position in a list of instances (62 bits, as the
    engines draw their own)."""
    key = f"{base}/{position}/{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 2


def play(
    ac: ActorConfig,
    engine: Engine,
    fmt: ChatFormat,
    seeds: list[int],
    *,
    on_turn: Callable[[int, Episode], None] = lambda i, ep: None,
    on_end: Callable[[int, Episode | None, str | None], None] = lambda i, ep, error: None,
    should_stop: Callable[[], bool] = lambda: False,
    beat: Callable[[str], None] = lambda what: None,
    sampling_seed: int | None = None,
) -> int | None:
    """Play instance ``seeds[i]`` once for every i, ``actor.max_inflight_episodes`` at a time,
    with the engine's weights and the actor's sampling; no broker, nothing sent. ``on_turn`` sees
    every turn an episode survives, ``on_end`` every episode's end (None and the error when its
    environment failed). With a ``sampling_seed`` turn t of ``seeds[i]`` samples with the seed
    ``turn_seed(sampling_seed, i, t)``: every policy played on the same list gets the same draws.
    The tokens generated, or None when ``should_stop()`` ended it early."""
    index: dict[str, int] = {}

    def seed_of(episode: Episode) -> int | None:
        if sampling_seed is None:
            return None
        return turn_seed(sampling_seed, index[episode.episode_id], episode.turns)

    rollouts = Rollouts(engine, temperature=ac.temperature, top_p=ac.top_p, seed_of=seed_of)
    pending = list(enumerate(seeds))
    tokens = 0
    while pending or len(rollouts):
        if should_stop():
            return None
        while pending and len(rollouts) < ac.max_inflight_episodes:
            i, seed = pending.pop(0)
            try:
                episode = new_episode(ac, fmt, seed, permit="eval", actor_id="eval", group_id=None)
            except Exception as exc:  # the environment's code: the instance counts as failed
                on_end(i, None, f"{type(exc).__name__}: {exc}")
                continue
            index[episode.episode_id] = i
            rollouts.add(episode)
        beat("playing")
        for turn in rollouts.step():
            tokens += len(turn.generation.token_ids)
            ep = turn.episode
            if turn.error is None and not ep.done:
                on_turn(index[ep.episode_id], ep)
            else:
                on_end(index.pop(ep.episode_id), ep, turn.error)
    return tokens
