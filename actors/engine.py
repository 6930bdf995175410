"""Inference engines: batched sampling that reports, per token, the exact log-prob it was drawn with.

The learner's importance weights (π_prox / μ) are only as good as μ, so every engine returns
the log-probability of each sampled token under the distribution it was actually sampled
from: softmax(logits / T), restricted to the top-p nucleus and renormalised.

Weight swaps may happen mid-generation (`poll_weights`). TorchEngine keeps the KV cache that
the old weights computed, as real asynchronous systems do: tokens sampled after the swap use
the new weights for the new positions but attend to keys/values of the old ones. Each token is
tagged with the version of the weights whose forward pass produced its distribution.
"""

from __future__ import annotations

import json
import math
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerBase

from common.model import load_causal_lm, load_exported_state_dict, load_tokenizer

ENGINE_NAMES = ("torch", "sglang", "simulated")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


class Engine(Protocol):
    version: int

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        poll_weights: Callable[[], None] | None = None,
    ) -> list[Generation]: ...

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None: ...


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    """Reject empty batches, empty prompts and token ids outside the vocabulary."""
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids")
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt):
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size})")


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log q over the vocabulary: q = softmax(logits / T) kept on the top-p nucleus, renormalised.

    The nucleus is the smallest set of most likely tokens whose mass reaches top_p: a token is
    kept when the mass strictly before it (in descending order) is below top_p.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    sorted_p = sorted_logp.exp()
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    sorted_logp = sorted_logp.masked_fill(mass_before >= top_p, -math.inf)
    truncated = torch.full_like(logp, -math.inf).scatter(-1, order, sorted_logp)
    return torch.log_softmax(truncated, dim=-1)  # log q = log p − log Σ_nucleus p


