"""Evaluation pinned to a policy version, on held-out instances no training episode can draw.

Training episodes take seeds with bit 31 clear (``actors.envs.base.train_seed``); held-out
instances are seeds with bit 31 set, so the two sets are disjoint by construction. Where an
environment reports an instance's horizon (``env.horizon`` after ``reset``: the turns the instance
needs), the held-out set is stratified: the same number of instances in every horizon bucket
(``eval.horizon_buckets``), so a score is not decided by how many long instances the draw held.

The episodes are played exactly as an actor plays them (``actors.play.play``: continuous
batching, the actor's temperature, compaction), but their segments go nowhere: evaluation never
reaches the learner. Success is ``info["success"]`` where the environment reports it, else reward > 0; each
rate comes with a 95% Wilson interval, each mean reward with a normal 95% interval.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import Counter, Gauge

from actors.chat import ChatFormat
from actors.engines import Engine
from actors.envs import make_env
from actors.envs.base import HELD_OUT
from actors.episode import Episode
from actors.link import WeightsClient, broker_client
from actors.play import play
from common.config import Config
from common.log import bind_version
from common.metrics import Health
from common.pieces import Pieces
from common.protocol import Message
from common.retry import call_with_retry
from common.transport import TransportError

log = structlog.get_logger()

M_SUCCESS = Gauge(
    "asyncppo_eval_success",
    "Held-out success rate of the last evaluated version, overall (bucket=all) and per horizon.",
    ["bucket"],
)
M_REWARD = Gauge(
    "asyncppo_eval_reward_mean",
    "Held-out mean episode reward of the last evaluated version.",
    ["bucket"],
)
M_VERSION = Gauge(
    "asyncppo_eval_policy_version", "Policy version of the last evaluation (-1: none yet)."
)
M_VERSION.set(-1)
M_RUNS = Counter("asyncppo_eval_runs_total", "Evaluations finished.")

Z95 = 1.959963984540054


def bucket_name(horizon: int | None, edges: list[int]) -> str:
    """``"2-5"``, ``"6-15"``, … for upper edges [5, 15, …]; ``"all"`` without a horizon, and
    ``">50"`` beyond the last edge."""
    if horizon is None:
        return "all"
    low = 1
    for edge in edges:
        if horizon <= edge:
            return f"{low}-{edge}"
        low = edge + 1
    return f">{edges[-1]}"


def held_out_instances(cfg: Config, n: int) -> list[tuple[int, int | None]]:
    """``n`` held-out (seed, horizon) pairs, the first seeds from HELD_OUT on that fill every
    horizon bucket equally (the remainder to the shortest buckets); unstratified when the
    environment reports no horizon."""
    env = make_env(cfg.actor.env, **cfg.actor.env_kwargs)
    edges = cfg.eval.horizon_buckets
    env.reset(HELD_OUT)
    if getattr(env, "horizon", None) is None:
        return [(HELD_OUT + i, None) for i in range(n)]
    names = [bucket_name(e, edges) for e in edges]
    quota = {name: n // len(names) + (i < n % len(names)) for i, name in enumerate(names)}
    chosen: list[tuple[int, int | None]] = []
    for i in range(200 * n):  # every bucket is reachable for the built-in environments
        env.reset(HELD_OUT + i)
        name = bucket_name(env.horizon, edges)
        if quota.get(name, 0) > 0:
            quota[name] -= 1
            chosen.append((HELD_OUT + i, env.horizon))
            if len(chosen) == n:
                return chosen
    short = {k: v for k, v in quota.items() if v}
    raise ValueError(
        f"eval: {cfg.actor.env} gave too few held-out instances for horizon buckets {short} "
        f"(eval.horizon_buckets={edges}); choose buckets its horizons fill"
    )


def wilson(successes: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a rate: honest at 0 and 1, unlike the normal one."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / (1 + Z95**2 / n)
    # At 0 or n successes the bound is exactly 0 or 1; the formula gives it up to rounding.
    low = 0.0 if successes == 0 else centre - half
    high = 1.0 if successes == n else centre + half
    return low, high


def score(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Success rate and mean reward of some episodes, with 95% intervals."""
    n = len(records)
    wins = sum(bool(r["success"]) for r in records)
    rewards = [float(r["reward"]) for r in records]
    mean = sum(rewards) / n if n else 0.0
    sd = math.sqrt(sum((x - mean) ** 2 for x in rewards) / (n - 1)) if n > 1 else 0.0
    half = Z95 * sd / math.sqrt(n) if n else 0.0
    return {
        "episodes": n,
        "success": wins / n if n else 0.0,
        "success_ci95": list(wilson(wins, n)),
        "reward": mean,
        "reward_ci95": [mean - half, mean + half],
    }


