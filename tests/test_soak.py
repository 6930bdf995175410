"""A short version of bench/soak.py: real `asyncppo up`, sampled as the hour-long soak samples it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, free_port

ROLES = {"broker", "learner", "actor-0", "actor-1"}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_short_soak_reports_memory_and_throughput_of_every_role(tmp_path, tiny_model):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    overrides = {
        "model.path": tiny_model,
        "run.out_dir": tmp_path / "run",
        "run.num_actors": 2,
        "run.metrics_base_port": 0,
        "broker.bind": endpoint,
        "actor.broker": endpoint,
        "learner.broker": endpoint,
    }
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.soak",
            "--minutes",
            "1.5",
            "--interval",
            "3",
            "--warmup-fraction",
            "0.5",
            "--config",
            "configs/smoke.yaml",
            "--out",
            str(out),
            *(a for k, v in overrides.items() for a in ("--set", f"{k}={v}")),
        ],
        cwd=ROOT,
        check=True,
        timeout=360,
    )
    report = json.loads(out.read_text())
    samples = report["samples"]
    assert len(samples) >= 15 and samples[-1]["t"] >= 80
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    started = [s for s in samples if set(s["rss_bytes"]) == ROLES]
    assert len(started) >= len(samples) - 5  # every role sampled from its start to the end
    # a role sampled the instant it was spawned is a bare interpreter (~10 MB); once training
    # runs, every role has imported torch
    for s in (s for s in started if s["learner_steps"] > 0):
        assert all(10 << 20 < b < 4 << 30 for b in s["rss_bytes"].values()), s["rss_bytes"]
    for key in ("learner_steps", "tokens_trained", "accepted", "policy_version"):
        series = [s[key] for s in samples]
        assert series == sorted(series) and series[-1] > series[0], key
    assert any(s["tokens_per_s"] > 0 for s in samples) and any(
        s["accepted_per_s"] > 0 for s in samples
    )

    summary = report["summary"]
    assert set(summary["roles"]) == ROLES
    assert (
        summary["tokens_per_s"] > 0
        and summary["accepted_per_s"] > 0
        and summary["steps_per_min"] > 0
    )
    for role, r in summary["roles"].items():  # no role more than doubles after the warm-up
        assert r["rss_last_bytes"] < 2 * r["rss_after_warmup_bytes"], (role, r)
    assert summary["tokens_per_s"] == pytest.approx(
        (
            samples[-1]["tokens_trained"]
            - next(s for s in samples if s["t"] >= summary["window_s"][0])["tokens_trained"]
        )
        / (summary["window_s"][1] - summary["window_s"][0])
    )
