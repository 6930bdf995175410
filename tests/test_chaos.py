"""Chaos during one training run, with real processes and real signals.

While broker, learner and actors train, the test kills an actor with SIGKILL and adds another,
kills the broker with SIGKILL and starts it again with the same command (``broker.spool_dir``
makes it durable), kills the learner with SIGKILL and starts it with ``--resume``, and removes an
actor with SIGTERM. Afterwards the books must balance, nothing may be trained twice or in part,
versions may only go up, and training must have gone on after every blow.

Each actor keeps its Prometheus counters in its own ``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client
then writes them to memory-mapped files), so what a SIGKILLed actor had been acknowledged is still
readable after its death.
"""

from __future__ import annotations

import signal
import threading
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from conftest import free_port
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from test_roles import stats, steps_of, wait_for

BATCH = 4  # episodes per learner step
MAX_TURNS = 4  # maze turns per episode; the context budget cuts 4 turns into 2 segments

# About 2-4 minutes: a broker restart can cost the learner one request timeout (60 s).
pytestmark = pytest.mark.slow


def settings(tmp_path: Path, tiny_model: Path, endpoint: str) -> list[str]:
    """Multi-turn maze episodes of 1-2 segments; a silent actor is presumed dead after 10 s."""
    pairs = {
        "model.path": tiny_model,
        "run.out_dir": tmp_path,
        "broker.bind": endpoint,
        "actor.broker": endpoint,
        "learner.broker": endpoint,
        "broker.spool_dir": tmp_path / "spool",
        "broker.heartbeat_timeout_s": 10,
        "broker.max_staleness": 1,
        "learner.batch_size": BATCH,
        "learner.total_steps": 0,
        "learner.checkpoint_every": 1,
        "actor.env": "maze",
        "actor.env_kwargs": f"{{max_turns: {MAX_TURNS}}}",
        "actor.max_turns": MAX_TURNS,
        "actor.context_budget_tokens": 260,
        "actor.permits_per_request": 2,
    }
    return ["--config", "configs/smoke.yaml"] + [
        a for k, v in pairs.items() for a in ("--set", f"{k}={v}")
    ]


def actor_counters(metrics_dir: Path) -> Counter[tuple[str, str]]:
    """(counter, reason label) -> value of one actor, from its multiprocess files (they outlive it)."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(metrics_dir))
    return Counter(
        {
            (s.name, s.labels.get("reason", "")): s.value
            for family in registry.collect()
            for s in family.samples
            if s.name.endswith("_total")
        }
    )


class StatsWatcher(threading.Thread):
    """Samples the broker's STATS twice a second: the versions it reports must never go back."""

    def __init__(self, endpoint: str):
        super().__init__(daemon=True)
        self.endpoint, self.samples, self.done = endpoint, [], threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            if s := stats(self.endpoint):
                self.samples.append(s)


