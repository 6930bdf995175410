"""LoRA: the learner trains adapters (peft) under every ZeRO stage, publishes only them, and an
actor that merges them into its base model samples with the learner's own log-probs.

In-process learners share one world-size-1 process group (``single_process_group``); the
broker and the `asyncppo up` run are real processes.
"""

from __future__ import annotations

import hashlib
import json
import time

import pytest
import torch
from conftest import free_port, smoke_args
from peft import PeftModel
from test_learner import build_learner, fixed_batch, on_policy, snapshot
from transformers import AutoModelForCausalLM

from actors.engines import SamplingParams, TorchEngine
from common.config import ConfigError, load_config
from common.lora import AdapterRefused, adapter_tensors, factor_pairs, fingerprint, save_peft
from common.protocol import ProtocolError
from common.weights import pack_state_dict, unpack_state_dict, validate_manifest
from learner.models import token_logprobs
from testkit.peers import BrokerProcess

pytestmark = pytest.mark.usefixtures("single_process_group")
LORA = ("learner.lora.rank=4", "learner.optimizer.lr=1e-2", "learner.critic.lr=1e-2")
PROMPTS = [[3, 4, 5, 6, 7], [8, 9, 10]]


def learner_logprobs(learner, prompts: list[list[int]], gens) -> torch.Tensor:
    """The learner's recomputation of every generated token's log-prob (its policy, unmerged)."""
    policy = learner.policy.module.policy
    gaps = []
    with torch.no_grad():
        for prompt, gen in zip(prompts, gens, strict=True):
            ids = torch.tensor([prompt + gen.token_ids])
            logits = policy(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            lp = token_logprobs(logits, ids, gen.temperature)[0, len(prompt) :]
            gaps.append(lp - torch.tensor(gen.logprobs))
    return torch.cat(gaps)


def sample(engine: TorchEngine):
    return engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.0, seed=3))


@pytest.fixture(scope="module")
def stepped(tmp_path_factory, tiny_model):
    """A LoRA learner per ZeRO stage after one step on the same on-policy batch (built on use)."""
    cache: dict[int, tuple] = {}
    batch = on_policy(fixed_batch(), tiny_model)

    def get(stage: int):
        if stage not in cache:
            critic = "shared" if stage % 2 else "separate"  # both critics, across the stages
            learner = build_learner(
                tiny_model,
                tmp_path_factory.mktemp(f"lora{stage}"),
                *LORA,
                f"learner.zero_stage={stage}",
                f"learner.critic.kind={critic}",
            )
            before = snapshot(learner)
            learner.train_step(batch)
            cache[stage] = learner, before, snapshot(learner)
        return cache[stage]

    yield get
    for learner, _, _ in cache.values():
        learner.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_trains_only_adapters_and_heads(stepped, stage):
    learner, before, after = stepped(stage)
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all("lora_" in k or "head.proj" in k for k in moved), sorted(moved)[:5]
    assert any("lora_B" in k for k in moved)  # B starts at 0: the adapter now changes the model
    exported = learner.export_weights()
    assert exported and all(k.endswith((".lora_A", ".lora_B")) for k in exported)
    if stage >= 2:  # ZeRO-2 and -3 publish what stages 0 and 1 (the same critics) publish
        torch.testing.assert_close(
            exported, stepped(stage - 2)[0].export_weights(), rtol=0, atol=1e-5
        )


@pytest.mark.parametrize("stage", [1, 3])
def test_merged_adapter_gives_the_engine_the_learners_logprobs(stepped, tiny_model, stage):
    learner = stepped(stage)[0]
    tensors = learner.export_weights()
    manifest, chunks = pack_state_dict(
        tensors, 1, 4096, adapter_base=learner.policy.module.base_fingerprint
    )
    validate_manifest(manifest)
    full_bytes = sum(p.numel() * 4 for p in TorchEngine(str(tiny_model)).model.parameters())
    assert manifest["total_bytes"] < 0.1 * full_bytes  # rank 4 on a 64-wide model: ~8 %

    engine = TorchEngine(str(tiny_model))
    base_gens = sample(engine)
    engine.load_version(manifest, unpack_state_dict(manifest, [bytes(c) for c in chunks]))
    gens = sample(engine)
    assert engine.version == 1 and sum(len(g.token_ids) for g in gens) > 10
    gap = learner_logprobs(learner, PROMPTS, gens).abs().max()
    assert float(gap) < 1e-4, gap  # fp32 merged vs unmerged: rounding only
    moved = learner_logprobs(learner, PROMPTS, base_gens).abs().max()
    assert float(moved) > 1e-3  # and the adapter did change the policy


