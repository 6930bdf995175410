"""The actor process: take permits, keep many episodes in flight, stream segments, follow new weights.

Three parts, each with one job: ``Rollouts`` owns the episodes in flight and steps them on the
engine (continuous batching: every episode at its own turn, a slot refilled the moment its
episode ends), ``BrokerLink`` talks to the broker, and the loop here joins them. It never waits
for the learner: permits are granted by the broker (asked for while slots are free), weights are
pulled when the broker announces a newer version (checked after every engine step, so a swap can
land in the middle of a turn), and a broker restart is survived by reconnecting and saying HELLO
again. Liveness is the link's heartbeat thread: a long engine step is never taken for death.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import structlog
import torch
from prometheus_client import Counter, Gauge, Histogram

from actors.agent import AgentServer, AgentSessions
from actors.engines import engine_for
from actors.envs import make_env
from actors.envs.base import train_seed
from actors.episode import ChatFormat, Episode
from actors.link import BrokerLink
from actors.rollout import Rollouts
from common.config import Config
from common.log import bind_version
from common.metrics import Health
from common.model import load_tokenizer
from common.trajectory import Segment
from common.transport import TransportError

log = structlog.get_logger()

M_TOKENS = Counter("asyncppo_actor_tokens_generated_total", "Tokens sampled by the policy.")
M_EPISODES = Counter("asyncppo_actor_episodes_total", "Episodes finished.")
M_SEGMENTS = Counter("asyncppo_actor_segments_sent_total", "Segments acknowledged by the broker.")
M_LOST = Counter(
    "asyncppo_actor_segments_discarded_total", "Segments the broker refused for good.", ["reason"]
)
M_REWARD = Histogram(
    "asyncppo_actor_episode_reward", "Episode reward.", buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9, 1, 2)
)
M_SYNC = Histogram(
    "asyncppo_actor_weight_sync_seconds",
    "Seconds to fetch and load a new policy version.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
M_VERSION = Gauge(
    "asyncppo_actor_policy_version", "Policy version loaded in the engine (-1: none yet)."
)
M_VERSION.set(-1)
M_REFUSED = Counter(
    "asyncppo_actor_weights_refused_total",
    "Published versions the engine could not take (an adapter for another base model, tensors "
    "that do not fit); it kept its weights.",
)
M_REFUSED_VERSION = Gauge(
    "asyncppo_actor_refused_version",
    "Newest version the engine refused (-1: none). While it is the broker's latest the actor "
    "starts no episode (permits are granted only at the latest version) and is not ready.",
)
M_REFUSED_VERSION.set(-1)
M_HACKS = Counter(
    "asyncppo_actor_hacks_intercepted_total", "Tool calls intercepted by the reward-hacking guard."
)
M_INFLIGHT = Gauge("asyncppo_actor_episodes_in_flight", "Episodes being played right now.")
M_KV_BYTES = Gauge(
    "asyncppo_actor_kv_cache_bytes", "Bytes of KV cache held for the episodes in flight."
)
M_ENV_ERRORS = Counter(
    "asyncppo_actor_env_errors_total",
    "Episodes abandoned because the environment raised or returned bad output.",
    ["during"],
)
PERMIT_RETRY_S = 0.5  # while episodes or sessions are in flight, ask for permits at most this often
IDLE_S = 0.2  # with nothing to play (no weights, a refused version): look again after this


def actor_id(cfg: Config) -> str:
    return (
        cfg.actor.id
        or os.environ.get("ASYNCPPO_ACTOR_ID")
        or f"{socket.gethostname()}-{os.getpid()}"
    )


class Actor:
    def __init__(self, cfg: Config, health: Health | None = None):
        self.cfg = cfg
        self.health = health or Health()
        self.id = actor_id(cfg)
        self.link = BrokerLink(
            cfg,
            self.id,
            self.health,
            version=lambda: self.engine.version,
            held=self.held_permits,
        )
        if cfg.actor.torch_threads:
            torch.set_num_threads(cfg.actor.torch_threads)
        self.engine = engine_for(cfg, cfg.model.path)
        self.rollouts = Rollouts(
            self.engine, temperature=cfg.actor.temperature, top_p=cfg.actor.top_p
        )
        self.fmt = ChatFormat(load_tokenizer(cfg.model.path))
        self.agent: AgentSessions | None = None
        self.server: AgentServer | None = None
        if cfg.actor.mode == "agent":
            self.agent = AgentSessions(
                self.engine,
                self.fmt,
                model=cfg.actor.agent_model or Path(cfg.model.path).name,
                actor_id=self.id,
                temperature=cfg.actor.temperature,
                max_tokens=cfg.actor.agent_max_tokens,
                session_timeout_s=cfg.actor.agent_session_timeout_s,
                request_timeout_s=cfg.actor.agent_request_timeout_s,
                take_permit=self._take_permit,
                send=self.send,
                release=self.link.hello,
                base_url=lambda session: f"{self.server.address}/sessions/{session}/v1",
            )
            self.server = AgentServer(self.agent, cfg.actor.agent_host, cfg.actor.agent_port)
            log.info("agent API serving", address=self.server.address, model=self.agent.model)
        self.engine.version = -1  # the local checkpoint is not a published version: fetch one first
        self.refused = -1  # the newest version the engine refused: not fetched again
        self.episodes_started = 0
        self.steps = 0
        self._next_permits = 0.0  # after a WAIT while busy: when to ask again
        log.info(
            "actor starting",
            actor_id=self.id,
            broker=cfg.actor.broker,
            engine=cfg.actor.engine,
            env=cfg.actor.env,
            max_inflight_episodes=cfg.actor.max_inflight_episodes,
        )

    # ------------------------------------------------------------ broker calls
    def behind(self) -> bool:
        """Whether the broker has a version newer than the engine's that was not refused."""
        return self.link.latest > max(self.engine.version, self.refused)

    def refused_latest(self) -> bool:
        """Whether the broker's latest version is one this engine refused: no permit can be had
        (they are granted only at the latest version) until a newer one it can load."""
        return 0 <= self.link.latest <= self.refused

    def sync_weights(self) -> None:
        """Load the newest complete version if it is newer than the engine's. A version the
        engine cannot take is logged, counted and skipped: the actor keeps playing its own."""
        t0 = time.monotonic()
        fetched = self.link.fetch_weights(max(self.engine.version, self.refused))
        if fetched is None:
            return
        manifest, tensors = fetched
        try:
            self.engine.load_version(manifest, tensors)
        except ValueError as exc:
            self.refused = manifest["version"]
            M_REFUSED.inc()
            M_REFUSED_VERSION.set(self.refused)
            log.error(
                "weights refused: this actor finishes its episodes in flight, then waits for a "
                "version it can load",
                version=manifest["version"],
                error=str(exc),
            )
            return
        M_VERSION.set(manifest["version"])
        M_SYNC.observe(time.monotonic() - t0)
        bind_version(manifest["version"])
        log.info(
            "weights loaded",
            version=manifest["version"],
            bytes=manifest["total_bytes"],
            seconds=round(time.monotonic() - t0, 3),
        )

    def request_permits(self) -> list[dict]:
        """Permits for the free slots, in whole groups. With nothing in flight the broker parks
        the request until capacity frees; with episodes to play it answers at once."""
        group = self.cfg.actor.group_size
        free = self.cfg.actor.max_inflight_episodes - len(self.rollouts)
        n = min(self.cfg.actor.permits_per_request, free - free % group)
        if n < 1:
            return []
        return self._ask_permits(n, group, wait=not self.rollouts)

    def _take_permit(self) -> dict | None:
        """One permit for an agent session, without blocking the sessions already running."""
        if self.engine.version < 0 or self.refused_latest():
            return None
        permits = self._ask_permits(1, 1, wait=False)
        return permits[0] if permits else None

    def _ask_permits(self, n: int, group: int, *, wait: bool) -> list[dict]:
        """PERMITS_REQ for `n` in groups of `group`. A WAIT: fetch the weights it asks for; or,
        when we did not wait (episodes or sessions to serve meanwhile), ask again only after
        PERMIT_RETRY_S; or sleep as the broker says."""
        if not wait and time.monotonic() < self._next_permits:
            return []
        reply = self.link.call(
            "PERMITS_REQ",
            {"n": n, "version": self.engine.version, "group": group, "wait": wait},
        )
        if reply.kind == "PERMITS":
            return reply.header["permits"]
        if reply.header["reason"] == "stale_weights":
            self.sync_weights()
        elif not wait:
            self._next_permits = time.monotonic() + max(
                PERMIT_RETRY_S, reply.header["retry_after_s"]
            )
        else:
            self.health.beat(f"permits ({reply.header['reason']})")
            time.sleep(reply.header["retry_after_s"])
        return []

    def held_permits(self) -> list[str]:
        """What HELLO reports: the permits of the episodes and agent sessions in flight."""
        held = [ep.permit for ep in self.rollouts]
        return held + (self.agent.permits if self.agent is not None else [])

    def send(self, seg: Segment) -> bool:
        """Stream one segment; False when the broker will never take this episode (stop playing it)."""
        lost = self.link.add(seg)
        if lost:
            M_LOST.labels(reason=lost).inc()
            return False
        M_SEGMENTS.inc()
        return True

    # --------------------------------------------------------------- rollouts
    def start(self, permits: list[dict]) -> None:
        """One new episode per permit; the `group_size` episodes of a group share a seed (a
        training seed: never one of the held-out instances evaluation plays)."""
        group = self.cfg.actor.group_size
        failed = False
        for i, permit in enumerate(permits):
            if i % group == 0:
                seed = train_seed(f"{self.cfg.actor.seed}/{self.id}/{self.episodes_started}")
                group_id = f"{self.id}.{self.episodes_started}" if group > 1 else None
            self.episodes_started += 1
            try:
                episode = Episode(
                    make_env(self.cfg.actor.env, **self.cfg.actor.env_kwargs),
                    self.fmt,
                    seed=seed,
                    permit=permit["id"],
                    actor_id=self.id,
                    group_id=group_id,
                    max_turns=self.cfg.actor.max_turns,
                    context_budget=self.cfg.actor.context_budget_tokens,
                )
            except Exception as exc:  # the environment's code: its episode is abandoned
                self._env_failed(permit["id"], "reset", exc)
                failed = True
                continue
            self.rollouts.add(episode)
        if failed:
            self.link.hello()  # HELLO names the permits still played: the broker frees the rest

    def play(self) -> None:
        """One engine step over every episode in flight; send the segments of finished turns."""
        failed = False
        for turn in self.rollouts.step():
            M_TOKENS.inc(len(turn.generation.token_ids))
            episode = turn.episode
            if turn.error is not None:
                self._env_failed(episode.permit, "step", turn.error)
                failed = True
                continue
            if not all(self.send(seg) for seg in turn.segments):
                self.rollouts.drop(episode)
                episode.done = True
            if episode.done:
                self._finish(episode)
        if failed:
            self.link.hello()  # frees the abandoned permits; the broker drops what they sent
        self.steps += 1
        M_INFLIGHT.set(len(self.rollouts))
        M_KV_BYTES.set(self.engine.kv_cache_bytes())

    def _env_failed(self, permit: str, during: str, error: object) -> None:
        M_ENV_ERRORS.labels(during=during).inc()
        log.warning(
            "environment failed; episode abandoned",
            env=self.cfg.actor.env,
            during=during,
            permit=permit,
            error=str(error),
        )

    def _finish(self, ep: Episode) -> None:
        reward = sum(s.reward for s in ep.segments)
        M_EPISODES.inc()
        M_REWARD.observe(reward)
        M_HACKS.inc(int(ep.info.get("hacks_intercepted", 0)))

    def serve(self) -> None:
        """Agent mode, one turn of the loop: answer API calls, then one engine step if any
        completion is being generated (else wait briefly for calls)."""
        self.agent.handle(wait_s=0.0 if self.agent.busy() else 0.05)
        if self.agent.busy():
            self.health.beat("generating")
            for key, gen in self.engine.step():
                M_TOKENS.inc(len(gen.token_ids))
                self.agent.finished(key, gen)
            self.steps += 1
        else:
            self.health.beat("serving")
        M_INFLIGHT.set(len(self.agent.sessions))
        M_KV_BYTES.set(self.engine.kv_cache_bytes())

    def run(self, should_stop: Callable[[], bool]) -> None:
        self.link.should_stop = should_stop
        try:
            self.link.register()
            self._loop(should_stop)
        except TransportError as exc:
            if exc.code != "interrupted":
                raise
            log.info("stopping: a request to the broker was abandoned", error=str(exc))
        finally:
            self.close()

    def _loop(self, should_stop: Callable[[], bool]) -> None:
        """Until told to stop: follow the versions, take permits, play, send."""
        while not should_stop():
            # After every engine step: a version the heartbeat thread heard of is fetched and
            # swapped in at once, also in the middle of a turn.
            if self.behind() or self.engine.version < 0:
                self.sync_weights()
            # Ready while it can play the latest version; a refused one leaves it alive (its
            # loop runs) but not ready, and it asks for nothing until a newer version.
            self.health.ready = self.engine.version >= 0 and not self.refused_latest()
            if self.agent is not None:
                self.serve()
                continue
            if self.health.ready:
                self.start(self.request_permits())
            if self.rollouts:
                self.health.beat("generating")
                self.play()
            elif not self.health.ready:
                self.health.beat(self._idle_reason())
                time.sleep(IDLE_S)

    def _idle_reason(self) -> str:
        if self.engine.version < 0 and self.refused < 0:
            return "waiting for weights"
        return f"waiting for a version this engine can load (it refused v{self.refused})"

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.link.close()
        log.info("actor stopped", actor_id=self.id, episodes=self.episodes_started)
