"""SmolLM2-135M-Instruct, a real chat model, through conversion, engine, learner and broker.

The model tests are `slow` and need `make smollm2` (they skip, saying so, without it); the
checks of the install errors run everywhere.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, free_port

from common.convert import (
    PREPARABLE,
    SOURCE_RECORD,
    PackagedModel,
    SourceMissingError,
    locate_gguf,
    prepare_model,
)
from common.lifecycle import spawn
from common.model import load_causal_lm, load_tokenizer

NAME = "smollm2-135m-instruct"
SOURCE = PREPARABLE[NAME]
QUESTIONS = ["What is 3 + 4? Answer with the number only.", "What is 17 + 25?", "Say hi.", "2+2?"]


def installed() -> bool:
    try:
        importlib.metadata.distribution(SOURCE.distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return all(importlib.util.find_spec(m) is not None for m in ("gguf", "accelerate"))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Converted once per module, through the same function `asyncppo model prepare` calls."""
    if not installed():
        pytest.skip(f"{SOURCE.distribution}, gguf or accelerate not installed: run `make smollm2`")
    torch.set_num_threads(2)
    out = tmp_path_factory.mktemp("models") / NAME
    assert prepare_model(NAME, out) is True
    return out


# ------------------------------------------------------------------ install errors (fast)


def test_missing_package_names_the_install_step():
    with pytest.raises(
        SourceMissingError, match=r"'asyncppo-no-such-dist' is not installed.*make x"
    ):
        locate_gguf(PackagedModel("asyncppo-no-such-dist", "1.0", "m.gguf", "x"))


def test_other_version_or_missing_file_is_refused():
    msgpack = importlib.metadata.version("msgpack")
    with pytest.raises(
        SourceMissingError, match=f"msgpack {msgpack} is installed, .* tested with 0.0.1"
    ):
        locate_gguf(PackagedModel("msgpack", "0.0.1", "m.gguf", "x"))
    with pytest.raises(SourceMissingError, match="does not list m.gguf"):
        locate_gguf(PackagedModel("msgpack", msgpack, "m.gguf", "x"))


def test_prepare_refuses_unknown_names_and_foreign_directories(tmp_path):
    from deploy.cli import main

    with pytest.raises(ValueError, match="known: smollm2-135m-instruct"):
        prepare_model("gpt-5", tmp_path / "m")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not a prepared smollm2-135m-instruct"):
        prepare_model(NAME, tmp_path / "taken")
    assert main(["model", "prepare", NAME, "--out", str(tmp_path / "taken")]) == 2
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_conversion_gives_a_directory_transformers_loads(smollm2, capsys):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM

    from deploy.cli import main

    assert main(["model", "prepare", NAME, "--out", str(smollm2)]) == 0  # second time: nothing
    assert "nothing to do" in capsys.readouterr().out
    assert not list(smollm2.parent.glob(f".{NAME}.preparing-*"))
    record = json.loads((smollm2 / SOURCE_RECORD).read_text())
    assert record["model"] == NAME and record["version"] == SOURCE.version == "0.1.2"

    model = AutoModelForCausalLM.from_pretrained(smollm2, local_files_only=True)
    assert model.dtype == torch.bfloat16  # stored dtype (see common/convert.py for why)
    assert (model.config.num_hidden_layers, model.config.vocab_size) == (30, 49152)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # the weights are the GGUF's, de-quantised independently here with the gguf package
    tensors = {t.name: t for t in GGUFReader(locate_gguf(SOURCE)).tensors}
    for gguf_name, param in [
        ("token_embd.weight", model.model.embed_tokens.weight),
        ("blk.0.ffn_down.weight", model.model.layers[0].mlp.down_proj.weight),
        ("blk.29.attn_norm.weight", model.model.layers[29].input_layernorm.weight),
    ]:
        t = tensors[gguf_name]
        expected = torch.tensor(dequantize(t.data, t.tensor_type)).to(torch.bfloat16)
        assert torch.equal(param.detach(), expected), gguf_name

    tokenizer = load_tokenizer(smollm2)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id == 2


def engine_vs_learner(smollm2: Path, dtype: str) -> tuple[torch.Tensor, list]:
    """|log mu - log pi| on the tokens a torch engine in `dtype` sampled, vs the fp32 learner.

    The engine's batch is left-padded with a KV cache; the learner's is right-padded and scored
    in one forward pass, as in training.
    """
    from actors.chat import ChatFormat
    from actors.engines import SamplingParams, TorchEngine
    from learner.models import Policy, token_logprobs

    engine = TorchEngine(str(smollm2), dtype=dtype)
    fmt = ChatFormat(engine.tokenizer)
    prompts = [fmt.prompt(q) for q in QUESTIONS]
    params = SamplingParams(
        max_new_tokens=12, temperature=0.7, stop_token_ids=fmt.stop_token_ids, seed=7
    )
    gens = engine.generate(prompts, params)
    rows = [torch.tensor(p + g.token_ids) for p, g in zip(prompts, gens, strict=True)]
    policy = Policy(str(smollm2), torch.float32).eval()
    with torch.no_grad():
        ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # right-padded, as Batch
        logits = policy(ids)
        learner_lp = token_logprobs(logits, ids.long(), params.temperature)
    gaps = [
        (learner_lp[i, len(p) : len(p) + len(g.token_ids)] - torch.tensor(g.logprobs)).abs()
        for i, (p, g) in enumerate(zip(prompts, gens, strict=True))
    ]
    return torch.cat(gaps), gens


