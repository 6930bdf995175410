"""The actor process: one loop that follows the versions, takes permits, steps one driver and
streams what it produced.

The actor owns the link to the broker (``actors.link``), the engine's weights, the permits and
the metrics; a **driver** (``actors.driver``) owns the episodes in flight: environment episodes
(``actors.play.EnvDriver``) or agent sessions (``actors.agent.sessions.AgentDriver``). The loop,
top to bottom: swap in a newer version the heartbeat thread heard of (also in the middle of a
turn); ask for the permits the driver can use; one driver step; send its segments and tell it
the broker's verdict; count what ended. It never waits for the learner, and a broker restart is
survived by reconnecting and saying HELLO again.
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

from actors.agent.server import AgentServer
from actors.agent.sessions import AgentDriver
from actors.chat import ChatFormat
from actors.driver import Driver, Outcome
from actors.engines import engine_for
from actors.link import BrokerLink
from actors.play import EnvDriver
from common.config import Config
from common.log import bind_version
from common.metrics import Health
from common.model import load_tokenizer
from common.pieces import Pieces
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
M_FIRST_BYTE, M_TRANSFER, M_VERIFY, M_LOAD, M_PAUSE = (
    Histogram(
        f"asyncppo_actor_weights_{name}_seconds",
        doc,
        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
    )
    for name, doc in (
        ("first_byte", "From the start of a version's download to its first chunk."),
        ("transfer", "From the start of a version's download to its last chunk."),
        ("verify", "Checking a downloaded version's tensors (sha256)."),
        ("load", "Loading a verified version into the engine (rollouts wait meanwhile)."),
        (
            "pause",
            "Time rollouts were held for a version: slots free, the held version too "
            "old to play (docs/protocol.md §7), until the new one was loaded.",
        ),
    )
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
M_ENGINE = {
    name: Counter(f"asyncppo_actor_engine_{name}_total", doc)
    for name, doc in (
        (
            "steps",
            "Engine steps that sampled, one token for every turn in progress: "
            "tokens generated / steps is the batch the engine ran.",
        ),
        ("forwards", "Model forwards the engine ran (prefill and decode)."),
        ("encoded_tokens", "Context tokens the engine ran through the model."),
        (
            "reencoded_tokens",
            "Of those, tokens encoded again because a weight swap dropped "
            "their keys/values (actor.kv_on_weight_swap: reencode).",
        ),
    )
}
PERMIT_RETRY_S = 0.5  # while episodes or sessions are in flight, ask for permits at most this often
IDLE_S = 0.05  # with nothing to play (no weights yet, a version to fetch): look again after this


def actor_id(cfg: Config) -> str:
    return (
        cfg.actor.id
        or os.environ.get("ASYNCPPO_ACTOR_ID")
        or f"{socket.gethostname()}-{os.getpid()}"
    )


class Actor:
    def __init__(self, cfg: Config, health: Health | None = None):
        self.cfg, ac = cfg, cfg.actor
        self.health = health or Health()
        self.id = actor_id(cfg)
        if ac.torch_threads:
            torch.set_num_threads(ac.torch_threads)
        self.engine = engine_for(cfg, cfg.model.path)
        self.engine.version = -1  # the local checkpoint is not a published version: fetch one
        fmt = ChatFormat(load_tokenizer(cfg.model.path))
        self.server: AgentServer | None = None
        self.driver: Driver
        if ac.mode == "agent":
            model = ac.agent_model or Path(cfg.model.path).name
            self.server = AgentServer(
                ac.agent_host,
                ac.agent_port,
                model=model,
                request_timeout_s=ac.agent_request_timeout_s,
            )
            self.driver = AgentDriver(
                self.engine,
                fmt,
                self.server.calls,
                address=self.server.address,
                model=model,
                actor_id=self.id,
                temperature=ac.temperature,
                max_tokens=ac.agent_max_tokens,
                session_timeout_s=ac.agent_session_timeout_s,
                request_timeout_s=ac.agent_request_timeout_s,
            )
            log.info("agent API serving", address=self.server.address, model=model)
        else:
            self.driver = EnvDriver(ac, self.engine, fmt, self.id)
        self.link = BrokerLink(
            cfg, self.id, self.health, version=lambda: self.engine.version,
            held=self.driver.held_permits,
        )  # fmt: skip
        self.refused = -1  # the newest version the engine refused: not fetched again
        self._held_since: float | None = None  # since when rollouts wait for a version
        self._next_permits = 0.0  # after a WAIT while busy: when to ask again
        self._engine_counted: dict[str, int] = {}  # engine counters already in M_ENGINE
        log.info(
            "actor starting",
            actor_id=self.id,
            broker=ac.broker,
            engine=ac.engine,
            mode=ac.mode,
            env=ac.env,
            max_inflight_episodes=ac.max_inflight_episodes,
        )

    # ------------------------------------------------------------- versions
    def behind(self) -> bool:
        """Whether the broker has a version newer than the engine's that was not refused."""
        return self.link.latest > max(self.engine.version, self.refused)

    def refused_latest(self) -> bool:
        """Whether the broker's latest version is one this engine refused: once its own version
        is too old to play (docs/protocol.md §7), no permit can be had until a newer version it
        can load."""
        return 0 <= self.link.latest <= self.refused

    def playable(self) -> bool:
        """Whether the engine's version may start episodes (docs/protocol.md §7): the latest,
        or with η ≥ 2 one of the η − 1 before it, so the actor plays on while it fetches."""
        return self.link.latest - self.engine.version <= max(self.link.max_staleness - 1, 0)

    def follow_versions(self) -> None:
        """Swap in a version whose download finished (between engine steps, so also in the
        middle of a turn); start fetching a newer one the broker announced. The download runs in
        the link's thread while the actor plays on."""
        weights = self.link.weights
        done = weights.take()
        if done is not None:
            self._load(done)
        if self.behind() and not weights.busy():
            manifest = weights.newest()
            if manifest is not None and manifest["version"] > max(
                self.engine.version, self.refused
            ):
                weights.start(manifest)

    def sync_weights(self, timeout_s: float = 60.0) -> None:
        """Fetch the newest version and load it now (what the loop does over several turns)."""
        self.follow_versions()
        deadline = time.monotonic() + timeout_s
        while self.link.weights.busy() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.follow_versions()

    def _load(self, pieces: Pieces) -> None:
        """Load a complete version, every tensor's sha256 checked first. A version the engine
        cannot take is logged, counted and skipped: the actor keeps its own."""
        manifest, started = pieces.manifest, self.link.weights.started_at
        t0 = time.monotonic()
        tensors = pieces.tensors()
        t1 = time.monotonic()
        try:
            self.engine.load_version(manifest, tensors, self.cfg.actor.weight_noise_std)
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
        now = time.monotonic()
        M_FIRST_BYTE.observe(pieces.first_at - started)
        M_TRANSFER.observe(pieces.done_at - started)
        M_VERIFY.observe(t1 - t0)
        M_LOAD.observe(now - t1)
        M_SYNC.observe(now - started)
        held = 0.0  # seconds rollouts waited for this version
        if self._held_since is not None:
            held, self._held_since = now - self._held_since, None
            M_PAUSE.observe(held)
        M_VERSION.set(manifest["version"])
        bind_version(manifest["version"])
        log.info(
            "weights loaded",
            version=manifest["version"],
            bytes=manifest["total_bytes"],
            transfer_s=round(pieces.done_at - started, 3),
            load_s=round(now - t1, 3),
            rollouts_held_s=round(held, 3),
        )

    # -------------------------------------------------------------- permits
    def request_permits(self) -> list[dict]:
        """The permits the driver can use, in whole groups. A WAIT: fetch the weights it asks
        for; or, when not parked (the driver has work meanwhile), ask again only after
        PERMIT_RETRY_S; or sleep as the broker says."""
        wants = self.driver.wants()
        if wants.n < 1 or time.monotonic() < self._next_permits:
            return []
        reply = self.link.permits(wants.n, wants.group, self.engine.version, wait=wants.wait)
        if reply.kind == "PERMITS":
            return reply.header["permits"]
        if reply.header["reason"] == "stale_weights":  # the fetch is under way: ask later
            self._next_permits = time.monotonic() + PERMIT_RETRY_S
        elif not wants.wait:
            self._next_permits = time.monotonic() + max(
                PERMIT_RETRY_S, reply.header["retry_after_s"]
            )
        else:
            self.health.beat(f"permits ({reply.header['reason']})")
            time.sleep(reply.header["retry_after_s"])
        return []

    # ----------------------------------------------------------------- loop
    def run(self, should_stop: Callable[[], bool]) -> None:
        self.link.should_stop = should_stop
        try:
            self.link.register()
            while not should_stop():
                self.turn()
        except TransportError as exc:
            if exc.code != "interrupted":
                raise
            log.info("stopping: a request to the broker was abandoned", error=str(exc))
        finally:
            self.close()

    def turn(self) -> None:
        """One pass of the loop: versions, permits, one driver step, its outcome."""
        self.follow_versions()
        # Ready while it holds a version it can play, or will once its fetch completes; a
        # refused latest that leaves it nothing to play keeps it alive (its loop runs) but not
        # ready, and it asks for nothing until a newer version.
        stuck = self.refused_latest() and not self.playable()
        ready = self.health.ready = self.engine.version >= 0 and not stuck
        can_ask = ready and self.playable()
        if can_ask:
            self.absorb(self.driver.start(self.request_permits()))
        elif ready and self.driver.wants().n and self._held_since is None:
            self._held_since = time.monotonic()  # rollouts wait for the version being fetched
        if not len(self.driver) and self.server is None:
            self.health.beat(self._idle_reason())  # nothing to play: look again shortly
            time.sleep(IDLE_S)
            return
        self.health.beat(
            "generating" if len(self.driver) else "serving" if self.server else "permits"
        )
        self.absorb(self.driver.step())
        self._count_engine()
        M_INFLIGHT.set(len(self.driver))
        M_KV_BYTES.set(self.engine.kv_cache_bytes())

    def absorb(self, outcome: Outcome) -> None:
        """Send what the driver produced, tell it the broker's verdict, count what ended; free
        the permits it let go of (HELLO names those still held)."""
        M_TOKENS.inc(outcome.tokens)
        for seg in outcome.segments:
            lost = self.link.add(seg)
            if lost:
                M_LOST.labels(reason=lost).inc()
            else:
                M_SEGMENTS.inc()
            self.driver.delivered(seg, accepted=not lost)
        for ended in outcome.ended:
            M_EPISODES.inc()
            M_REWARD.observe(ended.reward)
            M_HACKS.inc(ended.hacks)
        for during in outcome.failures:
            M_ENV_ERRORS.labels(during=during).inc()
        if outcome.released:
            self.link.hello()

    def _count_engine(self) -> None:
        """Advance the engine counters to what the engine has run so far."""
        for name, counter in M_ENGINE.items():
            ran = getattr(self.engine, name)
            counter.inc(ran - self._engine_counted.get(name, 0))
            self._engine_counted[name] = ran

    def _idle_reason(self) -> str:
        if self.refused_latest():
            return f"waiting for a version this engine can load (it refused v{self.refused})"
        if self.link.weights.busy():
            return f"fetching version {self.link.weights.downloading.version}"
        if self.engine.version < 0:
            return "waiting for weights"
        return "waiting for permits"

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.driver.close()
        self.link.close()
        log.info("actor stopped", actor_id=self.id)