def test_an_adapter_for_another_base_is_refused_and_the_weights_stay(tiny_model, stepped):
    learner = stepped(1)[0]
    manifest, chunks = pack_state_dict(
        learner.export_weights(), 2, 4096, adapter_base=learner.policy.module.base_fingerprint
    )
    tensors = unpack_state_dict(manifest, [bytes(c) for c in chunks])
    engine = TorchEngine(str(tiny_model))
    with torch.no_grad():
        engine.model.model.norm.weight.add_(0.1)  # another base model (beyond bf16 rounding)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(AdapterRefused, match="is for base model .* start the actor on"):
        engine.load_version(manifest, tensors)
    assert engine.version == 0
    torch.testing.assert_close(engine.model.state_dict(), before, rtol=0, atol=0)

    full = TorchEngine(str(tiny_model))
    full.load_weights(1, {k: v.clone() for k, v in full.model.state_dict().items()})
    with pytest.raises(AdapterRefused, match="full weights of an earlier version"):
        full.load_version(manifest, tensors)

    broken = dict(tensors)
    broken.pop(next(k for k in broken if k.endswith(".lora_B")))
    with pytest.raises(AdapterRefused, match="needs lora_A and lora_B"):
        factor_pairs(broken)


def test_manifest_adapter_field_is_checked():
    manifest, _ = pack_state_dict({"w.lora_A": torch.zeros(2, 3)}, 1, 64, adapter_base="ab" * 32)
    validate_manifest(manifest)
    for bad in ({"base": "xyz"}, "ab" * 32, {}):
        with pytest.raises(ProtocolError, match="manifest.adapter"):
            validate_manifest({**manifest, "adapter": bad})


