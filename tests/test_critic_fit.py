"""`asyncppo critic`: a critic fitted to the starting policy's episodes, and `learner.critic.init`
starting the learner's critic from it."""

from __future__ import annotations

import json
import shutil

import pytest
import structlog
import torch
from test_learner import build_learner, fixed_batch

from common.config import ConfigError, load_config
from deploy.cli import main
from learner.batch import Batch
from learner.models import VALUE_HEAD, Critic

pytestmark = pytest.mark.usefixtures("single_process_group")


@pytest.fixture(autouse=True)
def _fresh_logging():
    """An earlier test's `asyncppo eval` configured structlog onto its captured (now closed)
    stderr; the learners built here would log there."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


def fit_args(model, out, *extra: str) -> list[str]:
    """A small fit on the 1-3 turn chain with coin-flip rewards (a random model earns some): 6 instances x 2 plays, 3 regression steps."""
    sets = [
        f"model.path={model}",
        "actor.env=chain",
        "actor.env_kwargs={min_turns: 1, max_turns: 3, coin_flip: true}",  # rewards to fit
        "eval.episodes=4",
        "eval.horizon_buckets=[1, 3]",
    ]
    return [
        "critic",
        *[a for s in sets for a in ("--set", s)],
        "--out",
        str(out),
        "--instances",
        "6",
        "--plays",
        "2",
        "--steps",
        "3",
        *extra,
    ]


def values(critic: torch.nn.Module, batch: Batch) -> torch.Tensor:
    ids, _ = batch.inputs(list(range(len(batch))), "cpu")
    with torch.no_grad():
        return critic(ids)


def test_a_fitted_critic_is_written_reused_and_starts_the_learners_critic(
    tmp_path, tiny_model, capfd
):
    out = tmp_path / "critic"
    assert main(fit_args(tiny_model, out)) == 0
    report = json.loads((out / "critic_fit.json").read_text())
    assert report["recipe"]["instances"] == 6 and report["recipe"]["plays"] == 2
    assert report["train_turns"] > 0 and report["generated_tokens"]["train"] > 0
    assert [p["step"] for p in report["curve"]] == [0, 3]
    assert "held-out explained variance" in capfd.readouterr().out
    # The same recipe again: nothing is refitted.
    stamp = (out / VALUE_HEAD).stat().st_mtime_ns
    assert main(fit_args(tiny_model, out)) == 0
    assert "reusing" in capfd.readouterr().out
    assert (out / VALUE_HEAD).stat().st_mtime_ns == stamp
    # A report from before its format was versioned (its V^pi key held the MC estimate): refitted.
    del report["recipe"]["report_format"]
    (out / "critic_fit.json").write_text(json.dumps(report))
    assert main(fit_args(tiny_model, out)) == 0
    assert "reusing" not in capfd.readouterr().out
    assert json.loads((out / "critic_fit.json").read_text())["recipe"]["report_format"] >= 2

    batch = Batch.of(fixed_batch())
    fitted = values(Critic(str(tiny_model), torch.float32, init=str(out)), batch)
    fresh = values(Critic(str(tiny_model), torch.float32), batch)
    assert torch.count_nonzero(fresh) == 0  # a zero head: what critic.init replaces
    assert torch.count_nonzero(fitted) > 0
    learner = build_learner(tiny_model, tmp_path / "run", f"learner.critic.init={out}")
    try:
        assert torch.equal(values(learner.critic.module, batch), fitted)
    finally:
        learner.close()


def test_a_bad_critic_init_is_named(tmp_path, tiny_model):
    with pytest.raises(ConfigError, match="learner.critic.kind=separate"):
        load_config(None, ["learner.critic.init=x", "learner.critic.kind=shared"])
    with pytest.raises(ConfigError, match="learner.algorithm=ppo"):
        load_config(None, ["learner.critic.init=x", "learner.algorithm=grpo"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=f"learner.critic.init '{empty}': missing config.json"):
        build_learner(tiny_model, tmp_path / "run", f"learner.critic.init={empty}")
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    (other / VALUE_HEAD).write_bytes(b"")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 7}))
    with pytest.raises(ConfigError, match="vocab_size 7 does not match model.path's"):
        build_learner(tiny_model, tmp_path / "run", f"learner.critic.init={other}")


def test_critic_refuses_an_out_dir_holding_something_else(tmp_path, tiny_model, capfd):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(fit_args(tiny_model, out)) == 2
    assert "holds something else" in capfd.readouterr().err
    assert main(fit_args(tiny_model, tmp_path / "x", "--plays", "0")) == 2
