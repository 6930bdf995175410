"""Inference engines behind one protocol (``base.Engine``): torch (CPU or GPU), sglang (GPU,
behind the ``sglang`` extra, imported only when chosen) and simulated (no model)."""

from __future__ import annotations

from actors.engines.base import Engine, Generation, SamplingParams
from actors.engines.simulated import SimulatedEngine
from actors.engines.torch_engine import TorchEngine

ENGINE_NAMES = ("torch", "sglang", "simulated")
__all__ = ["ENGINE_NAMES", "Engine", "Generation", "SamplingParams", "TorchEngine", "make_engine"]


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
