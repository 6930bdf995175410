"""Built-in environments and the registry actors build them from by name."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from actors.envs.arith import ArithEnv
from actors.envs.base import Environment, StepResult
from actors.envs.digits import DigitsEnv
from actors.envs.maze import MazeEnv
from actors.envs.tooluse import ToolUseEnv

_REGISTRY: dict[str, Callable[..., Environment]] = {
    "digits": DigitsEnv,
    "maze": MazeEnv,
    "tooluse": ToolUseEnv,
    "arith": ArithEnv,
}
ENV_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def make_env(name: str, **kwargs: object) -> Environment:
    """Build a registered environment; names and keyword arguments are checked up front."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(ENV_NAMES)}")
    factory = _REGISTRY[name]
    accepted = list(inspect.signature(factory).parameters)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(
            f"make_env({name!r}): unknown argument(s) {', '.join(unknown)}; "
            f"accepted: {', '.join(accepted) or 'none'}"
        )
    return factory(**kwargs)


__all__ = ["ENV_NAMES", "Environment", "StepResult", "make_env"]
