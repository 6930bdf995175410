"""The actor process: take permits, play episodes in batches, stream segments, follow new weights.

It never waits for the learner: permits are granted by the broker, weights are pulled when the
broker announces a newer version (between turns, and every ``poll_every_tokens`` during a
generation), and a broker restart is survived by reconnecting and saying HELLO again.
"""

from __future__ import annotations

import os
import socket
import time
import zlib
from collections.abc import Callable

import structlog
from prometheus_client import Counter, Gauge, Histogram

from actors.engines import SamplingParams, make_engine
from actors.envs import make_env
from actors.episode import ChatFormat, Episode
from actors.link import BrokerLink
from common.config import Config
from common.log import bind_version
from common.metrics import Health
from common.model import load_tokenizer
from common.trajectory import Segment

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
M_VERSION = Gauge("asyncppo_actor_policy_version", "Policy version loaded in the engine.")
M_HACKS = Counter(
    "asyncppo_actor_hacks_intercepted_total", "Tool calls intercepted by the reward-hacking guard."
)


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
            cfg, self.id, self.health, lambda: (self.engine.version, [p["id"] for p in self.held])
        )
        dtype = {} if cfg.actor.engine_dtype == "auto" else {"dtype": cfg.actor.engine_dtype}
        self.engine = make_engine(
            cfg.actor.engine, cfg.model.path, poll_every=cfg.actor.poll_every_tokens, **dtype
        )
        self.fmt = ChatFormat(load_tokenizer(cfg.model.path))
        self.engine.version = -1  # the local checkpoint is not a published version: fetch one first
        self.held: list[dict] = []
        self.episodes_started = 0
        self._last_poll = 0.0
        log.info(
            "actor starting",
            actor_id=self.id,
            broker=cfg.actor.broker,
            engine=cfg.actor.engine,
            env=cfg.actor.env,
        )

    # ------------------------------------------------------------ broker calls
    def sync_weights(self) -> None:
        """Load the newest complete version if it is newer than the engine's."""
        t0 = time.monotonic()
        fetched = self.link.fetch_weights(self.engine.version)
        if fetched is None:
            return
        manifest, tensors = fetched
        self.engine.load_weights(manifest["version"], tensors)
        M_VERSION.set(manifest["version"])
        M_SYNC.observe(time.monotonic() - t0)
        bind_version(manifest["version"])
        log.info(
            "weights loaded",
            version=manifest["version"],
            bytes=manifest["total_bytes"],
            seconds=round(time.monotonic() - t0, 3),
        )

    def _poll(self) -> None:
        """Between turns and during generation: heartbeat (at least as often as WELCOME's
        ``heartbeat_s`` asks, at most every 0.5 s), and swap to a newer version if there is one."""
        now = time.monotonic()
        if now - self._last_poll < min(0.5, self.link.heartbeat_s):
            return
        self._last_poll = now
        self.link.call("HEARTBEAT", {"version": self.engine.version})
        self.health.beat("generating")
        if self.link.latest > self.engine.version:
            self.sync_weights()

    def request_permits(self) -> list[dict]:
        reply = self.link.call(
            "PERMITS_REQ",
            {
                "n": self.cfg.actor.permits_per_request,
                "version": self.engine.version,
                "group": self.cfg.actor.group_size,
            },
        )
        if reply.kind == "PERMITS":
            return reply.header["permits"]
        self.health.beat(f"permits ({reply.header['reason']})")
        if reply.header["reason"] == "stale_weights":
            self.sync_weights()
        else:
            time.sleep(reply.header["retry_after_s"])
        return []

    def send(self, seg: Segment) -> bool:
        """Stream one segment; False when the broker will never take this episode (stop playing it)."""
        lost = self.link.add(seg)
        if lost:
            M_LOST.labels(reason=lost).inc()
            return False
        M_SEGMENTS.inc()
        return True

    # --------------------------------------------------------------- rollouts
    def rollout(self, permits: list[dict]) -> None:
        """Play one episode per permit as a batch; send each segment as soon as it is finished."""
        group = self.cfg.actor.group_size
        episodes = []
        for i, permit in enumerate(permits):
            if i % group == 0:
                seed = zlib.crc32(
                    f"{self.cfg.actor.seed}/{self.id}/{self.episodes_started}".encode()
                )
                group_id = f"{self.id}.{self.episodes_started}" if group > 1 else None
            env = make_env(self.cfg.actor.env, **self.cfg.actor.env_kwargs)
            episodes.append(
                Episode(
                    env,
                    self.fmt,
                    seed=seed,
                    permit=permit["id"],
                    actor_id=self.id,
                    group_id=group_id,
                    max_turns=self.cfg.actor.max_turns,
                    context_budget=self.cfg.actor.context_budget_tokens,
                )
            )
            self.episodes_started += 1
        while active := [e for e in episodes if not e.done]:
            env = active[0].env
            params = SamplingParams(
                max_new_tokens=env.max_new_tokens,
                temperature=self.cfg.actor.temperature,
                top_p=self.cfg.actor.top_p,
                stop=list(env.stop),
                stop_token_ids=self.fmt.stop_token_ids,
            )
            gens = self.engine.generate(
                [e.context for e in active], params, poll_weights=self._poll
            )
            for ep, gen in zip(active, gens, strict=True):
                M_TOKENS.inc(len(gen.token_ids))
                if not all(self.send(seg) for seg in ep.step(gen)):
                    ep.done = True
                if ep.done:
                    self._finish(ep)
            self._poll()

    def _finish(self, ep: Episode) -> None:
        reward = sum(s.reward for s in ep.segments)
        M_EPISODES.inc()
        M_REWARD.observe(reward)
        M_HACKS.inc(int(ep.info.get("hacks_intercepted", 0)))
        self.held = [p for p in self.held if p["id"] != ep.permit]

    def run(self, should_stop: Callable[[], bool]) -> None:
        self.link.should_stop = should_stop
        self.link.register()
        self.health.ready = True
        try:
            while not should_stop():
                self.health.beat("permits")
                if self.link.latest > self.engine.version or self.engine.version < 0:
                    self.sync_weights()
                    if self.engine.version < 0:
                        time.sleep(0.2)
                        continue
                permits = self.request_permits()
                if permits:
                    self.held = list(permits)
                    self.rollout(permits)
        finally:
            self.close()

    def close(self) -> None:
        self.link.close()
        log.info("actor stopped", actor_id=self.id, episodes=self.episodes_started)
