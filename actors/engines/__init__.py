"""Inference engines behind one protocol (``base.Engine``): torch (CPU or GPU), sglang (GPU,
behind the ``sglang`` extra, imported only when chosen) and simulated (no model)."""

from __future__ import annotations

from actors.engines.base import Engine, Generation, SamplingParams
from actors.engines.simulated import SimulatedEngine
from actors.engines.torch_engine import TorchEngine
from common.config import Config

ENGINE_NAMES = ("torch", "sglang", "simulated")
__all__ = [
    "ENGINE_NAMES",
    "Engine",
    "Generation",
    "SamplingParams",
    "TorchEngine",
    "engine_for",
    "make_engine",
]


def make_engine(name: str, model_path: str, **kwargs: object) -> Engine:
    """The engine called `name` (one of ENGINE_NAMES) on the model at `model_path`."""
    if name == "torch":
        return TorchEngine(model_path, **kwargs)
    if name == "simulated":
        return SimulatedEngine(model_path, **kwargs)
    if name == "sglang":
        from actors.engines.sglang_engine import (
            SGLangEngine,  # sglang itself is imported only on use
        )

        return SGLangEngine(model_path, **kwargs)
    raise ValueError(f"engine {name!r} is unknown; choose one of {ENGINE_NAMES}")


def engine_for(cfg: Config, model_path: str) -> Engine:
    """The engine the config asks for (``actor.engine``, its dtype and KV policy; sglang with LoRA
    support when the learner trains adapters)."""
    ac = cfg.actor
    options: dict = {} if ac.engine_dtype == "auto" else {"dtype": ac.engine_dtype}
    if ac.engine == "torch":
        options["on_swap"] = ac.kv_on_weight_swap
    if ac.engine == "sglang" and cfg.learner.lora.rank:
        options["lora_rank"] = cfg.learner.lora.rank
    return make_engine(ac.engine, model_path, **options)
