"""Evaluation pinned to versions: held-out instances disjoint from training, stratified by horizon,
scored with intervals; `asyncppo eval` on a model directory, and an evaluator beside a real run."""

from __future__ import annotations

import contextlib
import json
import signal
import time
import urllib.request

import pytest
from conftest import free_port, smoke_args

from actors.chat import ChatFormat
from actors.engines import TorchEngine
from actors.envs import make_env
from actors.envs.base import HELD_OUT, train_seed
from actors.evaluation import bucket_name, held_out_instances, wilson
from actors.play import play
from common.config import ConfigError, load_config
from deploy.cli import main


def test_training_seeds_never_draw_a_held_out_instance():
    seeds = [train_seed(f"0/actor-{a}/{i}") for a in range(4) for i in range(2000)]
    assert max(seeds) < HELD_OUT and len(set(seeds)) > 7900  # spread over the training half
    cfg = load_config(None, ["actor.env=maze", "eval.horizon_buckets=[5, 15, 50]"])
    held_out = [seed for seed, _ in held_out_instances(cfg, 30)]
    assert min(held_out) >= HELD_OUT and len(set(held_out)) == 30


def test_the_held_out_set_fills_every_horizon_bucket_equally():
    cfg = load_config(None, ["actor.env=maze", "eval.horizon_buckets=[5, 15, 50]"])
    instances = held_out_instances(cfg, 14)
    env = make_env("maze")
    counts: dict[str, int] = {}
    for seed, horizon in instances:
        env.reset(seed)
        assert env.horizon == horizon  # the horizon is the instance's, not a label
        counts[bucket_name(horizon, [5, 15, 50])] = (
            counts.get(bucket_name(horizon, [5, 15, 50]), 0) + 1
        )
    assert counts == {"1-5": 5, "6-15": 5, "16-50": 4}
    # Without a horizon (digits) the set is simply the first held-out seeds.
    plain = held_out_instances(load_config(None, ["actor.env=digits"]), 3)
    assert plain == [(HELD_OUT, None), (HELD_OUT + 1, None), (HELD_OUT + 2, None)]


def test_buckets_that_the_environment_cannot_fill_are_a_clear_error():
    cfg = load_config(None, ["actor.env=maze", "eval.horizon_buckets=[1, 2]"])
    with pytest.raises(ValueError, match="too few held-out instances"):
        held_out_instances(cfg, 4)
    with pytest.raises(ConfigError, match="eval.horizon_buckets"):
        load_config(None, ["eval.horizon_buckets=[5, 5]"])


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    [
        (0, 10, 0.0, 0.2775),
        (5, 10, 0.2366, 0.7634),
        (10, 10, 0.7225, 1.0),
        (30, 100, 0.2189, 0.3958),
    ],
)
def test_wilson_interval_matches_published_values(k, n, low, high):
    lo, hi = wilson(k, n)
    assert (lo, hi) == pytest.approx((low, high), abs=1e-4)


