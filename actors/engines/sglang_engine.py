"""The Engine interface on sglang's offline `sglang.Engine` (GPU).

Differences from TorchEngine, all forced by sglang and all visible to callers:

* Log-probs: sglang reports log softmax(logits / T) of the sampled token, before top-p
  filtering (its Sampler computes them so, unless SGLANG_RETURN_ORIGINAL_LOGPROB is set, which
  must stay unset). That is the sampling distribution only when top_p = 1, so top_p < 1 is
  refused rather than sending the learner a wrong μ.
* Continuous batching is sglang's own: `step` sends every submitted turn as one
  `sglang.Engine.generate` call (sglang's scheduler batches them token by token and its radix
  cache reuses the prefix an episode's earlier turns left behind) and returns them all finished.
  A turn therefore runs under one version: weights swap between steps, never inside a turn, and
  sglang flushes its prefix cache on a weight update, so the next turns are re-encoded by the new
  weights (as TorchEngine's default ``on_swap="reencode"``).
* Stops: besides `stop_token_ids`, sglang also ends a sequence at the model's own eos token.
* Seeds: row i gets `sampling_seed = seed + i`; sglang honours it only when started with
  `enable_deterministic_inference=True`.
"""

from __future__ import annotations

import secrets
from collections.abc import Hashable

import torch
from transformers import AutoConfig

from actors.engines.base import Engine, Generation, SamplingParams, check_tokens, completes_stop
from common.model import load_tokenizer


class SGLangEngine(Engine):
    """Many concurrent turns and in-place weight updates on an in-process sglang engine."""

    def __init__(self, model_path: str, *, dtype: str = "bfloat16", **server_args: object) -> None:
        try:
            import sglang
        except ImportError as err:
            raise ImportError(
                "SGLangEngine needs sglang: pip install 'asyncppo[sglang]' on a CUDA machine"
            ) from err
        self.tokenizer = load_tokenizer(model_path)
        self.vocab_size = AutoConfig.from_pretrained(model_path, local_files_only=True).vocab_size
        self.engine = sglang.Engine(model_path=model_path, dtype=dtype, **server_args)
        self.pending: dict[Hashable, tuple[list[int], SamplingParams]] = {}
        self.version = 0

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copy an exported state dict into the running engine; sglang re-ties embeddings itself."""
        success, message = self.engine.update_weights_from_tensor(
            list(tensors.items()), flush_cache=True
        )
        if not success:
            raise RuntimeError(f"sglang refused the weights of version {version}: {message}")
        self.version = version

    def submit(self, key: Hashable, context: list[int], params: SamplingParams) -> None:
        if params.top_p < 1.0:
            raise ValueError(
                f"SGLangEngine cannot report log-probs of the top-p={params.top_p} distribution "
                "(sglang returns them before top-p filtering); use top_p=1.0 or the torch engine"
            )
        check_tokens(context, self.vocab_size, "context")
        if key in self.pending:
            raise ValueError(f"key {key!r} already has a turn in progress")
        self.pending[key] = (list(context), params)

    def release(self, key: Hashable) -> None:
        self.pending.pop(key, None)

    def step(self) -> list[tuple[Hashable, Generation]]:
        """Every submitted turn as one request batch; all come back finished."""
        if not self.pending:
            return []
        keys, turns = list(self.pending), list(self.pending.values())
        self.pending.clear()
        version = self.version
        results = self.engine.generate(
            input_ids=[context for context, _ in turns],
            sampling_params=[self._request_params(params) for _, params in turns],
            return_logprob=True,
        )
        finished = []
        for key, (_, params), result in zip(keys, turns, results, strict=True):
            gen = Generation([], [], [], "length", params.temperature, params.top_p)
            self._append(gen, result["meta_info"], version, params)
            finished.append((key, gen))
        return finished

    @staticmethod
    def _request_params(params: SamplingParams) -> dict:
        return {
            "max_new_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stop": params.stop or None,
            "stop_token_ids": params.stop_token_ids or None,
            "no_stop_trim": True,
            "sampling_seed": secrets.randbits(62) if params.seed is None else params.seed,
        }

    def _append(self, gen: Generation, meta: dict, version: int, params: SamplingParams) -> None:
        """Add a request's tokens to `gen`, cutting at the first stop as TorchEngine does."""
        finish = meta["finish_reason"]["type"]
        if finish == "abort":
            raise RuntimeError(f"sglang aborted a generation: {meta['finish_reason']}")
        for logprob, token_id, _ in meta["output_token_logprobs"]:
            gen.token_ids.append(int(token_id))
            gen.logprobs.append(float(logprob))
            gen.versions.append(version)
            if completes_stop(self.tokenizer, gen.token_ids, params):
                gen.finish_reason = "stop"
                return
        if finish == "stop":  # the model's own eos, which sglang always honours
            gen.finish_reason = "stop"

    def close(self) -> None:
        """Stop sglang's scheduler and detokenizer processes."""
        self.engine.shutdown()