@dataclass
class Played:
    seed: int
    horizon: int | None
    # What the environment's info said before each turn (before the first: nothing): the state
    # a critic's value is scored against (``learner.critic_eval``).
    states: list[tuple] = field(default_factory=lambda: [()])


def state_of(info: dict[str, Any]) -> tuple:
    """An episode's progress as its environment reports it, hashable: the scalar info fields
    but the outcome."""
    return tuple(
        sorted(
            (k, v)
            for k, v in info.items()
            if k != "success" and isinstance(v, (int, float, str, bool))
        )
    )


def evaluate(
    cfg: Config,
    engine: Engine,
    fmt: ChatFormat,
    instances: list[tuple[int, int | None]],
    *,
    beat: Callable[[str], None] = lambda what: None,
    on_episode: Callable[[Played, Episode], None] = lambda played, ep: None,
    should_stop: Callable[[], bool] = lambda: False,
) -> dict[str, Any] | None:
    """Play every held-out instance once with the engine's current weights; the scores overall
    and per horizon bucket, and one record per episode. ``on_episode`` sees every episode that
    ended without an error, with the states it passed through. None when ``should_stop()``
    ended it early (a partial score would mislead)."""
    t0 = time.monotonic()
    played = [Played(seed, horizon) for seed, horizon in instances]
    records: list[dict[str, Any]] = []

    def turned(i: int, ep: Episode) -> None:
        played[i].states.append(state_of(ep.info))

    def ended(i: int, ep: Episode | None, error: str | None) -> None:
        reward = ep.reward if ep is not None else 0.0
        records.append(
            {
                "seed": played[i].seed,
                "horizon": played[i].horizon,
                "bucket": bucket_name(played[i].horizon, cfg.eval.horizon_buckets),
                "reward": reward,
                "success": error is None and bool(ep.info.get("success", reward > 0)),
                "turns": ep.turns if ep is not None else 0,
                "segments": len(ep.segments) if ep is not None else 0,
                "error": error,
            }
        )
        if error is None:
            on_episode(played[i], ep)

    seeds = [seed for seed, _ in instances]
    tokens = play(
        cfg.actor, engine, fmt, seeds, on_turn=turned, on_end=ended, should_stop=should_stop,
        beat=lambda what: beat("evaluating"), sampling_seed=cfg.eval.sampling_seed,
    )  # fmt: skip
    if tokens is None:
        return None
    edges = cfg.eval.horizon_buckets
    order = [bucket_name(e, edges) for e in edges] + [f">{edges[-1]}", "all"]
    buckets = [b for b in order if any(r["bucket"] == b for r in records)]
    return {
        "version": engine.version,
        "env": cfg.actor.env,
        **score(records),
        "buckets": {b: score([r for r in records if r["bucket"] == b]) for b in buckets},
        "generated_tokens": tokens,
        "seconds": round(time.monotonic() - t0, 3),
        "records": sorted(records, key=lambda r: r["seed"]),
    }


def summary_line(result: dict[str, Any]) -> dict[str, Any]:
    """What the eval log keeps of an evaluation: everything but the per-episode records."""
    return {k: v for k, v in result.items() if k != "records"} | {"time": time.time()}


