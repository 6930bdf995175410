"""The quick setting of every experiment in bench/experiments/, on real `asyncppo up` runs.

Slow: each takes a few minutes on 2 cores. The outputs go to a temporary directory, so the
committed results in docs/results/ are never overwritten by a test run.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import deploy.warmup
from bench import experiments
from bench.experiments import asynchrony, ppo_vs_grpo, runs, stats, tasks
from common.model import load_tokenizer
from deploy.cli import main as cli_main
from deploy.warmup import RECIPES, demonstrations, warm_up

ROOT = Path(__file__).resolve().parents[1]


def run_quick(name: str, out: Path) -> dict:
    subprocess.run(
        [sys.executable, "-m", "bench.experiments", name, "--quick", "--out", str(out)],
        cwd=ROOT,
        check=True,
        timeout=1500,
    )
    report = json.loads((out / f"{name}_quick.json").read_text())
    png = (out / f"{name}_quick.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert report["experiment"] == name and report["setting"] == "quick"
    for run in report["runs"]:
        assert run["returncode"] == 0, run["name"]
        assert run["learner_steps"] >= 2, run["name"]
        assert len(run["episodes"]) == run["learner_steps"] == len(run["series"]["reward_mean"])
        assert run["episodes"] == sorted(run["episodes"])
        assert 0.0 <= run["final_reward"] <= 1.0
        assert run["summary"]["episodes_trained"] == run["episodes"][-1]
    return report


def test_pipeline_rates_count_only_time_outside_steps():
    steps = [
        {"time": 10.0, "step_seconds": 1.0, "tokens": 99, "episodes": 9},
        {"time": 13.0, "step_seconds": 1.0, "tokens": 30, "episodes": 3},
        {"time": 14.0, "step_seconds": 1.0, "tokens": 10, "episodes": 1},
    ]
    rates = stats.pipeline_rates(steps)
    assert rates["tokens_per_second"] == pytest.approx(40 / 4)
    assert rates["episodes_per_second"] == pytest.approx(4 / 4)
    assert rates["idle_fraction"] == pytest.approx((3 - 1 + 1 - 1) / 4)
    assert math.isnan(stats.pipeline_rates(steps[:1])["tokens_per_second"])


def maze_record(rewards: list[float], algorithm: str = "ppo") -> dict:
    """The fields of a run record that the sample-efficiency summary reads, 16 episodes a step."""
    return {
        "labels": {"task": "maze", "algorithm": algorithm},
        "learner_steps": len(rewards),
        "episodes": [16 * (i + 1) for i in range(len(rewards))],
        "series": {"reward_mean": rewards},
        "final_reward": rewards[-1],
    }


def test_episodes_to_reach_reads_the_seed_mean_smoothed_curve():
    fast, slow = maze_record([0.0, 1.0, 1.0, 1.0]), maze_record([0.0, 0.0, 0.0, 1.0])
    # seed mean [0, .5, .5, 1]; trailing mean over 2 steps [0, .25, .5, .75]
    assert stats.episodes_to_reach([fast, slow], 0.5, window=2) == 48
    assert stats.episodes_to_reach([fast], 0.5, window=2) == 32
    assert stats.episodes_to_reach([slow], 0.9, window=1) == 64
    assert stats.episodes_to_reach([slow], 1.1, window=1) is None
    assert stats.episodes_to_reach([], 0.5) is None


def test_sample_efficiency_is_episodes_to_90pct_of_grpos_gain_and_undefined_without_gain():
    grpo = [0.0] * 5 + [0.2, 0.4, 0.6, 0.8, 1.0] + [1.0] * 10
    ppo = [0.0] * 5 + [1.0] * 15  # reaches the level sooner
    summary = ppo_vs_grpo.summarize_ppo_vs_grpo([maze_record(ppo), maze_record(grpo, "grpo")])
    needed = summary["maze/episodes_to_90pct_of_grpo_gain"]
    assert needed["start"] == 0.0 and needed["level"] == pytest.approx(0.9)
    assert needed["ppo"] < needed["grpo"]
    assert summary["maze/sample_efficiency_ppo_over_grpo"] == needed["grpo"] / needed["ppo"]

    flat = ppo_vs_grpo.summarize_ppo_vs_grpo(
        [maze_record([0.5] * 20), maze_record([0.5] * 20, "grpo")]
    )
    assert flat["maze/sample_efficiency_ppo_over_grpo"].startswith("undefined")


def test_final_reward_and_smoothing():
    steps = [{"episode_rewards": [0.0] * 6}, {"episode_rewards": [1.0, 1.0]}]
    # the last quarter of 8 episodes: the last 2
    assert stats.final_reward(steps) == pytest.approx(1.0)
    assert stats.final_reward(steps, fraction=0.5) == pytest.approx(0.5)
    assert stats.smooth([0, 3, 6, 9], window=2).tolist() == [0, 1.5, 4.5, 7.5]


def test_held_out_at_episodes_reads_a_run_at_equal_samples_not_steps():
    """Version v was trained on episodes[v-1]; a score between two versions is interpolated."""
    run = {
        "episodes": [40, 80, 120, 160],  # 40 a step: more than a batch, as at η > 0
        "held_out_curve": [
            {"version": 0, "success": 0.2},
            {"version": 2, "success": 0.4},
            {"version": 4, "success": 0.8},
        ],  # fmt: skip
    }
    assert stats.held_out_at_episodes(run, 80) == pytest.approx(0.4)
    assert stats.held_out_at_episodes(run, 100) == pytest.approx(0.5)
    assert stats.held_out_at_episodes(run, 40) == pytest.approx(0.3)


def test_reaching_a_level_and_collapsing_read_the_held_out_curve():
    run = {
        "episodes": [32 * i for i in range(1, 41)],
        "held_out_curve": [
            {"version": v, "success": s}
            for v, s in [(0, 0.3), (10, 0.55), (20, 0.82), (30, 0.7), (40, 0.61)]
        ],  # fmt: skip
    }
    assert stats.held_out_reaches(run, 0.8) == 640  # version 20: 20 steps of 32
    assert stats.held_out_reaches(run, 0.5) == 320
    assert stats.held_out_reaches(run, 0.9) is None
    assert stats.collapsed(run)  # 0.82 -> 0.61, not recovered
    run["held_out_curve"][-1]["success"] = 0.75  # back within 0.2 of its best
    assert not stats.collapsed(run)


def test_reuse_runs_only_what_the_earlier_report_lacks(tmp_path, monkeypatch):
    """--reuse: adding seeds launches only the new seeds; a failed or changed run runs again."""
    overrides = {"x": 1}
    fields = (*runs.SERIES_KEYS, "episodes")

    def make_runs(quick: bool, seeds: int) -> list:
        return [runs.Run(f"r-s{s}", {"arm": "a"}, dict(overrides), s) for s in range(seeds)]

    def launch(run, name):
        launched.append(run.name)
        step = {k: 0.0 for k in fields} | {"episode_rewards": [1.0], "staleness_histogram": [1]}
        return runs.Result(run, {"episodes_trained": 1}, [step])

    fake = runs.Experiment(
        make_runs, lambda records: {"n": len(records)}, lambda records, axes: None, 1, 1, "c"
    )
    monkeypatch.setitem(experiments.EXPERIMENTS, "fake", fake)
    monkeypatch.setattr(experiments, "launch", launch)
    report_path = tmp_path / "fake.json"

    launched: list[str] = []
    experiments.run_experiment("fake", False, 2, tmp_path, None, reuse=True)
    assert launched == ["r-s0", "r-s1"]  # no report yet: everything runs

    report = json.loads(report_path.read_text())
    report["runs"][1]["returncode"] = 1  # a failed run is not reused
    report_path.write_text(json.dumps(report))
    launched.clear()
    experiments.run_experiment("fake", False, 3, tmp_path, None, reuse=True)
    assert launched == ["r-s1", "r-s2"]
    report = json.loads(report_path.read_text())
    assert report["reused_runs"] == ["r-s0"] and report["summary"] == {"n": 3}
    assert [r["name"] for r in report["runs"]] == ["r-s0", "r-s1", "r-s2"]

    overrides["x"] = 2  # a changed configuration is a different run
    launched.clear()
    experiments.run_experiment("fake", False, 1, tmp_path, None, reuse=True)
    assert launched == ["r-s0"]
    launched.clear()
    experiments.run_experiment("fake", False, 1, tmp_path, None, reuse=False)
    assert launched == ["r-s0"]  # without --reuse every run runs


@pytest.mark.slow
@pytest.mark.timeout(1500)  # 8 runs, each scored on the held-out set twice: ~9 minutes
def test_long_horizon_quick(tmp_path):
    report = run_quick("long_horizon", tmp_path)
    arms = {(r["labels"]["task"], r["labels"]["algorithm"]) for r in report["runs"]}
    assert arms == {
        (t, a) for t in ("early", "no-early", "coin-flip", "short") for a in ("ppo", "grpo")
    }
    for r in report["runs"]:  # every run scored on the held-out set before and after training
        start, final = r["held_out"]["start"], r["held_out"]["final"]
        assert start["episodes"] == final["episodes"] == 48
        assert final["version"] is None and 0 <= final["success"] <= 1
    summary = report["summary"]
    assert set(summary["early/ppo"]["final_by_horizon"]) == {"1-5", "6-15", "16-50"}
    assert set(summary["short/grpo"]["final_by_horizon"]) == {"1-1", "2-3"}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_cut_bootstrap_quick(tmp_path):
    report = run_quick("cut_bootstrap", tmp_path)
    assert {r["overrides"]["learner.cut_bootstrap"] for r in report["runs"]} == {"critic", "zero"}
    assert all(r["held_out"]["final"]["episodes"] == 48 for r in report["runs"])


@pytest.mark.slow
@pytest.mark.timeout(2800)  # seven arms
def test_critic_quick(tmp_path):
    report = run_quick("critic", tmp_path)
    for r in report["runs"]:  # each critic scored on held-out episodes at steps 5, 10 and 15
        assert [p["step"] for p in r["critic_curve"]] == [5, 10, 15]
        assert all(p["version"] == p["step"] for p in r["critic_curve"])
        for point in r["critic_curve"]:
            critic = point["critic"]
            assert critic["samples_per_instance"] == 16
            assert 0 < critic["turns_scored"] <= critic["turns"]
            assert critic["value_function_explained_variance"] <= 1
    for arm in report["summary"].values():
        assert set(arm["held_out_critic"]) == {"5", "10", "15"}


@pytest.mark.slow
def test_ppo_vs_grpo_quick(tmp_path):
    report = run_quick("ppo_vs_grpo", tmp_path)
    assert {(r["labels"]["task"], r["labels"]["algorithm"]) for r in report["runs"]} == {
        ("maze", "ppo"),
        ("maze", "grpo"),
        ("digits", "ppo"),
        ("digits", "grpo"),
    }
    maze = [r for r in report["runs"] if r["labels"]["task"] == "maze"]
    assert all(
        r["summary"]["trajectories_trained"] >= r["summary"]["episodes_trained"] for r in maze
    )


@pytest.mark.slow
def test_icepop_quick(tmp_path):
    report = run_quick("icepop", tmp_path)
    for corr, arm in report["summary"].items():
        kept = arm["kept_fraction"]["mean"]
        assert kept == 1.0 if corr == "none" else 0.0 < kept <= 1.0
        # bf16 sampling vs fp32 recompute: the weights differ from 1, but only slightly
        assert arm["importance_weight_max"] > 1.0


@pytest.mark.slow
def test_icepop_smollm2_quick(tmp_path):
    if not (ROOT / tasks.SMOLLM2 / "config.json").exists():
        pytest.skip(f"{tasks.SMOLLM2} is missing: run `make smollm2`")
    report = run_quick("icepop_smollm2", tmp_path)
    assert report["model"] == tasks.SMOLLM2
    for corr, arm in report["summary"].items():
        assert 0.0 < arm["kept_fraction"]["mean"] <= 1.0, corr
        # bf16 sampling of real weights vs their fp32 recompute: a visible mismatch
        assert arm["importance_weight_max"] > 1.0, corr


@pytest.mark.slow
def test_staleness_quick(tmp_path):
    report = run_quick("staleness", tmp_path)
    for run in report["runs"]:
        assert max(run["series"]["max_staleness"]) <= run["labels"]["max_staleness"]
    # asynchronous samples really are stale
    assert report["summary"]["k4/icepop"]["max_staleness_seen"] >= 1


@pytest.mark.slow
@pytest.mark.timeout(1500)  # seven runs, an evaluator beside each
def test_asynchrony_quick(tmp_path):
    report = run_quick("asynchrony", tmp_path)
    summary = report["summary"]
    assert {(a["max_staleness"], a["arm"]) for a in summary.values()} == {
        (0, "decoupled + IcePop")
    } | {(k, arm) for k in asynchrony.QUICK_BOUNDS[1:] for arm in asynchrony.ASYNC_ARMS}
    for run in report["runs"]:  # held-out scores along the way, and staleness within its bound
        assert len(run["held_out_curve"]) >= 2, run["name"]
        assert max(run["series"]["max_staleness"]) <= run["labels"]["max_staleness"]
    # the actors really run ahead where they may, and the roles' CPU is accounted
    assert summary["eta 0 / decoupled + IcePop"]["mean_staleness"] == 0
    assert summary["eta 8 / decoupled + IcePop"]["mean_staleness"] >= 1
    for arm in summary.values():
        rates = arm["dedicated_episodes_per_second"]
        assert 0 < rates["lockstep"] < rates["overlapped"], arm
    assert summary["eta 0 / decoupled + IcePop"]["async_over_sync"]["measured_here"] == 1.0


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_long_horizon_curves_quick(tmp_path):
    report = run_quick("long_horizon_curves", tmp_path)
    assert all(len(run["held_out_curve"]) >= 2 for run in report["runs"])  # a curve, not a point
    for algo in ("ppo", "grpo"):
        arm = report["summary"][f"early/{algo}"]
        assert arm["seeds"] == 1 and arm["collapses"] in (0, 1)
        assert set(arm["episodes_to_reach"]) == {"0.6", "0.8"}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_credit_quick(tmp_path):
    report = run_quick("credit", tmp_path)
    assert set(report["summary"]) == {"token", "turn"}
    for run in report["runs"]:
        assert run["overrides"]["learner.gae_unit"] == run["labels"]["gae_unit"]
        assert len(run["held_out_curve"]) >= 2 and run["held_out"]["final"]["episodes"] == 48


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_mismatch_threshold_quick(tmp_path):
    report = run_quick("mismatch_threshold", tmp_path)
    summary = report["summary"]
    assert set(summary) == {"noise 0.0 / icepop"} | {
        f"noise {n} / {c}" for n in (0.6, 1.0) for c in ("none", "icepop")
    }
    # the perturbed actors' mu is off the learner's pi_prox: IcePop's band drops tokens
    assert summary["noise 1.0 / icepop"]["kept_fraction"]["mean"] < 1.0
    assert summary["noise 0.0 / icepop"]["importance_weight_max"] < 1.1


@pytest.mark.slow
def test_async_quick(tmp_path):
    report = run_quick("async", tmp_path)
    summary = report["summary"]
    assert summary["simulated/throughput_ratio_async_over_sync"] > 1.0
    assert (
        summary["simulated/k4"]["idle_fraction"]["mean"]
        < summary["simulated/k0"]["idle_fraction"]["mean"]
    )


def test_maze_warmup_demonstrations_type_the_hint_and_mask_only_actions(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for hint_rate, expected in ((1.0, 1.0), (0.0, 0.25)):
        follows = []
        for ids, mask in demonstrations(
            tokenizer, episodes=40, turns=6, hint_rate=hint_rate, seed=3
        ):
            assert len(ids) == len(mask)
            actions = [i for i, m in enumerate(mask) if m]
            assert len(actions) % 2 == 0 and actions  # a letter, then the end of turn
            for letter_at in actions[::2]:
                assert ids[letter_at + 1] == end_of_turn and mask[letter_at - 1] == 0
                text = tokenizer.decode(ids[:letter_at], skip_special_tokens=True)
                hint = re.findall(r"Hint: \[([UDLR])\]", text)[-1]
                follows.append(tokenizer.decode([ids[letter_at]]) == hint)
        assert np.mean(follows) == pytest.approx(expected, abs=0.1)


def test_model_warmup_command_builds_the_recipe_and_names_an_unknown_env(
    tiny_model, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(deploy.warmup, "BASE_MODEL", str(tiny_model))
    monkeypatch.setitem(deploy.warmup.RECIPES, "chain", {"steps": 2, "hint_rate": 0.8})
    out = tmp_path / "warm"
    assert cli_main(["model", "warmup", "chain", "--out", str(out)]) == 0
    assert json.loads((out / "warmup.json").read_text())["env"] == "chain"
    assert load_tokenizer(out).convert_tokens_to_ids("<|im_end|>") is not None
    assert cli_main(["model", "warmup", "digits", "--out", str(tmp_path / "x")]) == 2
    assert "no warm-up recipe for 'digits'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_warmup_reuses_a_model_only_when_its_recipe_is_unchanged(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(deploy.warmup, "BASE_MODEL", str(tiny_model))
    out = tmp_path / "warm"
    recipe = {"env": "chain", "episodes": 20, "turns": 2, "batch": 4}
    warm_up(out, steps=2, **recipe)
    written = json.loads((out / "warmup.json").read_text())
    assert written["steps"] == 2 and written["hint_rate"] == RECIPES["chain"]["hint_rate"]
    weights = (out / "model.safetensors").stat().st_mtime_ns
    warm_up(out, steps=2, **recipe)  # same recipe: the directory is reused as it is
    assert (out / "model.safetensors").stat().st_mtime_ns == weights
    warm_up(out, steps=3, **recipe)  # a changed recipe rebuilds it
    assert json.loads((out / "warmup.json").read_text())["steps"] == 3
