"""What every inference engine shares: sampling parameters in, generations out, the Engine interface.

Engines are stepwise, so that an actor can keep many episodes in flight, each at its own turn
(continuous batching): ``submit`` a turn under a key (the episode), call ``step`` until that key's
turn comes back finished, ``submit`` the next turn's context under the same key (an engine may
keep the key's KV cache and encode only the new tokens), and ``release`` the key when the episode
ends. ``generate`` runs a batch of one-turn requests to completion on top of these.

Every engine returns, per sampled token, the log-probability under the distribution it was
actually sampled from (softmax(logits / T), restricted to the top-p nucleus and renormalised),
the version of the weights that sampled it, and the temperature and top-p it used: these facts
travel with the tokens to the learner, which scores with them.
"""

from __future__ import annotations

import math
import secrets
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedTokenizerBase

from common.lora import AdapterRefused


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)  # checked on the decoded text of the new tokens
    stop_token_ids: list[int] = field(default_factory=list)  # e.g. eos / <|im_end|>
    seed: int | None = None  # row i of a batch samples with seed + i

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}"
            )
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(
                f"SamplingParams.temperature must be finite and > 0 (greedy has no log-probs), "
                f"got {self.temperature!r}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}"
            )


@dataclass
class Generation:
    token_ids: list[int]  # sampled tokens, in order (the stop token included if one ended it)
    logprobs: list[float]  # log-prob of each token under the distribution it was sampled from
    versions: list[int]  # policy version of the weights that sampled each token
    finish_reason: str  # "stop" | "length"
    temperature: float  # what the tokens were sampled with: it travels on with them
    top_p: float


def emulated_mismatch(
    tensors: dict[str, torch.Tensor], std: float, seed: int
) -> dict[str, torch.Tensor]:
    """``actor.weight_noise_std``: every floating weight w as w*(1 + e), e ~ N(0, std^2), drawn
    from ``seed`` (the version), so that every actor samples from the same perturbed policy. The
    size of a real engine mismatch (bf16, another kernel) is what an experiment dials with it."""
    if not std:
        return tensors
    gen = torch.Generator().manual_seed(seed)
    return {
        name: t * (1 + std * torch.randn(t.shape, generator=gen, dtype=t.dtype))
        if t.is_floating_point()
        else t
        for name, t in tensors.items()
    }


class Engine(ABC):
    """A turn is submitted under a key; ``step`` advances every submitted turn and returns those
    that finished. Weights may be swapped between steps; each token carries the version of the
    weights whose forward produced its distribution."""

    version: int
    vocab_size: int
    # What the engine ran, for the actor's metrics (engines that do not count leave them at 0):
    steps: int = 0  # steps that sampled (one token for every turn in progress)
    forwards: int = 0  # model forwards
    encoded_tokens: int = 0  # context tokens run through the model
    reencoded_tokens: int = 0  # of those, tokens encoded again because a weight swap dropped them

    @abstractmethod
    def submit(self, key: Hashable, context: list[int], params: SamplingParams) -> None:
        """Start a turn: sample a continuation of `context` (the whole context so far)."""

    @abstractmethod
    def step(self) -> list[tuple[Hashable, Generation]]:
        """Advance every submitted turn; return the turns that finished, with their keys."""

    @abstractmethod
    def release(self, key: Hashable) -> None:
        """Forget `key` and what the engine keeps for it (its KV cache); unknown keys are ignored."""

    @abstractmethod
    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None: ...

    def load_adapter(self, version: int, tensors: dict[str, torch.Tensor], base: str) -> None:
        """Apply a LoRA adapter (``common.lora``) for the base model with fingerprint ``base``."""
        raise AdapterRefused(f"{type(self).__name__} cannot apply LoRA adapters")

    def load_version(
        self, manifest: dict, tensors: dict[str, torch.Tensor], weight_noise_std: float = 0.0
    ) -> None:
        """A fetched version, full weights or an adapter as its manifest says. Raises ValueError
        (``AdapterRefused`` among them) for weights this engine cannot take; it keeps its own."""
        if "adapter" in manifest:
            self.load_adapter(manifest["version"], tensors, manifest["adapter"]["base"])
        else:
            version = manifest["version"]
            self.load_weights(version, emulated_mismatch(tensors, weight_noise_std, version))

    def kv_cache_bytes(self) -> int:
        """Bytes of KV cache this process holds for keys in flight (0: none, or kept elsewhere)."""
        return 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One turn for each prompt, run to completion as one batch; row i samples with seed + i,
        so a row's tokens do not depend on what else is in the batch."""
        check_prompts(prompts, self.vocab_size)
        base_seed = secrets.randbits(62) if params.seed is None else params.seed
        keys = [(object(), row) for row in range(len(prompts))]  # never equal to a caller's key
        for key, prompt in zip(keys, prompts, strict=True):
            self.submit(key, prompt, replace(params, seed=base_seed + key[1]))
        done: dict[Hashable, Generation] = {}
        while len(done) < len(keys):
            for key, gen in self.step():
                done[key] = gen
                self.release(key)
        return [done[key] for key in keys]


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    """Reject empty batches, empty prompts and token ids outside the vocabulary."""
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, prompt in enumerate(prompts):
        check_tokens(prompt, vocab_size, f"prompts[{i}]")


def check_tokens(tokens: list[int], vocab_size: int, where: str) -> None:
    """Reject an empty context and token ids outside the vocabulary; `where` names the input."""
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{where} must be a non-empty list of token ids")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in tokens):
        raise ValueError(f"{where} has token ids outside [0, {vocab_size})")


def completes_stop(
    tokenizer: PreTrainedTokenizerBase, token_ids: list[int], params: SamplingParams
) -> bool:
    """True when the newest token is a stop token or completes a stop string.

    Only the tail that can hold a stop string is decoded: a character is at most 4 UTF-8 bytes
    and a byte-level token at least one byte.
    """
    if token_ids[-1] in params.stop_token_ids:
        return True
    if not params.stop:
        return False
    window = 4 * max(len(s) for s in params.stop)
    text = tokenizer.decode(token_ids[-window:], skip_special_tokens=False)
    return any(s in text for s in params.stop)


def add_token(
    gen: Generation,
    token: int,
    logprob: float,
    version: int,
    tokenizer: PreTrainedTokenizerBase,
    params: SamplingParams,
) -> bool:
    """Append one sampled token to its turn; True when the turn ends with it (a stop, or the
    `max_new_tokens` budget)."""
    gen.token_ids.append(token)
    gen.logprobs.append(logprob)
    gen.versions.append(version)
    if completes_stop(tokenizer, gen.token_ids, params):
        gen.finish_reason = "stop"
    return gen.finish_reason == "stop" or len(gen.token_ids) == params.max_new_tokens
