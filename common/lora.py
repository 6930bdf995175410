"""LoRA adapters on the wire: what a LoRA learner publishes instead of the model, and how a
receiver merges it into the base weights it already holds.

An adapter version is an ordinary weight version (``common.weights``) whose manifest carries
``"adapter": {"base": <fingerprint of the base weights>}`` and whose tensors come in pairs, one
pair per adapted weight W (a Hugging Face state-dict key of the base model):

    W.lora_A  [r, in]     W.lora_B  [out, r], already multiplied by the scale alpha / r

so the weight the policy computes with is W_base + lora_B · lora_A (LoRA, Hu et al. 2021,
eq. 3). A receiver needs neither peft nor the adapter's config. Under LoRA nothing else in the
policy trains (the value head of a shared critic is not part of the policy), so nothing else is
sent. Imports torch lazily: the broker validates manifests without it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

FACTORS = ("lora_A", "lora_B")
# peft's state-dict key of a factor: [prefix.]base_model.model.<module>.lora_A.default.weight
PEFT_KEY = re.compile(
    r"(?:.*?\.)?base_model\.model\.(?P<module>.+)\.(?P<factor>lora_[AB])\.default\.weight"
)


class AdapterRefused(ValueError):
    """An adapter this receiver cannot apply: another base model, or tensors that are not pairs."""


class BaseWeights:
    """What an engine knows of the base model adapters apply to: whether it still holds it (no
    full version replaced it) and its fingerprint, computed once, at the first adapter."""

    def __init__(self, compute: Callable[[], str]):
        self.compute, self.fingerprint, self.replaced = compute, None, False

    def check(self, version: int, base: str) -> None:
        """``AdapterRefused`` unless an adapter for ``base`` applies to the weights held."""
        if self.replaced:
            raise AdapterRefused(
                f"adapter of version {version}: this engine holds the full weights of an earlier "
                "version, not a base model to apply it to (restart the actor)"
            )
        if self.fingerprint is None:
            self.fingerprint = self.compute()
        if base != self.fingerprint:
            raise AdapterRefused(
                f"adapter of version {version} is for base model {base[:12]}, this engine holds "
                f"{self.fingerprint[:12]}: start the actor on the learner's model.path"
            )


def fingerprint(model: PreTrainedModel) -> str:
    """sha256 over every exported weight's name, shape and bytes rounded to bfloat16.

    Names and order as ``state_dict_for_export`` (tied tensors once); rounding to bf16 (exact,
    round-to-nearest-even) makes a float32 and a bfloat16 load of the same checkpoint agree, so a
    bf16 learner and an fp32 actor on one base model see the same fingerprint.
    """
    import torch

    from common.model import tied_keys

    tied = tied_keys(model)
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if name in tied:
            continue
        digest.update(f"{name}:{','.join(map(str, tensor.shape))};".encode())
        rounded = tensor.detach().to("cpu", torch.bfloat16).contiguous()
        digest.update(memoryview(rounded.view(torch.uint8).numpy()))
    return digest.hexdigest()


def adapter_tensors(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """peft's state dict (any prefix) -> the wire tensors: ``W.lora_A`` and ``W.lora_B·scale``,
    detached CPU copies (the learner keeps training while they are sent)."""
    out = {}
    for key, tensor in state.items():
        match = PEFT_KEY.fullmatch(key)
        if match is None:
            continue
        factor = tensor.detach().to("cpu", copy=True).contiguous()
        if match["factor"] == "lora_B":
            factor = (factor.float() * scale).to(tensor.dtype)
        out[f"{match['module']}.weight.{match['factor']}"] = factor
    return out


def factor_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The wire tensors -> {W: (A, B)}; ``AdapterRefused`` names a tensor that is not half of a
    pair or a pair whose shapes do not multiply."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        weight, _, factor = name.rpartition(".")
        if factor not in FACTORS or not weight:
            raise AdapterRefused(
                f"adapter tensor {name!r}: expected a name ending in .lora_A or .lora_B"
            )
        pairs.setdefault(weight, {})[factor] = tensor
    out = {}
    for weight, pair in pairs.items():
        if set(pair) != set(FACTORS):
            raise AdapterRefused(
                f"adapter for {weight!r}: has {sorted(pair)}, needs lora_A and lora_B"
            )
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterRefused(
                f"adapter for {weight!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                "are not [r, in] and [out, r]"
            )
        out[weight] = (a, b)
    return out


def merged(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """W = W_base + B·A (LoRA eq. 3; B carries alpha/r), summed in float32, in W_base's dtype."""
    import torch

    delta = b.to(base.device, torch.float32) @ a.to(base.device, torch.float32)
    return (base.float() + delta).to(base.dtype)


def apply_adapter(
    model: torch.nn.Module,
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
    base: dict[str, torch.Tensor],
) -> None:
    """Set every adapted weight W of ``model`` to base[W] + B·A, in place.

    ``base`` holds the base values of the weights adapters have touched: a weight adapted for the
    first time is copied into it before it changes, and one an earlier adapter touched but this
    one does not goes back to its base value. So only the adapted weights are kept twice.
    """
    params = dict(model.named_parameters())
    unknown = sorted(set(pairs) - set(params))
    if unknown:
        raise AdapterRefused(f"adapter for weights the model does not have: {unknown[:5]}")
    for name, (a, b) in pairs.items():  # all checked before any weight changes
        if params[name].shape != (b.shape[0], a.shape[1]):
            raise AdapterRefused(
                f"adapter for {name!r}: B·A is {b.shape[0]}x{a.shape[1]}, the weight is "
                f"{tuple(params[name].shape)}"
            )
    for name, (a, b) in pairs.items():
        if name not in base:
            base[name] = params[name].detach().clone()
        params[name].data.copy_(merged(base[name], a, b))
    for name in set(base) - set(pairs):
        params[name].data.copy_(base[name])


def save_peft(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], directory: str | Path) -> None:
    """The pairs as a peft adapter directory (adapter_config.json, adapter_model.safetensors),
    for engines that load adapters from disk (sglang). B already carries the scale, so the
    config says lora_alpha = r (scale 1)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, modules, rank = {}, set(), 0
    for weight, (a, b) in pairs.items():
        module = weight.removesuffix(".weight")
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
        modules.add(module.rpartition(".")[2])
        rank = max(rank, a.shape[0])
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(modules),
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
