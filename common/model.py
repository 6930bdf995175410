"""Loading Hugging Face causal LMs and tokenizers from local paths, and moving their weights.

Nothing is ever downloaded: a user's checkpoint is a local directory, and the built-in `tiny`
model (random init plus a byte-level BPE tokenizer trained here) is written to disk with
`save_pretrained` so that it goes through exactly the same loading path as a real checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

BUILTIN_MODELS = ("tiny",)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB_SIZE = 448

# ChatML: <|im_start|>role\ncontent<|im_end|>\n per message, then the assistant header on request.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a an and or not is are was be to of in on at for with from by as it this that what "
    "which who how many much more less than answer question number sum total add plus minus "
    "times divided equals result think step first then next last final yes no true false "
    "cat dog sun sky red blue green one two three four five six seven eight nine ten zero "
    "tool call search read write file open close done error output input value left right "
    "up down move go stop start end turn goal key door room box find take put use look "
    "hello world please thanks user assistant system"
)
_PUNCTUATION = ".,;:!?'\"()[]{}<>-_+*/=%#@&|\\$^~`"


def default_corpus() -> str:
    """A few thousand characters of arithmetic prompts, words, digits and punctuation.

    Deterministic, so every process that builds the tiny tokenizer gets the same vocabulary.
    """
    lines = [_WORDS, _WORDS.upper(), _WORDS.title(), _PUNCTUATION, "0123456789 " * 4]
    lines += [
        f"What is {a} + {b}? The answer is {a + b}." for a in range(0, 60, 7) for b in (3, 18, 42)
    ]
    lines += [
        f"Compute {a} * {b} = {a * b}; {a} - {b} = {a - b}."
        for a in range(2, 40, 5)
        for b in (4, 9)
    ]
    lines += [f"Step {i}: the {w} is {i % 3 == 0}." for i, w in enumerate(_WORDS.split()[:40])]
    return "\n".join(lines)


def _train_tokenizer(corpus: str) -> PreTrainedTokenizerFast:
    """Byte-level BPE: any byte string round-trips, so no input is ever out of vocabulary."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([corpus], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
    )


def missing_parts(path: str | Path) -> list[str]:
    """What a loadable model directory lacks: any of 'config.json', 'weights', 'tokenizer'."""
    path = Path(path)
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not (any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))):
        missing.append("weights")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        missing.append("tokenizer")
    return missing


def build_tiny_model(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    vocab_corpus: str | None = None,
    seed: int = 0,
) -> Path:
    """Write a random-init Llama and its tokenizer to `path`, unless a model is already there.

    Built in a temporary sibling directory and renamed into place, so processes racing to
    build the same path never see (or leave) a half-written model.
    """
    path = Path(path)
    if path.exists() and not missing_parts(path):
        return path
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(
            f"{path} exists but is not a complete model (missing {', '.join(missing_parts(path))}); "
            "remove it or point model.path elsewhere"
        )
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(default_corpus() if vocab_corpus is None else vocab_corpus)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=path.parent))
    try:
        tokenizer.save_pretrained(staging)
        model.save_pretrained(staging)
        os.rename(staging, path)  # atomic; fails if another process already put a model there
    except OSError:
        if missing_parts(path):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _require(path: str | Path, parts: list[str]) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {path} does not exist or is not a directory")
    lacking = [part for part in missing_parts(path) if part in parts]
    if lacking:
        raise FileNotFoundError(f"model path {path} is missing {', '.join(lacking)}")
    return path


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer at `path`, with a pad token (eos when the checkpoint defines none)."""
    path = _require(path, ["tokenizer"])
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load the tokenizer at {path}: {err}") from err
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer at {path} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """The causal LM at `path` in `dtype` on `device`."""
    path = _require(path, ["config.json", "weights"])
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"cannot load a causal LM from {path}: {err}") from err
    return model.to(device)


def ensure_model(path: str | Path, *, builtin: str | None) -> Path:
    """Build the named built-in model at `path` when it is missing; otherwise check it is complete."""
    if builtin is not None and builtin not in BUILTIN_MODELS:
        raise ValueError(
            f"model.builtin={builtin!r} is unknown; choose one of {BUILTIN_MODELS} or null"
        )
    if builtin == "tiny":
        return build_tiny_model(path)
    return _require(path, ["config.json", "weights", "tokenizer"])


def tied_keys(model: PreTrainedModel) -> set[str]:
    """State-dict keys that alias an earlier key's storage (e.g. a tied `lm_head.weight`).

    Also covers models whose config says tied but whose tensors were materialised separately
    (ZeRO-3 gathers), via the output embedding named in `tie_word_embeddings`.
    """
    seen: set[int] = set()
    tied = set()
    for name, tensor in model.state_dict().items():
        if tensor.numel() and tensor.data_ptr() in seen:
            tied.add(name)
        seen.add(tensor.data_ptr())
    output_embeddings = model.get_output_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and output_embeddings is not None:
        tied |= {
            f"{name}.weight"
            for name, module in model.named_modules()
            if module is output_embeddings
        }
    return tied


def state_dict_for_export(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies of the weights, with tied tensors sent once.

    Copies, so the learner can keep training while the export is still being sent.
    """
    tied = tied_keys(model)
    return {
        name: tensor.detach().to("cpu", copy=True).contiguous()
        for name, tensor in model.state_dict().items()
        if name not in tied
    }


def load_exported_state_dict(model: PreTrainedModel, tensors: dict[str, torch.Tensor]) -> None:
    """Load a `state_dict_for_export` dict into `model`; only tied keys may be absent."""
    expected = model.state_dict()
    not_tensors = sorted(
        name for name, value in tensors.items() if not isinstance(value, torch.Tensor)
    )
    if not_tensors:
        raise TypeError(f"weights must be torch.Tensor; not for {not_tensors[:5]}")
    missing = sorted(set(expected) - set(tensors) - tied_keys(model))
    unexpected = sorted(set(tensors) - set(expected))
    mismatched = [
        f"{name}: got {tuple(tensors[name].shape)}, model has {tuple(expected[name].shape)}"
        for name in sorted(set(tensors) & set(expected))
        if tensors[name].shape != expected[name].shape
    ]
    if missing or unexpected or mismatched:
        raise ValueError(
            f"weights do not fit the model: missing={missing[:5]} unexpected={unexpected[:5]} "
            f"shape mismatches={mismatched[:5]}"
        )
    model.load_state_dict(tensors, strict=False)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
