"""The trainable models: the policy (a causal LM) and the critic (a scalar value per position).

Position convention used everywhere in the learner: output index t is the state after reading
tokens[0..t]. So token t's log-prob comes from logits[t-1], and the value of the state in which
token t is chosen is value_out[t-1]. ``shift_to_tokens`` applies that shift once.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel

from common.config import ConfigError, LoraConfig
from common.lora import fingerprint

FULL = LoraConfig()  # rank 0: every weight trains


def with_adapters(model: PreTrainedModel, lora: LoraConfig) -> nn.Module:
    """``learner.lora.rank > 0``: the model frozen, with trainable LoRA adapters (peft) on
    ``lora.target_modules``; rank 0 returns it unchanged."""
    if lora.rank == 0:
        return model
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as err:
        raise ImportError("learner.lora.rank > 0 needs peft: pip install 'asyncppo[lora]'") from err

    targets = lora.target_modules
    try:
        return get_peft_model(
            model,
            PeftLoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules="all-linear" if targets == ["all-linear"] else targets,
            ),
        )
    except ValueError as err:  # peft: no module matches, or one it cannot adapt
        linear = sorted(
            {
                name.rpartition(".")[2]
                for name, m in model.named_modules()
                if isinstance(m, nn.Linear)
            }
        )
        raise ConfigError(
            f"learner.lora.target_modules {targets}: {err} (this model's linear layers: "
            f"{', '.join(linear)}; or all-linear)"
        ) from err


def causal_lm(path: str, dtype: torch.dtype, lora: LoraConfig) -> tuple[nn.Module, str | None]:
    """The policy's language model (with adapters under LoRA) and, under LoRA, the fingerprint of
    its base weights, taken before any adapter exists: published adapters name it."""
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    base = fingerprint(model) if lora.rank else None
    return with_adapters(model, lora), base


class ValueHead(nn.Module):
    """A zero-initialised scalar head: the critic starts predicting 0 for every state."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden).squeeze(-1).float()


class Critic(nn.Module):
    """``critic.kind: separate``: its own transformer trunk + head, initialised from the policy
    checkpoint (zero head) or, with ``init``, from a fitted critic (``save_critic``: trunk and
    head, e.g. ``asyncppo critic``)."""

    def __init__(
        self, path: str, dtype: torch.dtype, lora: LoraConfig = FULL, init: str | None = None
    ):
        super().__init__()
        if init is not None:
            _check_critic_init(init, path)
        trunk = AutoModel.from_pretrained(init or path, local_files_only=True, dtype=dtype)
        self.head = ValueHead(trunk.config.hidden_size).to(dtype)  # trains fully under LoRA too
        if init is not None:
            self.head.load_state_dict(load_file(Path(init) / VALUE_HEAD))
        self.trunk = with_adapters(trunk, lora)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """V after every token of right-padded rows (``Batch.inputs``: no mask needed)."""
        return self.head(self.trunk(input_ids=input_ids).last_hidden_state)


VALUE_HEAD = "value_head.safetensors"


def save_critic(critic: Critic, out: str | Path) -> None:
    """A critic as ``Critic(..., init=out)`` loads it: the trunk a Hugging Face directory, the
    head beside it."""
    out = Path(out)
    critic.trunk.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in critic.head.state_dict().items()}, out / VALUE_HEAD)


def _check_critic_init(init: str, policy_path: str) -> None:
    """``learner.critic.init`` must be a saved critic of the policy's architecture: the critic
    reads the policy's tokens, so a mismatch is an error here, not wrong values later."""
    where = f"learner.critic.init {init!r}"
    lacking = [f for f in ("config.json", VALUE_HEAD) if not (Path(init) / f).is_file()]
    if lacking:
        raise ConfigError(
            f"{where}: missing {', '.join(lacking)} (write one with `asyncppo critic`)"
        )
    try:
        ours = json.loads((Path(init) / "config.json").read_text())
        theirs = json.loads((Path(policy_path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: unreadable config.json: {exc}") from exc
    for key in ("model_type", "vocab_size", "hidden_size"):
        if ours.get(key) != theirs.get(key):
            raise ConfigError(
                f"{where}: {key} {ours.get(key)!r} does not match model.path's {theirs.get(key)!r}"
            )


class PolicyWithValue(nn.Module):
    """``critic.kind: shared``: a value head on the policy's last hidden state (lighter, one model)."""

    def __init__(self, path: str, dtype: torch.dtype, lora: LoraConfig = FULL):
        super().__init__()
        self.policy, self.base_fingerprint = causal_lm(path, dtype, lora)
        self.head = ValueHead(self.policy.config.hidden_size).to(dtype)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.policy(input_ids=input_ids, output_hidden_states=True)
        return out.logits, self.head(out.hidden_states[-1])


class Policy(nn.Module):
    """``critic.kind: separate`` or GRPO: the causal LM alone, returning logits."""

    def __init__(self, path: str, dtype: torch.dtype, lora: LoraConfig = FULL):
        super().__init__()
        self.policy, self.base_fingerprint = causal_lm(path, dtype, lora)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.policy(input_ids=input_ids).logits


def _log_softmax(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """log pi(. | tokens_<t) for t >= 1, [B, T-1, V], at each row's sampling temperature."""
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(logits.device, torch.float32)[:, None, None]
    return torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float | torch.Tensor
) -> torch.Tensor:
    """log pi(token_t | tokens_<t) for every position t >= 1, aligned to tokens; position 0 gets 0.

    The logits are divided by the sampling temperature each row was sampled with (a float for
    all rows, or a [B] tensor: segments carry their own), so the learner scores every token under
    the distribution its engine sampled it from.
    """
    picked = _log_softmax(logits, temperature).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def token_logprobs_and_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs`` and the entropy H_t = -Σ_v pi(v) log pi(v) of the distribution token t
    was chosen from, aligned the same way, from one log-softmax (the scoring pass needs both)."""
    logp = _log_softmax(logits, temperature)
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = torch.special.entr(logp.exp()).sum(-1)  # -p log p, 0 where p = 0
    pad = lambda x: torch.nn.functional.pad(x, (1, 0))  # noqa: E731
    return pad(picked), pad(entropy)


def shift_to_tokens(values: torch.Tensor) -> torch.Tensor:
    """value_out[t-1] -> V[t]: the value of the state in which token t is chosen (V[0] = 0)."""
    return torch.nn.functional.pad(values[:, :-1], (1, 0))
