"""Configuration: YAML + --set overrides, and errors that name the key, the value and the source."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.config import ConfigError, load_config, reference_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_yaml_and_overrides_merge(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learner:\n  optimizer: {lr: 1e-4}\n  batch_size: 4\nactor:\n  env: maze\n")
    cfg = load_config(
        path,
        ["learner.batch_size=8", "broker.spool_dir=/tmp/x", "actor.env_kwargs={max_turns: 10}"],
    )
    assert (
        cfg.learner.optimizer.lr == 1e-4
    )  # YAML 1.1 reads 1e-4 as a string; a float field takes it as a number
    assert cfg.learner.batch_size == 8 and cfg.actor.env == "maze"
    assert cfg.broker.spool_dir == "/tmp/x" and cfg.actor.env_kwargs == {"max_turns": 10}
    assert cfg.learner.gamma == 1.0  # untouched default


def test_a_renamed_key_is_still_read_and_named_anew(tmp_path):
    """The flat critic and optimizer keys before the groups: YAML and --set both reach the new
    place, with a warning that names it; `learner.critic` as a value is the critic's kind."""
    path = tmp_path / "old.yaml"
    path.write_text("learner:\n  lr: 1e-4\n  critic_lr: 5e-4\n  critic: shared\n")
    with pytest.warns(FutureWarning) as warned:
        cfg = load_config(path, ["learner.lr_warmup_steps=3", "learner.value_coef=0.25"])
    said = [str(w.message) for w in warned]
    assert len(said) == 5, said
    assert any("'learner.critic_lr' (" in m and "is now 'learner.critic.lr'" in m for m in said)
    learner = cfg.learner
    assert learner.optimizer.lr == 1e-4 and learner.critic.lr == 5e-4
    assert learner.critic.kind == "shared" and learner.critic.value_coef == 0.25
    assert learner.optimizer.warmup_steps == 3
    # an old spelling is checked like the new one: the error names the new key, the source as written
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="'learner.critic.kind'"):
        load_config(None, ["learner.critic=both"])


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("learner.lrr=1", "unknown config key 'learner.lrr'"),
        ("nosection.x=1", "unknown config key 'nosection'"),
        (
            "learner.optimizer.lr=fast",
            "config key 'learner.optimizer.lr' (--set learner.optimizer.lr=fast): expected float, got str 'fast'",
        ),
        ("learner.batch_size=2.5", "expected int, got float 2.5"),
        ("learner.batch_size=true", "expected int, got bool True"),
        (
            "actor.engine=vllm",
            "'actor.engine' (--set actor.engine=vllm): 'vllm' is not one of torch, sglang",
        ),
        ("learner.correction=7", "'learner.correction' (--set learner.correction=7): 7 is not"),
        ("learner.batch_size=0", "'learner.batch_size' must be >= 1"),
        ("broker.max_staleness=-1", "'broker.max_staleness' must be >= 0"),
        ("learner.icepop_low=2", "need 0 < low <= 1 <= high"),
        ("learner.zero_stage=4", "must be 0-3"),
        ("learner.critic.warmup_ev=0.3", "'learner.critic.warmup_ev' needs learner.algorithm=ppo"),
        ("learner.critic.warmup_ev=1.5", "'learner.critic.warmup_ev'"),
        ("learner=3", "config section 'learner.' "),
        ("novalue", "expected KEY=VALUE"),
    ],
)
def test_bad_overrides_name_key_and_value(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert needle in str(info.value)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("learner:\n  bach_size: 3\n")
    with pytest.raises(ConfigError, match=rf"unknown config key 'learner.bach_size' \({typo}\)"):
        load_config(typo)


def test_grpo_needs_groups():
    with pytest.raises(ConfigError, match="group_size"):
        load_config(None, ["learner.algorithm=grpo"])
    cfg = load_config(
        None, ["learner.algorithm=grpo", "actor.group_size=4", "actor.permits_per_request=8"]
    )
    assert cfg.actor.group_size == 4


def test_every_shipped_config_loads():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path)


def test_reference_lists_every_key():
    ref = reference_markdown()
    for key in (
        "learner.icepop_low",
        "broker.max_staleness",
        "actor.context_budget_tokens",
        "security.curve",
    ):
        assert f"`{key}`" in ref


@pytest.mark.system
def test_cli_help_imports_nothing_heavy_and_config_errors_exit_2():
    out = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0 and "broker" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "broker", "--set", "broker.max_staleness=x"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2 and "broker.max_staleness" in out.stderr
    probe = (
        "import sys, deploy.cli; deploy.cli.build_parser()\n"
        "try:\n    deploy.cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'deepspeed', 'transformers', 'zmq') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    "key, registry",
    [
        ("algorithm", "ESTIMATORS"),
        ("correction", "CORRECTIONS"),
        ("advantage_norm", "ADVANTAGE_NORMS"),
        ("proximal", "ANCHORS"),
    ],
)
def test_every_choice_is_declared_once_and_implemented(key, registry):
    """The config's Literal is where a choice is declared; the learner's registry must implement
    exactly those options (a new option in one place only fails here)."""
    import typing

    from common.config import LearnerConfig
    from learner import algorithms

    options = typing.get_args(typing.get_type_hints(LearnerConfig)[key])
    assert set(options) == set(getattr(algorithms, registry)), key


def test_off_is_zero_for_a_number_and_null_for_a_path():
    cfg = load_config(None, ["learner.adaptive_lambda_alpha=0", "learner.critic.init=null"])
    assert cfg.learner.adaptive_lambda_alpha == 0 and cfg.learner.critic.init is None
    with pytest.raises(ConfigError, match="adaptive_lambda_alpha"):
        load_config(None, ["learner.adaptive_lambda_alpha=null"])
