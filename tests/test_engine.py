"""Engine contract: every engine's tokens and log-probs must agree with a plain forward pass.

The suite runs once per engine. The sglang runs need a CUDA GPU and sglang installed; they use
a wider tiny model (head_dim 64, which GPU attention kernels support) and deterministic
inference so that seeds are honoured.
"""

import dataclasses
import importlib.util
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.engines import Engine, Generation, SamplingParams, make_engine
from common.model import (
    build_tiny_model,
    load_causal_lm,
    load_exported_state_dict,
    load_tokenizer,
    state_dict_for_export,
)

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
ENGINE_OPTIONS = {
    "torch": {},
    "sglang": {
        "dtype": "float32",
        "enable_deterministic_inference": True,
        "mem_fraction_static": 0.3,
    },
}
MODEL_SIZES = {
    "torch": {"hidden_size": 64, "num_heads": 4},
    "sglang": {"hidden_size": 256, "num_heads": 4},
}
ATOL = {"torch": 1e-4, "sglang": 2e-3}  # sglang's GPU kernels differ from the HF reference
SWAP_AFTER = 8  # engine steps before a mid-turn weight swap
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48], [100, 101, 102, 103, 104]]

needs_gpu = pytest.mark.skipif(
    not (HAS_SGLANG and torch.cuda.is_available()), reason="needs sglang and a CUDA GPU"
)


@pytest.fixture(
    scope="module", params=["torch", pytest.param("sglang", marks=[pytest.mark.gpu, needs_gpu])]
)
def engine_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_path(engine_name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp(engine_name) / "tiny", **MODEL_SIZES[engine_name]
    )


@pytest.fixture(scope="module")
def engine(engine_name: str, model_path: Path) -> Iterator[Engine]:
    torch.set_num_threads(1)
    engine = make_engine(engine_name, str(model_path), **ENGINE_OPTIONS[engine_name])
    yield engine
    if hasattr(engine, "close"):
        engine.close()


@pytest.fixture(scope="module")
def reference(model_path: Path) -> torch.nn.Module:
    return load_causal_lm(model_path).eval()


def perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Exported weights of `model` plus noise large enough to change every distribution."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in state_dict_for_export(model).items()
    }


def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float, top_p: float
) -> np.ndarray:
    """log q(token) from one unpadded forward over prompt + tokens, nucleus built in numpy."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].double()
    scores = logits[len(prompt) - 1 : -1].numpy() / temperature
    result = []
    for row, token in zip(scores, tokens, strict=True):
        probs = np.exp(row - row.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        nucleus = order[before < top_p]
        if token not in nucleus:
            result.append(-np.inf)
            continue
        result.append(np.log(probs[token]) - np.log(probs[nucleus].sum()))
    return np.array(result)


def assert_matches_forward(
    generations: list[Generation], model: torch.nn.Module, params: SamplingParams, atol: float
) -> None:
    for prompt, gen in zip(PROMPTS, generations, strict=True):
        expected = reference_logprobs(
            model, prompt, gen.token_ids, params.temperature, params.top_p
        )
        np.testing.assert_allclose(gen.logprobs, expected, atol=atol)


def test_logprobs_equal_a_full_forward(
    engine: Engine, engine_name: str, reference: torch.nn.Module
) -> None:
    params = SamplingParams(max_new_tokens=12, seed=3)
    generations = engine.generate(PROMPTS, params)
    assert_matches_forward(generations, reference, params, ATOL[engine_name])
    for gen in generations:
        assert len(gen.token_ids) == len(gen.logprobs) == len(gen.versions) == 12
        assert gen.versions == [engine.version] * 12


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_logprobs_follow_temperature_and_top_p(
    engine: Engine, engine_name: str, reference: torch.nn.Module, top_p: float
) -> None:
    """An engine reports the truncated distribution's log-probs, or refuses to sample from it."""
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_p=top_p, seed=4)
    if engine_name == "sglang" and top_p < 1:
        with pytest.raises(ValueError, match="top_p"):
            engine.generate(PROMPTS, params)
        return
    generations = engine.generate(PROMPTS, params)
    assert_matches_forward(generations, reference, params, ATOL[engine_name])


def test_batch_matches_one_by_one(engine: Engine, engine_name: str) -> None:
    """Row i of a batch samples with seed + i, so batch composition does not change a row."""
    batched = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, seed=11))
    for row, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], SamplingParams(max_new_tokens=10, seed=11 + row))[0]
        assert alone.token_ids == batched[row].token_ids
        np.testing.assert_allclose(
            alone.logprobs, batched[row].logprobs, atol=ATOL[engine_name] / 10
        )