def eval_client(
    cfg: Config, should_stop: Callable[[], bool] = lambda: False, health: Health | None = None
) -> WeightsClient:
    """WEIGHTS_INFO/GET on a connection of its own, which needs no HELLO: the evaluator is not
    an actor the broker counts, so it holds no lease a long evaluation could lose. With
    ``health``, WEIGHTS_INFO is retried through broker restarts (reported there)."""
    client = broker_client(cfg, f"eval-{os.getpid()}", should_stop)

    def info() -> Message:
        if health is None:
            return client.request("WEIGHTS_INFO")
        return call_with_retry(
            lambda: client.request("WEIGHTS_INFO"),
            what="WEIGHTS_INFO",
            health=health,
            should_stop=should_stop,
        )

    return WeightsClient(cfg, client, info, should_stop=should_stop)


def fetch_version(cfg: Config, engine: Engine) -> bool:
    """Load the broker's newest version into ``engine``; False when the broker holds none."""
    weights = eval_client(cfg)
    try:
        fetched = weights.fetch_newer(-1)
    finally:
        weights.client.close()
    if fetched is not None:
        engine.load_version(*fetched)
    return fetched is not None


def follow(
    cfg: Config,
    engine: Engine,
    fmt: ChatFormat,
    health: Health,
    should_stop: Callable[[], bool],
    out: Path,
    finishing: Callable[[], bool] = lambda: False,
) -> None:
    """An actor in eval mode (``asyncppo eval --follow``): every ``eval.every_versions``-th
    version the broker publishes (the newest one when it falls behind) is fetched, played on the
    held-out set and appended to ``out`` (JSON lines) and the ``asyncppo_eval_*`` gauges. It
    takes no permits and sends nothing: the learner never sees these episodes.

    Once ``finishing()`` (training is over) it scores the newest version if it has not yet, due
    or not, and returns: a run's final policy is always evaluated."""
    weights = eval_client(cfg, should_stop, health)
    instances = held_out_instances(cfg, cfg.eval.episodes)
    every, last = max(cfg.eval.every_versions, 1), None
    health.ready = True
    try:
        while not should_stop():
            try:
                manifest = weights.newest()
            except TransportError:
                continue  # stopping
            newest = manifest["version"] if manifest is not None else -1
            final = finishing()
            due = newest >= 0 and (last is None or newest >= last + (1 if final else every))
            pieces = weights.download(Pieces(manifest)) if due and newest > engine.version else None
            if pieces is None:
                if final:
                    return  # the newest version is scored
                health.beat("waiting for a version to evaluate")
                time.sleep(0.5)
                continue
            try:
                engine.load_version(manifest, pieces.tensors())
            except ValueError as exc:  # an adapter for another base model, ...: the next one
                log.error("weights refused", version=newest, error=str(exc))
                last = newest
                continue
            bind_version(engine.version)
            if not score_version(cfg, engine, fmt, instances, out, health, should_stop):
                return  # stopped in the middle: nothing to report
            last = engine.version
    finally:
        weights.client.close()


def score_version(
    cfg: Config,
    engine: Engine,
    fmt: ChatFormat,
    instances: list[tuple[int, int | None]],
    out: Path,
    health: Health,
    should_stop: Callable[[], bool],
) -> bool:
    """Evaluate the engine's version, append the result to ``out`` and the gauges; False when
    ``should_stop()`` interrupted it (nothing is reported)."""
    result = evaluate(cfg, engine, fmt, instances, beat=health.beat, should_stop=should_stop)
    if result is None:
        return False
    with out.open("a") as f:
        f.write(json.dumps(summary_line(result)) + "\n")
    record_metrics(result)
    log.info(
        "evaluated",
        version=engine.version,
        success=round(result["success"], 4),
        ci95=[round(x, 4) for x in result["success_ci95"]],
        episodes=result["episodes"],
        seconds=result["seconds"],
    )
    return True


def record_metrics(result: dict[str, Any]) -> None:
    M_RUNS.inc()
    M_VERSION.set(result["version"])
    for bucket, scores in {"all": result, **result["buckets"]}.items():
        M_SUCCESS.labels(bucket=bucket).set(scores["success"])
        M_REWARD.labels(bucket=bucket).set(scores["reward"])
