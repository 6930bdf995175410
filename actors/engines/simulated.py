"""The simulated engine: no model, uniform tokens and a long-tailed latency (pipeline benchmarks)."""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.engines.base import Engine, Generation, SamplingParams, add_token, check_tokens
from common.model import load_tokenizer


@dataclass
class _Turn:
    params: SamplingParams
    gen: Generation
    rng: random.Random
    latency: float  # seconds per token of this turn
    due: float  # monotonic time of its next token


class SimulatedEngine(Engine):
    """No model: uniform random tokens and a long-tailed latency, to measure the pipeline alone.

    Every token is drawn uniformly from the model's vocabulary of V ids, so its log-prob is
    exactly −log V. Each turn draws one per-token latency ℓ ~ LogNormal(log m, σ²) (median m, a
    heavy right tail: some requests are stragglers, as with long prompts or a busy node) and
    yields a token every ℓ seconds, concurrently with the other turns, as a server batching many
    requests would: `step` sleeps until the next token is due. Weights are not applied, only
    their version recorded.
    """

    def __init__(
        self,
        model_path: str,
        *,
        median_token_latency_s: float = 0.02,
        latency_sigma: float = 1.0,
        seed: int | None = None,
    ) -> None:
        if not median_token_latency_s > 0 or not latency_sigma >= 0:
            raise ValueError(
                f"median_token_latency_s must be > 0 and latency_sigma >= 0, got "
                f"{median_token_latency_s!r}, {latency_sigma!r}"
            )
        config = json.loads((Path(model_path) / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        self.tokenizer = load_tokenizer(model_path)  # decodes stop strings, as the real engines do
        self.median_token_latency_s, self.latency_sigma = median_token_latency_s, latency_sigma
        self.rng = random.Random(seed)
        self.turns: dict[Hashable, _Turn] = {}
        self.version = 0

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Adopt the version; the tensors are not used (there is no model)."""
        self.version = version

    def load_adapter(self, version: int, tensors: dict[str, torch.Tensor], base: str) -> None:
        """Adopt the version, as for full weights."""
        self.version = version

    def submit(self, key: Hashable, context: list[int], params: SamplingParams) -> None:
        check_tokens(context, self.vocab_size, "context")
        if key in self.turns:
            raise ValueError(f"key {key!r} already has a turn in progress")
        rng = self.rng if params.seed is None else random.Random(params.seed)
        latency = rng.lognormvariate(math.log(self.median_token_latency_s), self.latency_sigma)
        gen = Generation([], [], [], "length", params.temperature, params.top_p)
        self.turns[key] = _Turn(params, gen, rng, latency, time.monotonic() + latency)

    def release(self, key: Hashable) -> None:
        self.turns.pop(key, None)

    def step(self) -> list[tuple[Hashable, Generation]]:
        """Wait for the next due token; every turn whose token is due gets one (log-prob −log V)."""
        if not self.turns:
            return []
        time.sleep(max(0.0, min(turn.due for turn in self.turns.values()) - time.monotonic()))
        now, logprob = time.monotonic(), -math.log(self.vocab_size)
        finished = []
        for key, turn in list(self.turns.items()):
            if turn.due > now:
                continue
            turn.due += turn.latency
            token = turn.rng.randrange(self.vocab_size)
            if add_token(turn.gen, token, logprob, self.version, self.tokenizer, turn.params):
                finished.append((key, turn.gen))
                del self.turns[key]
        return finished