def test_seed_makes_generation_repeatable(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=16, seed=5)
    first, again = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    other = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, seed=6))
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert [g.token_ids for g in first] != [g.token_ids for g in other]


def test_max_new_tokens_gives_length_finish(engine: Engine) -> None:
    for gen in engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, seed=1)):
        assert len(gen.token_ids) == 5 and gen.finish_reason == "length"


def test_stop_token_ends_generation_inclusively(engine: Engine) -> None:
    free = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=20, seed=8))[0].token_ids
    cut = next(i for i, token in enumerate(free) if i >= 3 and token not in free[:i])
    stopped = engine.generate(
        PROMPTS[:1], SamplingParams(max_new_tokens=20, seed=8, stop_token_ids=[free[cut]])
    )[0]
    assert stopped.token_ids == free[: cut + 1]
    assert stopped.finish_reason == "stop"


def test_stop_string_ends_generation_at_the_completing_token(
    engine: Engine, model_path: Path
) -> None:
    tokenizer = load_tokenizer(model_path)
    free = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=20, seed=9))[0].token_ids
    stop = tokenizer.decode(free[5:7], skip_special_tokens=False)
    assert stop
    completing = next(
        i
        for i in range(len(free))
        if stop in tokenizer.decode(free[: i + 1], skip_special_tokens=False)
    )
    stopped = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=20, seed=9, stop=[stop]))[
        0
    ]
    assert stopped.token_ids == free[: completing + 1]
    assert stopped.finish_reason == "stop"


def test_load_weights_switches_the_sampling_model(
    engine: Engine, engine_name: str, model_path: Path, reference: torch.nn.Module
) -> None:
    new_model = load_causal_lm(model_path)
    load_exported_state_dict(new_model, perturbed(reference, seed=0))
    try:
        engine.load_weights(3, state_dict_for_export(new_model))
        assert engine.version == 3
        params = SamplingParams(max_new_tokens=8, seed=2)
        generations = engine.generate(PROMPTS, params)
        assert all(gen.versions == [3] * 8 for gen in generations)
        assert_matches_forward(generations, new_model.eval(), params, ATOL[engine_name])
    finally:
        engine.load_weights(0, state_dict_for_export(reference))


def play_turns(
    engine: Engine, contexts: dict[int, list[int]], turns: int, params: SamplingParams, seed: int
) -> Iterator[tuple[int, list[int], Generation]]:
    """Multi-turn episodes on the stepwise interface: key k starts at step k (so rows join at
    different times), and after each turn its context grows by the turn and a made-up
    observation. Yields (key, context of the turn, generation); the caller may swap weights or
    rewrite a context (compaction) between yields."""
    rng = np.random.default_rng(seed)
    played = dict.fromkeys(contexts, 0)
    step = 0
    while any(n < turns for n in played.values()):
        if step in contexts:
            engine.submit(step, contexts[step], dataclasses.replace(params, seed=seed + step))
        step += 1
        for key, gen in engine.step():
            yield key, contexts[key], gen
            played[key] += 1
            observation = rng.integers(5, 400, size=int(rng.integers(1, 20))).tolist()
            contexts[key] = contexts[key] + gen.token_ids + observation
            if played[key] < turns:
                turn_seed = seed + 100 * played[key] + key
                engine.submit(key, contexts[key], dataclasses.replace(params, seed=turn_seed))
            else:
                engine.release(key)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_multi_turn_logprobs_equal_a_full_forward_of_the_whole_context(
    engine: Engine, engine_name: str, reference: torch.nn.Module, top_p: float
) -> None:
    """Turn after turn, with episodes joining at different steps: each turn's log-probs equal an
    unpadded forward over everything the episode has seen, so a cache reused across turns (and
    the holes between rows) changes nothing."""
    if engine_name == "sglang" and top_p < 1:
        pytest.skip("sglang refuses top_p < 1")
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=top_p)
    contexts = {k: list(p) for k, p in enumerate(PROMPTS)}
    seen = 0
    for _, context, gen in play_turns(engine, contexts, turns=4, params=params, seed=20):
        expected = reference_logprobs(reference, context, gen.token_ids, 0.8, top_p)
        np.testing.assert_allclose(gen.logprobs, expected, atol=ATOL[engine_name])
        assert gen.versions == [engine.version] * len(gen.token_ids)
        seen += 1
    assert seen == 4 * len(PROMPTS)


