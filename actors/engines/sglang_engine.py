"""The Engine protocol on sglang's offline `sglang.Engine` (GPU).

Differences from TorchEngine, all forced by sglang and all visible to callers:

* Log-probs: sglang reports log softmax(logits / T) of the sampled token, before top-p
  filtering (its Sampler computes them so, unless SGLANG_RETURN_ORIGINAL_LOGPROB is set, which
  must stay unset). That is the sampling distribution only when top_p = 1, so top_p < 1 is
  refused rather than sending the learner a wrong μ.
* Mid-generation weight swaps: one `sglang.Engine.generate` call cannot be paused from here, so
  with `poll_weights` the generation runs in chunks of `poll_every` tokens and polls between
  them. The next chunk is a new request on prompt + tokens so far; sglang flushes its prefix
  cache on a weight update, so after a swap the whole context is re-encoded with the new
  weights (TorchEngine instead keeps the old KV cache).
* Stops: besides `stop_token_ids`, sglang also ends a sequence at the model's own eos token.
* Seeds: row i gets `sampling_seed = seed + i`; sglang honours it only when started with
  `enable_deterministic_inference=True`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import torch
from transformers import AutoConfig

from actors.engines.base import Generation, SamplingParams, check_prompts, completes_stop
from common.model import load_tokenizer


class SGLangEngine:
    """Batched generation and in-place weight updates on an in-process sglang engine."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "bfloat16",
        poll_every: int = 64,
        **server_args: object,
    ) -> None:
        try:
            import sglang
        except ImportError as err:
            raise ImportError(
                "SGLangEngine needs sglang: pip install 'asyncppo[sglang]' on a CUDA machine"
            ) from err
        if not isinstance(poll_every, int) or poll_every < 1:
            raise ValueError(f"poll_every must be an int >= 1, got {poll_every!r}")
        self.tokenizer = load_tokenizer(model_path)
        self.vocab_size = AutoConfig.from_pretrained(model_path, local_files_only=True).vocab_size
        self.engine = sglang.Engine(model_path=model_path, dtype=dtype, **server_args)
        self.poll_every = poll_every
        self.version = 0

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copy an exported state dict into the running engine; sglang re-ties embeddings itself."""
        success, message = self.engine.update_weights_from_tensor(
            list(tensors.items()), flush_cache=True
        )
        if not success:
            raise RuntimeError(f"sglang refused the weights of version {version}: {message}")
        self.version = version

    def _request_params(
        self, params: SamplingParams, max_new_tokens: int, seed: int | None
    ) -> dict:
        request = {
            "max_new_tokens": max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stop": params.stop or None,
            "stop_token_ids": params.stop_token_ids or None,
            "no_stop_trim": True,
        }
        if seed is not None:
            request["sampling_seed"] = seed
        return request

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        poll_weights: Callable[[], None] | None = None,
    ) -> list[Generation]:
        """Sample continuations of `prompts`; with `poll_weights`, in chunks of `poll_every` tokens."""
        if params.top_p < 1.0:
            raise ValueError(
                f"SGLangEngine cannot report log-probs of the top-p={params.top_p} distribution "
                "(sglang returns them before top-p filtering); use top_p=1.0 or the torch engine"
            )
        check_prompts(prompts, self.vocab_size)
        base_seed = params.seed if params.seed is not None else secrets.randbits(62)
        chunk = self.poll_every if poll_weights is not None else params.max_new_tokens
        outputs = [
            Generation([], [], [], "length", params.temperature, params.top_p) for _ in prompts
        ]
        active = list(range(len(prompts)))
        while active:
            budget = min(chunk, params.max_new_tokens - len(outputs[active[0]].token_ids))
            version = self.version
            results = self.engine.generate(
                input_ids=[prompts[row] + outputs[row].token_ids for row in active],
                sampling_params=[
                    self._request_params(params, budget, base_seed + row) for row in active
                ],
                return_logprob=True,
            )
            for row, result in zip(active, results, strict=True):
                self._append(outputs[row], result["meta_info"], version, params)
            active = [
                row
                for row in active
                if outputs[row].finish_reason != "stop"
                and len(outputs[row].token_ids) < params.max_new_tokens
            ]
            if active and poll_weights is not None:
                poll_weights()
        return outputs

    def _append(self, gen: Generation, meta: dict, version: int, params: SamplingParams) -> None:
        """Add one chunk's tokens to `gen`, cutting at the first stop as TorchEngine does."""
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
