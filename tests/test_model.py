"""Built-in tiny model and the loading/export path that real checkpoints share."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from common.model import (
    SPECIAL_TOKENS,
    build_tiny_model,
    ensure_model,
    load_causal_lm,
    load_exported_state_dict,
    load_tokenizer,
    state_dict_for_export,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def test_tokenizer_round_trips_text_and_has_the_special_tokens(tiny: Path) -> None:
    tokenizer = load_tokenizer(tiny)
    text = "What is 17 + 25? The answer is 42. héllo ✓ {x: [1, 2]}"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert 384 <= len(tokenizer) <= 512
    for token in SPECIAL_TOKENS:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.eos_token == "<|eos|>"


def test_chat_template_is_chatml_with_generation_prompt(tiny: Path) -> None:
    tokenizer = load_tokenizer(tiny)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    closed = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not closed.endswith("assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3  # special tokens are single ids, not spelled out


def test_model_forward_has_vocab_logits_and_tied_embeddings(tiny: Path) -> None:
    tokenizer = load_tokenizer(tiny)
    model = load_causal_lm(tiny)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([tokenizer.encode("What is 1 + 1?", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_build_is_idempotent(tiny: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()}
    assert build_tiny_model(tiny, seed=123) == tiny
    assert {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()} == before
    assert not [p for p in tiny.parent.iterdir() if p.name.startswith(".tiny.building-")]


def test_same_seed_same_weights_other_seed_other_weights(tmp_path: Path) -> None:
    first = load_causal_lm(build_tiny_model(tmp_path / "a", seed=7)).state_dict()
    again = load_causal_lm(build_tiny_model(tmp_path / "b", seed=7)).state_dict()
    other = load_causal_lm(build_tiny_model(tmp_path / "c", seed=8)).state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_racing_builders_leave_one_complete_model(tmp_path: Path) -> None:
    target = tmp_path / "raced"
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = list(pool.map(lambda seed: build_tiny_model(target, seed=seed), range(3)))
    assert paths == [target] * 3
    assert load_causal_lm(target).config.vocab_size == len(load_tokenizer(target))
    assert [p.name for p in tmp_path.iterdir()] == ["raced"]


def test_refuses_to_build_over_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError, match="not a complete model"):
        build_tiny_model(tmp_path)


def test_bad_paths_name_what_is_missing(tmp_path: Path, tiny: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_causal_lm(tmp_path / "nowhere")
    only_tokenizer = tmp_path / "only_tokenizer"
    load_tokenizer(tiny).save_pretrained(only_tokenizer)
    with pytest.raises(FileNotFoundError, match="config.json, weights"):
        load_causal_lm(only_tokenizer)
    load_tokenizer(only_tokenizer)  # what is there still loads
    no_tokenizer = tmp_path / "no_tokenizer"
    load_causal_lm(tiny).save_pretrained(no_tokenizer)
    with pytest.raises(FileNotFoundError, match="missing tokenizer"):
        load_tokenizer(no_tokenizer)
    (no_tokenizer / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=str(no_tokenizer)):
        load_causal_lm(no_tokenizer)


def test_ensure_model_builds_tiny_and_validates_others(tmp_path: Path) -> None:
    built = ensure_model(tmp_path / "auto", builtin="tiny")
    assert ensure_model(built, builtin=None) == built
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ensure_model(tmp_path / "missing", builtin=None)
    with pytest.raises(ValueError, match="'huge' is unknown"):
        ensure_model(tmp_path / "x", builtin="huge")


def test_export_sends_tied_weights_once_as_cpu_copies(tiny: Path) -> None:
    model = load_causal_lm(tiny)
    exported = state_dict_for_export(model)
    assert "lm_head.weight" not in exported
    assert set(exported) == set(model.state_dict()) - {"lm_head.weight"}
    for name, tensor in exported.items():
        assert tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.requires_grad
        assert tensor.data_ptr() != model.state_dict()[name].data_ptr(), name
    exported["model.norm.weight"].add_(1.0)  # a copy: changing it leaves the model alone
    assert not torch.equal(exported["model.norm.weight"], model.state_dict()["model.norm.weight"])


def test_exported_weights_load_bit_for_bit_and_stay_tied(tmp_path: Path) -> None:
    source = load_causal_lm(build_tiny_model(tmp_path / "src", seed=1))
    target = load_causal_lm(build_tiny_model(tmp_path / "dst", seed=2))
    load_exported_state_dict(target, state_dict_for_export(source))
    target_state = target.state_dict()
    for name, tensor in source.state_dict().items():
        assert torch.equal(target_state[name], tensor), name
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()


def test_load_exported_rejects_weights_that_do_not_fit(tiny: Path) -> None:
    model = load_causal_lm(tiny)
    good = state_dict_for_export(model)
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"missing=\['model.norm.weight'\]"):
        load_exported_state_dict(model, missing)
    with pytest.raises(ValueError, match=r"unexpected=\['value_head.weight'\]"):
        load_exported_state_dict(model, {**good, "value_head.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="model.norm.weight: got \\(3,\\)"):
        load_exported_state_dict(model, {**good, "model.norm.weight": torch.zeros(3)})
    with pytest.raises(TypeError, match="model.norm.weight"):
        load_exported_state_dict(model, {**good, "model.norm.weight": [1.0]})