def test_eval_command_scores_a_model_directory_on_held_out_instances(tmp_path, tiny_model, capfd):
    out = tmp_path / "eval.json"
    code = main(
        [
            "eval",
            "--set",
            f"model.path={tiny_model}",
            "--set",
            "actor.env=maze",
            "--set",
            "actor.env_kwargs={max_turns: 12}",
            "--set",
            "actor.max_turns=12",
            "--set",
            "eval.episodes=6",
            "--set",
            "eval.horizon_buckets=[4, 12]",
            "--set",
            f"run.out_dir={tmp_path / 'run'}",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["episodes"] == 6 and result["version"] is None
    assert all(r["seed"] >= HELD_OUT for r in result["records"])
    assert {b: s["episodes"] for b, s in result["buckets"].items()} == {"1-4": 3, "5-12": 3}
    lo, hi = result["success_ci95"]
    assert lo <= result["success"] <= hi
    assert all(r["turns"] >= 1 and r["error"] is None for r in result["records"])
    assert "held-out maze instances" in capfd.readouterr().out


def test_a_sampling_seed_deals_every_policy_the_same_draws(tiny_model):
    """``eval.sampling_seed``: turn t of the i-th instance samples with a seed of (seed, i, t),
    so playing the list again replays every episode token for token, another seed plays others,
    and the same instance at another position of the list is dealt other draws."""
    cfg = load_config(None, [f"model.path={tiny_model}", "actor.env=maze",
                             "actor.env_kwargs={max_turns: 6}", "actor.max_turns=6"])  # fmt: skip
    engine = TorchEngine(str(tiny_model))
    fmt, seeds = ChatFormat(engine.tokenizer), [HELD_OUT + 1, HELD_OUT + 2, HELD_OUT + 1]

    def played(sampling_seed: int) -> list[list[int]]:
        got: dict[int, list[int]] = {}

        def ended(i, episode, error) -> None:
            got[i] = [t for segment in episode.segments for t in segment.tokens.tolist()]

        play(cfg.actor, engine, fmt, seeds, on_end=ended, sampling_seed=sampling_seed)
        return [got[i] for i in range(len(seeds))]

    first = played(7)
    assert played(7) == first
    assert played(8) != first
    assert first[0] != first[2]


@pytest.mark.system
def test_a_run_that_completes_its_steps_scores_its_final_version(tmp_path, tiny_model, procs):
    """4 steps, an evaluation due only every 100 versions: the first version is scored while
    training runs, and the final one (4) only because the learner completed."""
    proc_args = smoke_args(
        tmp_path,
        tiny_model,
        free_port(),
        *("--set", "eval.every_versions=100", "--set", "eval.episodes=4"),
        *("--summary", str(tmp_path / "summary.json")),
    )
    proc = procs.start(proc_args, tmp_path / "up.log")
    assert proc.wait(timeout=240) == 0, (tmp_path / "up.log").read_text()[-3000:]
    evals = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    versions = [e["version"] for e in evals]
    assert versions[-1] == 4 and len(versions) <= 2, versions
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["policy_version"] == 4 and summary["eval"][-1]["version"] == 4


@pytest.mark.system
def test_an_evaluator_beside_training_scores_published_versions(tmp_path, tiny_model, procs):
    metrics = free_port()
    proc_args = smoke_args(
        tmp_path,
        tiny_model,
        free_port(),
        "--set",
        "learner.total_steps=0",
        "--set",
        "eval.every_versions=2",
        "--set",
        "eval.episodes=8",
        "--set",
        f"run.metrics_base_port={metrics}",
        "--summary",
        str(tmp_path / "summary.json"),
    )
    proc = procs.start(proc_args, tmp_path / "up.log")
    evals_path, scraped = tmp_path / "run" / "eval.jsonl", ""
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
        lines = evals_path.read_text().splitlines() if evals_path.exists() else []
        with contextlib.suppress(OSError):
            scraped = (
                urllib.request.urlopen(f"http://127.0.0.1:{metrics + 2}/metrics", timeout=2)
                .read()
                .decode()
            )
        if len(lines) >= 2 and "asyncppo_eval_success{" in scraped:
            break
        time.sleep(1)
    # One evaluation of whatever the running broker holds now, from outside the run.
    live = tmp_path / "live.json"
    broker = next(a.split("=", 1)[1] for a in proc_args if a.startswith("actor.broker="))
    assert (
        main(
            [
                "eval",
                "--config",
                "configs/smoke.yaml",
                "--set",
                f"actor.broker={broker}",
                "--set",
                f"model.path={tiny_model}",
                "--set",
                "eval.episodes=4",
                "--set",
                f"run.out_dir={tmp_path / 'live'}",
                "--broker",
                "--out",
                str(live),
            ]
        )
        == 0
    )
    assert json.loads(live.read_text())["version"] >= 0  # a published version, not the local model
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=90) == 0, (tmp_path / "up.log").read_text()[-3000:]
    evals = [json.loads(line) for line in evals_path.read_text().splitlines()]
    assert len(evals) >= 2, (tmp_path / "run" / "logs" / "eval.log").read_text()[-3000:]
    versions = [e["version"] for e in evals]
    assert all(b - a >= 2 for a, b in zip(versions, versions[1:], strict=False))
    assert all(e["episodes"] == 8 and e["env"] == "digits" for e in evals)
    assert 'asyncppo_eval_success{bucket="all"}' in scraped
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [e["version"] for e in summary["eval"]] == [versions[0], versions[-1]]
    # `asyncppo plot` draws the run from the files the roles wrote.
    assert main(["plot", "--run-dir", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", "--run-dir", str(tmp_path / "nothing")]) == 2
    # The learner never trained on an evaluation episode: every trained episode is an actor's.
    steps = (tmp_path / "run" / "learner_steps.jsonl").read_text().splitlines()
    assert {a for line in steps for a in json.loads(line)["actors"]} <= {"actor-0", "actor-1"}
