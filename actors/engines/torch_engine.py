"""The torch engine: batched sampling that reports, per token, the exact log-prob it was drawn with.

The learner's importance weights (π_prox / μ) are only as good as μ, so every engine returns
the log-probability of each sampled token under the distribution it was actually sampled
from: softmax(logits / T), restricted to the top-p nucleus and renormalised.

Weight swaps may happen mid-generation (`poll_weights`). TorchEngine keeps the KV cache that
the old weights computed, as real asynchronous systems do: tokens sampled after the swap use
the new weights for the new positions but attend to keys/values of the old ones. Each token is
tagged with the version of the weights whose forward pass produced its distribution.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable

import torch

from actors.engines.base import Generation, SamplingParams, check_prompts, completes_stop
from common.model import load_causal_lm, load_exported_state_dict, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        outputs = [
            Generation([], [], [], "length", params.temperature, params.top_p) for _ in prompts
        ]
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