def sample(logp: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row by inverse-CDF sampling, row i driven only by generators[i].

    Per-row streams make a row's draw independent of what else is in the batch.
    """
    uniforms = torch.stack([torch.rand((), generator=g, device=logp.device) for g in generators])
    cdf = logp.exp().cumsum(dim=-1)
    # first index whose cumulative mass exceeds u·total: zero-probability tokens are never chosen
    index = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1), right=True)
    return index.squeeze(-1).clamp(max=logp.shape[-1] - 1)


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


class TorchEngine:
    """Any Hugging Face causal LM from a local path, batched with a KV cache (CPU default)."""

    def __init__(
        self, model_path: str, *, dtype: str = "float32", device: str = "cpu", poll_every: int = 8
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is unknown; choose one of {sorted(DTYPES)}")
        if not isinstance(poll_every, int) or poll_every < 1:
            raise ValueError(f"poll_every must be an int >= 1, got {poll_every!r}")
        self.device = torch.device(device)
        self.model = load_causal_lm(model_path, dtype=DTYPES[dtype], device=self.device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = load_tokenizer(model_path)
        self.poll_every = poll_every
        self.version = 0

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Swap in an exported state dict (tied tensors once) and adopt its version."""
        load_exported_state_dict(self.model, tensors)
        self.version = version

    def _check_context(self, prompts: list[list[int]], params: SamplingParams) -> None:
        limit = getattr(self.model.config, "max_position_embeddings", None)
        longest = max(len(p) for p in prompts)
        if limit is not None and longest + params.max_new_tokens > limit:
            raise ValueError(
                f"longest prompt ({longest} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the model's max_position_embeddings ({limit})"
            )

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        poll_weights: Callable[[], None] | None = None,
    ) -> list[Generation]:
        """Sample continuations of left-padded `prompts`, one batched forward per new token."""
        check_prompts(prompts, self.model.config.vocab_size)
        self._check_context(prompts, params)
        batch, width = len(prompts), max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((batch, width), pad, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        base_seed = secrets.randbits(62) if params.seed is None else params.seed
        generators = [
            torch.Generator(device=self.device).manual_seed(base_seed + row) for row in range(batch)
        ]
        outputs = [Generation([], [], [], "length") for _ in prompts]
        active = list(range(batch))
        cache = None
        for step in range(params.max_new_tokens):
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache, forward_version = out.cache, self.version
            logp = sampling_logprobs(out.logits[:, -1], params.temperature, params.top_p)
            tokens = sample(logp, generators)
            token_ids = tokens.tolist()
            token_logprobs = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
            for row in active:
                gen = outputs[row]
                gen.token_ids.append(token_ids[row])
                gen.logprobs.append(token_logprobs[row])
                gen.versions.append(forward_version)
                if completes_stop(self.tokenizer, gen.token_ids, params):
                    gen.finish_reason = "stop"
            # finished rows stay in the batch (the cache is shared) but are no longer extended
            active = [row for row in active if outputs[row].finish_reason != "stop"]
            if not active or step + 1 == params.max_new_tokens:
                break
            if poll_weights is not None and (step + 1) % self.poll_every == 0:
                poll_weights()
            input_ids = tokens.unsqueeze(-1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=-1)
            position_ids = position_ids[:, -1:] + 1
        return outputs


class SimulatedEngine:
    """No model: uniform random tokens and a long-tailed latency, to measure the pipeline alone.

    Every token is drawn uniformly from the model's vocabulary of V ids, so its log-prob is
    exactly −log V. Each `generate` call draws one per-token latency ℓ ~ LogNormal(log m, σ²)
    (median m, a heavy right tail: some requests are stragglers, as with long prompts or a busy
    node) and sleeps ℓ per decoding step. Weights are not applied, only their version recorded.
    """

    def __init__(
        self,
        model_path: str,
        *,
        poll_every: int = 8,
        median_token_latency_s: float = 0.02,
        latency_sigma: float = 1.0,
        seed: int | None = None,
    ) -> None:
        if not isinstance(poll_every, int) or poll_every < 1:
            raise ValueError(f"poll_every must be an int >= 1, got {poll_every!r}")
        if not median_token_latency_s > 0 or not latency_sigma >= 0:
            raise ValueError(
                f"median_token_latency_s must be > 0 and latency_sigma >= 0, got "
                f"{median_token_latency_s!r}, {latency_sigma!r}"
            )
        config = json.loads((Path(model_path) / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        self.tokenizer = load_tokenizer(model_path)  # decodes stop strings, as the real engines do
        self.poll_every = poll_every
        self.median_token_latency_s, self.latency_sigma = median_token_latency_s, latency_sigma
        self.rng = random.Random(seed)
        self.version = 0

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Adopt the version; the tensors are not used (there is no model)."""
        self.version = version

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        poll_weights: Callable[[], None] | None = None,
    ) -> list[Generation]:
        """Uniform tokens (log-prob −log V), one latency sleep per step, stops as TorchEngine."""
        check_prompts(prompts, self.vocab_size)
        rng = self.rng if params.seed is None else random.Random(params.seed)
        latency = rng.lognormvariate(math.log(self.median_token_latency_s), self.latency_sigma)
        logprob = -math.log(self.vocab_size)  # log(1/V): the exact sampling log-prob
        outputs = [Generation([], [], [], "length") for _ in prompts]
        active = list(range(len(prompts)))
        for step in range(params.max_new_tokens):
            time.sleep(latency)
            for row in active:
                gen = outputs[row]
                gen.token_ids.append(rng.randrange(self.vocab_size))
                gen.logprobs.append(logprob)
                gen.versions.append(self.version)
                if completes_stop(self.tokenizer, gen.token_ids, params):
                    gen.finish_reason = "stop"
            active = [row for row in active if outputs[row].finish_reason != "stop"]
            if not active:
                break
            if poll_weights is not None and (step + 1) % self.poll_every == 0:
                poll_weights()
        return outputs


def make_engine(name: str, model_path: str, **kwargs: object) -> Engine:
    """The engine called `name` (one of ENGINE_NAMES) on the model at `model_path`."""
    if name == "torch":
        return TorchEngine(model_path, **kwargs)
    if name == "simulated":
        return SimulatedEngine(model_path, **kwargs)
    if name == "sglang":
        from actors.sglang_engine import SGLangEngine  # sglang itself is imported only on use

        return SGLangEngine(model_path, **kwargs)
    raise ValueError(f"engine {name!r} is unknown; choose one of {ENGINE_NAMES}")