@pytest.mark.timeout(900)
def test_training_survives_kills_restarts_and_scaling(tmp_path, tiny_model, procs):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    common = settings(tmp_path, tiny_model, endpoint)
    (tmp_path / "logs").mkdir()
    actors = {}

    def start(role: str, name: str, *extra: str, env: dict | None = None):
        return procs.start(
            [role, *common, *extra], tmp_path / "logs" / f"{name}.log", env=env or {}
        )

    def start_actor(name: str) -> None:
        metrics = tmp_path / "actor-metrics" / name
        metrics.mkdir(parents=True)
        actors[name] = start(
            "actor",
            name,
            "--set",
            f"actor.id={name}",
            env={"PROMETHEUS_MULTIPROC_DIR": str(metrics)},
        )

    def more_steps(n: int, what: str, *alive) -> None:
        target = len(steps_of(tmp_path)) + n
        wait_for(lambda: len(steps_of(tmp_path)) >= target, 240, what, alive)

    broker, learner = start("broker", "broker"), start("learner", "learner")
    start_actor("a0"), start_actor("a1")
    watcher = StatsWatcher(endpoint)
    watcher.start()
    more_steps(2, "two steps", broker, learner)

    actors["a0"].kill()  # mid-rollout: its permits are reclaimed, its unfinished episodes dropped
    actors["a0"].wait()
    start_actor("a2")
    wait_for(
        lambda: any("a2" in s["actors"] for s in steps_of(tmp_path)),
        240,
        "episodes of the added actor trained",
        [broker, learner],
    )

    before = stats(endpoint)
    broker.kill()
    broker.wait()
    broker = start("broker", "broker")
    wait_for(lambda: stats(endpoint), 60, "the restarted broker", [broker])
    restored = stats(endpoint)
    assert restored["policy_version"] == before["policy_version"]
    for key in ("accepted", "handed_out", "permits_granted"):
        assert restored[key] >= before[key], key  # counters survive a SIGKILL
    more_steps(2, "training after the broker restart", broker, learner)

    learner.kill()
    learner.wait()
    killed_at = len(steps_of(tmp_path))
    learner = start("learner", "learner", "--resume")
    more_steps(2, "training after the learner resumed", broker, learner)

    # Removed: it finishes its episodes, says BYE and exits.
    actors["a1"].send_signal(signal.SIGTERM)
    assert actors["a1"].wait(timeout=60) == 0
    more_steps(1, "training with the last actor", broker, learner, actors["a2"])

    learner.send_signal(signal.SIGTERM)
    assert learner.wait(timeout=60) == 0
    actors["a2"].send_signal(signal.SIGTERM)
    assert actors["a2"].wait(timeout=60) == 0
    watcher.done.set()
    watcher.join()
    final = stats(endpoint)
    broker.send_signal(signal.SIGTERM)
    assert broker.wait(timeout=30) == 0

    steps = steps_of(tmp_path)
    counters = sum(
        (actor_counters(tmp_path / "actor-metrics" / name) for name in actors), Counter()
    )
    sent = counters[("asyncppo_actor_segments_sent_total", "")]
    discarded = Counter(
        {
            reason: n
            for (name, reason), n in counters.items()
            if name == "asyncppo_actor_segments_discarded_total"
        }
    )
    # The spool holds exactly the accepted segments not yet handed out or dropped.
    queued = len(list((tmp_path / "spool" / "segments").glob("*.msgpack")))

    # Actors' books against the broker's (STATS counters survive the restart through the spool):
    # every acknowledged segment was accepted, give or take the one message in flight when a
    # process died (the killed actor's unread ACK, or a segment spooled just before the broker's
    # SIGKILL and acknowledged again as a duplicate after it).
    assert abs(final["accepted"] - sent) <= 1, (final, sent)
    # Every segment an actor was refused was rejected, and counted, under that reason.
    for reason, n in discarded.items():
        if reason != "stale":
            assert final[f"rejected_{reason}"] == n, (reason, final)
    # The broker's own books: every accepted segment was handed out, is still queued, or was
    # dropped by a rule (stale drops at arrival count the arriving, unaccepted segment too).
    dropped_after_accept = (
        final["dropped_incomplete_episode"] + final["dropped_stale"] - discarded["stale"]
    )
    assert final["accepted"] == final["handed_out"] + queued + dropped_after_accept, final

    # The learner's books: nothing trained twice; whole episodes only, each within one step;
    # what was handed out and not trained is at most the batch the SIGKILLed learner held.
    trained = [t for s in steps for t in s["traj_ids"]]
    assert len(trained) == len(set(trained)), "a segment was trained twice"
    assert sum(s["segments"] for s in steps) == len(trained)
    episodes: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for i, s in enumerate(steps):
        for traj_id in s["traj_ids"]:
            episode, segment = traj_id.rsplit(".", 1)
            episodes[episode].append((i, int(segment)))
    for episode, parts in episodes.items():
        assert len({i for i, _ in parts}) == 1, f"episode {episode} was split across steps"
        assert sorted(seg for _, seg in parts) == list(range(len(parts))), (
            f"episode {episode} is partial"
        )
    assert 0 <= final["handed_out"] - len(trained) <= BATCH * MAX_TURNS

    # Versions only go up: per step, on the broker, and for every actor; the resumed learner went on
    # from its checkpoint (its first step repeats at most the one the SIGKILL interrupted).
    versions = [s["version"] for s in steps]
    assert versions == sorted(set(versions))
    assert final["policy_version"] == versions[-1] + 1
    assert steps[killed_at]["step"] in (
        steps[killed_at - 1]["step"],
        steps[killed_at - 1]["step"] + 1,
    )
    seen = watcher.samples
    assert [s["policy_version"] for s in seen] == sorted(s["policy_version"] for s in seen)
    for name in actors:
        mine = [s["actor_versions"][name] for s in seen if name in s["actor_versions"]]
        assert mine and mine == sorted(mine), name
    assert {"a0", "a1", "a2"} <= {a for s in steps for a in s["actors"]}