@pytest.mark.slow
def test_engine_logprobs_equal_the_learners_recomputation(smollm2):
    fp32_gap, gens = engine_vs_learner(smollm2, "float32")
    assert sum(len(g.token_ids) for g in gens) > 8
    assert float(fp32_gap.max()) < 1e-4, fp32_gap
    bf16_gap, _ = engine_vs_learner(smollm2, "bfloat16")
    print(
        f"|log mu - log pi|: fp32 engine max {float(fp32_gap.max()):.2e}; bf16 engine "
        f"mean {float(bf16_gap.mean()):.3f} max {float(bf16_gap.max()):.3f}"
    )
    assert float(bf16_gap.mean()) > 10 * float(fp32_gap.mean())  # the natural mismatch is real


def wait_or_stop(proc: subprocess.Popen, timeout: float, log: Path) -> int:
    """The exit code; past `timeout` SIGTERM (torchrun passes it on to its ranks), then SIGKILL."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"timed out; log tail:\n{log.read_text()[-3000:]}") from None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_zero2_step_on_two_ranks_and_the_pushed_weights_reach_an_actor_bit_for_bit(
    smollm2, tmp_path, procs
):
    """Broker, a 2-rank ZeRO-2 learner (torchrun) and an actor, as real processes; then a fresh
    actor downloads the newest version from the broker and holds the learner's final weights."""
    from actors.actor import Actor
    from common.config import load_config

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    overrides = [
        f"model.path={smollm2}",
        f"run.out_dir={tmp_path / 'run'}",
        f"broker.bind={endpoint}",
        f"actor.broker={endpoint}",
        f"learner.broker={endpoint}",
        "learner.total_steps=1",
        "learner.batch_size=4",
        "actor.permits_per_request=4",
        "learner.zero_stage=2",
        "learner.critic.kind=shared",
        "learner.optimizer.lr=1e-4",
        f"learner.export_dir={tmp_path / 'export'}",
        "actor.env_kwargs={max_new_tokens: 6}",
        "run.log_format=json",
    ]
    args = ["--config", "configs/smollm2-arith.yaml", *(a for o in overrides for a in ("--set", o))]
    (tmp_path / "run").mkdir()
    procs.start(["broker", *args], tmp_path / "broker.log")
    actor = procs.start(["actor", *args, "--set", "actor.id=roller"], tmp_path / "actor.log")
    with open(tmp_path / "learner.log", "wb") as out:
        learner = spawn(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node=2",
                "--master-port",
                str(free_port()),
                "-m",
                "deploy.cli",
                "learner",
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    assert wait_or_stop(learner, 720, tmp_path / "learner.log") == 0
    actor.send_signal(signal.SIGTERM)
    (step,) = [json.loads(x) for x in (tmp_path / "run" / "learner_steps.jsonl").open()]
    assert step["episodes"] == 4 and step["tokens"] > 0 and step["actors"] == ["roller"]
    assert all(map(torch.isfinite, torch.tensor([step["policy_loss"], step["value_loss"]])))
    ready = [json.loads(x) for x in (tmp_path / "learner.log").open() if '"learner ready"' in x]
    assert sorted((r["rank"], r["world"], r["zero_stage"]) for r in ready) == [(0, 2, 2), (1, 2, 2)]

    cfg = load_config("configs/smollm2-arith.yaml", [*overrides, "actor.id=checker"])
    fresh = Actor(cfg)
    try:
        fresh.link.register()
        fresh.sync_weights()
        assert fresh.engine.version == step["version"] + 1  # the version published after the step
        pushed = fresh.engine.model.state_dict()
    finally:
        fresh.close()
    trained = load_causal_lm(tmp_path / "export").state_dict()  # the learner's own save
    initial = load_causal_lm(smollm2).state_dict()
    assert pushed.keys() == trained.keys()
    assert all(torch.equal(pushed[k], trained[k]) for k in trained)
    assert pushed["lm_head.weight"].data_ptr() == pushed["model.embed_tokens.weight"].data_ptr()
    assert not all(torch.equal(trained[k], initial[k]) for k in trained)  # the step changed them