def test_fingerprint_is_the_documented_hash_and_ignores_dtype(tiny_model):
    """protocol.md §6.2: sha256 over "name:dims;" and the bf16 bytes, keys sorted, tied once;
    the same checkpoint loaded in float32 and bfloat16 gives the same fingerprint."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    digest = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if name == "lm_head.weight":  # tied to the embedding
            continue
        digest.update(f"{name}:{','.join(str(d) for d in t.shape)};".encode())
        digest.update(t.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes())
    assert fingerprint(model) == digest.hexdigest()
    bf16 = AutoModelForCausalLM.from_pretrained(
        tiny_model, local_files_only=True, dtype=torch.bfloat16
    )
    assert fingerprint(bf16) == digest.hexdigest()


def test_config_rejects_empty_target_modules():
    assert load_config().learner.lora.rank == 0  # off by default
    with pytest.raises(ConfigError, match="learner.lora.target_modules"):
        load_config(None, ["learner.lora.target_modules=[]"])


def test_target_modules_the_model_lacks_are_a_config_error_naming_its_layers(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match=r"learner.lora.target_modules \['qkv'\].*q_proj"):
        build_learner(tiny_model, tmp_path, *LORA, 'learner.lora.target_modules=["qkv"]')


def test_peft_format_written_for_sglang_loads_in_peft_with_the_same_logits(
    tmp_path, tiny_model, stepped
):
    """``save_peft`` (what the sglang engine hands to sglang) is a peft adapter whose model
    computes what the merged engine computes."""
    pairs = factor_pairs(stepped(1)[0].export_weights())
    save_peft(pairs, tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    engine = TorchEngine(str(tiny_model))
    engine.load_adapter(
        1,
        {
            f"{w}.{f}": t
            for w, ab in pairs.items()
            for f, t in zip(("lora_A", "lora_B"), ab, strict=True)
        },
        engine.base.compute(),
    )
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(
            peft_model(input_ids=ids).logits, engine.model(input_ids=ids).logits, rtol=0, atol=1e-5
        )


def test_resume_and_export_adapter_and_merged(tmp_path, tiny_model, stepped):
    learner = stepped(2)[0]
    learner.save_checkpoint()
    resumed = build_learner(
        tiny_model,
        learner.run_dir,
        *LORA,
        "learner.zero_stage=2",
        "learner.critic.kind=separate",
        resume="require",
    )
    try:
        torch.testing.assert_close(
            resumed.export_weights(), learner.export_weights(), rtol=0, atol=0
        )
    finally:
        resumed.close()

    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        want = learner.policy.module.policy(input_ids=ids).logits
    learner.export(str(tmp_path / "adapter"))
    base = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    from_adapter = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    learner.lc.lora.export = "merged"
    try:
        learner.export(str(tmp_path / "merged"))
    finally:
        learner.lc.lora.export = "adapter"
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    with torch.no_grad():
        torch.testing.assert_close(from_adapter(input_ids=ids).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=0, atol=1e-5)


@pytest.mark.system
def test_actor_takes_published_adapters_and_refuses_another_bases(tmp_path, tiny_model):
    """Broker process; the learner publishes through it; a real Actor fetches, merges and samples
    at zero staleness with the learner's log-probs; an adapter for another base is refused and
    the actor goes on with the weights it has."""
    from actors.actor import M_REFUSED, Actor

    with BrokerProcess(tmp_path / "broker.log") as broker:
        endpoints = [f"actor.broker={broker.address}", f"learner.broker={broker.address}"]
        learner = build_learner(tiny_model, tmp_path / "run", *LORA, *endpoints)
        actor = Actor(
            load_config(None, [f"model.path={tiny_model}", f"run.out_dir={tmp_path}", *endpoints])
        )
        try:
            learner.train_step(on_policy(fixed_batch(), tiny_model))
            learner.connect()  # HELLO, then the adapter as the first version
            actor.link.register()
            actor.sync_weights()
            assert actor.engine.version == learner.version
            gap = learner_logprobs(learner, PROMPTS, sample(actor.engine)).abs().max()
            assert float(gap) < 1e-4, gap

            refused = M_REFUSED._value.get()
            real = learner.policy.module.base_fingerprint
            learner.policy.module.base_fingerprint = "0" * 64  # as if trained on another base
            learner.version += 1
            learner.publish()
            learner.policy.module.base_fingerprint = real
            deadline = time.monotonic() + 10
            while actor.refused < learner.version and time.monotonic() < deadline:
                if actor.behind():  # the heartbeat thread heard of it: try to load it
                    actor.sync_weights()
                time.sleep(0.05)
            assert actor.refused == learner.version and M_REFUSED._value.get() == refused + 1
            assert actor.engine.version == learner.version - 1  # kept its weights
            assert not actor.behind()  # and does not fetch the refused version again
        finally:
            actor.close()
            learner.close()


@pytest.mark.timeout(400)
@pytest.mark.system
def test_lora_run_trains_end_to_end_in_real_processes(tmp_path, tiny_model, procs):
    """`asyncppo up` with LoRA: the learner publishes adapters of a few KB, every actor merges
    them, and at zero staleness the learner's pi_prox equals the actors' mu token for token."""
    summary = tmp_path / "summary.json"
    proc = procs.start(
        smoke_args(
            tmp_path,
            tiny_model,
            free_port(),
            "--set",
            "learner.lora.rank=4",
            "--set",
            "broker.max_staleness=0",
            "--set",
            f"learner.export_dir={tmp_path / 'export'}",
            "--summary",
            str(summary),
        ),
        tmp_path / "up.log",
    )
    assert proc.wait(timeout=360) == 0, (tmp_path / "up.log").read_text()[-3000:]
    s = json.loads(summary.read_text())
    assert s["learner_steps"] == 4 and s["trajectories_trained"] == 32
    assert all(v >= 2 for v in s["actor_versions"].values()), s["actor_versions"]
    steps = [json.loads(line) for line in (tmp_path / "run" / "learner_steps.jsonl").open()]
    for st in steps:
        assert st["max_staleness"] == 0
        assert abs(st["importance_weight_max"] - 1) < 1e-4, st
        assert abs(st["importance_weight_mean"] - 1) < 1e-4, st
    published = [
        event["bytes"]
        for line in (tmp_path / "run" / "logs" / "learner.log").open()
        if line.startswith("{")  # structlog's JSON lines among DeepSpeed's own output
        and (event := json.loads(line)).get("event") == "published weights"
    ]
    assert len(published) >= 5 and max(published) < 64 * 1024, published  # the model: 443 KB
    assert (tmp_path / "export" / "adapter_config.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs sglang and a CUDA GPU")
def test_sglang_engine_samples_with_the_adapter_through_its_own_lora_support(tmp_path):
    """sglang loads the adapter (as a peft directory) and its log-probs follow the adapted
    model, not the base (a 256-wide model: sglang's kernels need it)."""
    from actors.engines.sglang_engine import SGLangEngine
    from common.config import LoraConfig
    from common.model import build_tiny_model
    from learner.models import with_adapters

    path = build_tiny_model(tmp_path / "tiny", hidden_size=256, num_heads=4)
    adapted = with_adapters(
        AutoModelForCausalLM.from_pretrained(path, local_files_only=True),
        LoraConfig(rank=8, alpha=8.0),
    ).eval()
    torch.manual_seed(0)
    for name, p in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    base = fingerprint(AutoModelForCausalLM.from_pretrained(path, local_files_only=True))
    engine = SGLangEngine(
        str(path),
        dtype="float32",
        lora_rank=8,
        enable_deterministic_inference=True,
        mem_fraction_static=0.3,
    )
    try:
        engine.load_adapter(1, adapter_tensors(adapted.state_dict(), 1.0), base)
        gens = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.0, seed=3))
    finally:
        engine.close()
    gaps = []
    with torch.no_grad():
        for prompt, gen in zip(PROMPTS, gens, strict=True):
            ids = torch.tensor([prompt + gen.token_ids])
            lp = token_logprobs(adapted(input_ids=ids).logits, ids, 1.0)[0, len(prompt) :]
            gaps.append(lp - torch.tensor(gen.logprobs))
    assert float(torch.cat(gaps).abs().max()) < 2e-3  # sglang's GPU kernels vs the CPU reference