def test_torch_engine_encodes_only_the_new_tokens_of_a_turn(
    engine: Engine, engine_name: str
) -> None:
    """Prefix reuse: a later turn runs only its new tokens through the model."""
    if engine_name != "torch":
        pytest.skip("sglang's radix cache is internal")
    params = SamplingParams(max_new_tokens=6)
    contexts = {0: list(PROMPTS[1])}
    encoded = []
    for _, context, _gen in play_turns(engine, contexts, turns=3, params=params, seed=3):
        encoded.append((engine.encoded_tokens, len(context)))
    # between the ends of turns t and t+1 the engine encoded the new context tokens and the
    # tokens fed while sampling: exactly the growth of the context, never the context again
    (e1, c1), (e2, c2), (e3, c3) = encoded
    assert e2 - e1 == c2 - c1 and e3 - e2 == c3 - c2


@pytest.mark.parametrize("on_swap", ["reencode", "keep"])
def test_mid_turn_swap_tags_tokens_with_the_version_that_sampled_them(
    engine_name: str, model_path: Path, reference: torch.nn.Module, on_swap: str
) -> None:
    """The swap lands after SWAP_AFTER steps of a turn; later tokens carry version 1.

    With "reencode" every token's log-prob is exactly its version's (the new weights re-encode
    the context); with "keep" the old keys/values stay, so post-swap log-probs match no single
    model's forward: finite, and different from both.
    """
    if engine_name != "torch":
        pytest.skip("sglang swaps weights between turns only")
    engine = make_engine("torch", str(model_path), on_swap=on_swap)
    new_model = load_causal_lm(model_path)
    load_exported_state_dict(new_model, perturbed(reference, seed=1))
    params = SamplingParams(max_new_tokens=20, seed=7)
    for row, prompt in enumerate(PROMPTS):
        engine.submit(row, prompt, dataclasses.replace(params, seed=7 + row))
    done: dict[int, Generation] = {}
    for step in range(20):
        if step == SWAP_AFTER:
            engine.load_weights(1, state_dict_for_export(new_model))
        done.update(engine.step())
    assert engine.steps == 20
    # reencode runs again what each row had cached at the swap: its prompt and the tokens fed
    cached_at_swap = sum(len(prompt) + SWAP_AFTER - 1 for prompt in PROMPTS)
    assert engine.reencoded_tokens == (cached_at_swap if on_swap == "reencode" else 0)
    for row, prompt in enumerate(PROMPTS):
        gen = done[row]
        assert gen.versions == [0] * SWAP_AFTER + [1] * (20 - SWAP_AFTER)
        old = reference_logprobs(reference, prompt, gen.token_ids, 1.0, 1.0)
        new = reference_logprobs(new_model.eval(), prompt, gen.token_ids, 1.0, 1.0)
        np.testing.assert_allclose(gen.logprobs[:SWAP_AFTER], old[:SWAP_AFTER], atol=1e-4)
        after = np.array(gen.logprobs[SWAP_AFTER:])
        if on_swap == "reencode":
            np.testing.assert_allclose(after, new[SWAP_AFTER:], atol=1e-4)
        else:
            assert np.isfinite(after).all()
            assert np.abs(after - old[SWAP_AFTER:]).min() > 1e-3
            assert np.abs(after - new[SWAP_AFTER:]).max() > 1e-3


def run_turn(engine: Engine, key: str, context: list[int], params: SamplingParams) -> Generation:
    engine.submit(key, context, params)
    while True:
        for done, gen in engine.step():
            if done == key:
                return gen


def test_a_context_that_does_not_extend_the_cache_starts_afresh(
    engine: Engine, engine_name: str, reference: torch.nn.Module
) -> None:
    """Compaction: the next turn's context is a summary, not the old context plus more. The
    engine must not reuse the old keys/values (log-probs equal a forward of the summary alone)."""
    params = SamplingParams(max_new_tokens=6, seed=4)
    first = run_turn(engine, "compacted", list(PROMPTS[1]), params)
    assert len(first.token_ids) == 6
    summary = [200, 201, 202, 203]
    gen = run_turn(engine, "compacted", summary, params)
    engine.release("compacted")
    expected = reference_logprobs(reference, summary, gen.token_ids, 1.0, 1.0)
    np.testing.assert_allclose(gen.logprobs, expected, atol=ATOL[engine_name])


