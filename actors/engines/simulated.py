"""The simulated engine: no model, uniform tokens and a long-tailed latency (pipeline benchmarks)."""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from actors.engines.base import Generation, SamplingParams, check_prompts, completes_stop
from common.model import load_tokenizer


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
        outputs = [
            Generation([], [], [], "length", params.temperature, params.top_p) for _ in prompts
        ]
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
