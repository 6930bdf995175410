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
import tempfile
from collections.abc import Hashable

import torch
from transformers import AutoConfig

from actors.engines.base import Engine, Generation, SamplingParams, check_tokens, completes_stop
from common.lora import BaseWeights, factor_pairs, fingerprint, save_peft
from common.model import load_causal_lm, load_tokenizer


class SGLangEngine(Engine):
    """Many concurrent turns and in-place weight updates on an in-process sglang engine."""

    def __init__(
        self, model_path: str, *, dtype: str = "bfloat16", lora_rank: int = 0, **server_args: object
    ) -> None:
        """``lora_rank`` > 0 starts sglang with LoRA support for adapters up to that rank."""
        try:
            import sglang
        except ImportError as err:
            raise ImportError(
                "SGLangEngine needs sglang: pip install 'asyncppo[sglang]' on a CUDA machine"
            ) from err
        self.tokenizer = load_tokenizer(model_path)
        self.vocab_size = AutoConfig.from_pretrained(model_path, local_files_only=True).vocab_size
        if lora_rank:
            server_args = {
                "enable_lora": True,
                "max_lora_rank": lora_rank,
                "lora_target_modules": ["all"],
                **server_args,
            }
        self.engine = sglang.Engine(model_path=model_path, dtype=dtype, **server_args)
        self.pending: dict[Hashable, tuple[list[int], SamplingParams]] = {}
        self.version = 0
        # LoRA: the base model (fingerprinted from its files, once) and the adapter in use
        self.base = BaseWeights(
            lambda: fingerprint(load_causal_lm(model_path, dtype=torch.bfloat16))
        )
        self.adapter: tuple[str, tempfile.TemporaryDirectory] | None = None

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copy an exported state dict into the running engine; sglang re-ties embeddings itself."""
        success, message = self.engine.update_weights_from_tensor(
            list(tensors.items()), flush_cache=True
        )
        if not success:
            raise RuntimeError(f"sglang refused the weights of version {version}: {message}")
        self.base.replaced = True
        self._drop_adapter()
        self.version = version

    def load_adapter(self, version: int, tensors: dict[str, torch.Tensor], base: str) -> None:
        """Hand the adapter to sglang's own LoRA support (written as a peft directory, loaded
        under the name ``v<version>``); later turns run with it, unmerged, and the previous
        adapter is unloaded."""
        self.base.check(version, base)
        name, directory = f"v{version}", tempfile.TemporaryDirectory(prefix="asyncppo-lora-")
        save_peft(factor_pairs(tensors), directory.name)
        result = self.engine.load_lora_adapter(name, directory.name)
        if not result.success:
            directory.cleanup()
            raise RuntimeError(
                f"sglang refused the adapter of version {version}: {result.error_message}"
            )
        self._drop_adapter()
        self.adapter, self.version = (name, directory), version

    def _drop_adapter(self) -> None:
        if self.adapter is not None:
            name, directory = self.adapter
            self.engine.unload_lora_adapter(name)
            directory.cleanup()
            self.adapter = None

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
        lora = {} if self.adapter is None else {"lora_path": [self.adapter[0]] * len(turns)}
        results = self.engine.generate(
            input_ids=[context for context, _ in turns],
            sampling_params=[self._request_params(params) for _, params in turns],
            return_logprob=True,
            **lora,
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