def test_torch_engine_reuses_slots_and_bounds_its_cache(
    model_path: Path, engine_name: str, reference: torch.nn.Module
) -> None:
    """Episodes that end free their slot for the next key, and the KV buffer (grown by
    doubling) holds fewer than 2 x episodes in flight slots of fewer than 2 x (longest context
    + 1) columns: later waves of episodes do not grow it, and a reused slot's old keys/values
    never leak into the new episode."""
    if engine_name != "torch":
        pytest.skip("torch engine internals")
    engine = make_engine("torch", str(model_path))
    params = SamplingParams(max_new_tokens=5, temperature=0.9)
    longest = 0
    for wave in range(3):  # three generations of episodes through the same slots
        contexts = {k: list(p) + [wave + 1] for k, p in enumerate(PROMPTS)}
        for _, context, gen in play_turns(engine, contexts, turns=3, params=params, seed=wave):
            expected = reference_logprobs(reference, context, gen.token_ids, 0.9, 1.0)
            np.testing.assert_allclose(gen.logprobs, expected, atol=1e-4)
            longest = max(longest, len(context) + len(gen.token_ids))
        assert not engine.by_key and not engine.slots  # every key released: every slot free
    slots, heads, columns, dim = engine.buffers[0][0].shape
    assert len(PROMPTS) <= slots < 2 * len(PROMPTS)  # grown by doubling
    assert columns <= 2 * (longest + 1)  # grown by doubling, to the longest context seen
    per_column = 2 * len(engine.buffers) * heads * dim * engine.buffers[0][0].element_size()
    assert engine.kv_cache_bytes() == slots * columns * per_column


def test_submitting_a_busy_key_is_refused(engine: Engine) -> None:
    engine.submit("busy", [5, 6, 7], SamplingParams(max_new_tokens=4))
    try:
        with pytest.raises(ValueError, match="already has a turn in progress"):
            engine.submit("busy", [5, 6, 7], SamplingParams(max_new_tokens=4))
        with pytest.raises(ValueError, match=r"context has token ids outside"):
            engine.submit("other", [1, 10**6], SamplingParams())
    finally:
        engine.release("busy")


def test_bad_requests_are_refused(engine: Engine) -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        engine.generate([], SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty"):
        engine.generate([[1, 2], []], SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[0\] has token ids outside"):
        engine.generate([[1, 10**6]], SamplingParams())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("temperature", 0.0),
        ("temperature", float("nan")),
        ("top_p", 1.5),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
    ],
)
def test_sampling_params_are_validated(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_torch_engine_refuses_prompts_past_the_context(tmp_path: Path) -> None:
    engine = make_engine("torch", str(build_tiny_model(tmp_path / "tiny")))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([[5] * 1000], SamplingParams(max_new_tokens=30))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.submit("long", [5] * 1000, SamplingParams(max_new_tokens=30))


def test_unknown_engine_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match="'vllm' is unknown; choose one of \\('torch', 'sglang', 'simulated'\\)"
    ):
        make_engine("vllm", str(tmp_path))


def test_simulated_engine_reports_the_exact_uniform_logprob(tiny_model) -> None:
    """The pipeline-only engine still obeys the contract: exact log-probs, lengths, versions."""
    engine = make_engine(
        "simulated", str(tiny_model), median_token_latency_s=1e-4, latency_sigma=0.5, seed=1
    )
    engine.load_weights(3, {})
    gens = engine.generate([[1, 2, 3], [4]], SamplingParams(max_new_tokens=5))
    vocab = engine.vocab_size
    for g in gens:
        assert 1 <= len(g.token_ids) <= 5 and all(0 <= t < vocab for t in g.token_ids)
        assert g.logprobs == pytest.approx([-math.log(vocab)] * len(g.token_ids))
        assert g.versions == [3] * len(g.token_ids)


@pytest.mark.skipif(HAS_SGLANG, reason="sglang is installed")
def test_sglang_engine_without_sglang_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(ImportError, match=r"pip install 'asyncppo\[sglang\]' on a CUDA machine"):
        make_engine("sglang", str(tmp_path))


def test_an_emulated_mismatch_perturbs_every_float_weight_the_same_way_for_a_version() -> None:
    """`actor.weight_noise_std`: w*(1 + e), e ~ N(0, std^2) drawn from the version, so that every
    actor holding a version samples from the same off-policy weights; 0 leaves them alone."""
    from actors.engines.base import emulated_mismatch

    tensors = {"w": torch.linspace(-1, 1, 1000), "ids": torch.arange(10)}
    assert emulated_mismatch(tensors, 0.0, 3) is tensors
    a, b, c = (emulated_mismatch(tensors, 0.5, v) for v in (3, 3, 4))
    assert torch.equal(a["w"], b["w"]) and not torch.equal(a["w"], c["w"])
    assert torch.equal(a["ids"], tensors["ids"])  # integer buffers stay as they are
    ratio = (a["w"] / tensors["w"])[tensors["w"].abs() > 0.01] - 1
    assert 0.4 < float(ratio.std()) < 0.6 and abs(float(ratio.mean())) < 0.1
