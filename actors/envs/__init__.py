"""Environments: the built-in ones by name, and anyone's by import path.

``actor.env`` is either a registered name (``digits``, ``maze``, ...) or an import path
``package.module:factory`` to any callable that takes ``actor.env_kwargs`` and returns an object
meeting the ``Environment`` protocol (``actors/envs/base.py``): bring your own task without
touching this package.
"""

from __future__ import annotations

import importlib
import inspect
import operator
from collections.abc import Callable

from actors.envs.arith import ArithEnv
from actors.envs.base import Environment, StepResult
from actors.envs.chain import ChainEnv
from actors.envs.digits import DigitsEnv
from actors.envs.maze import MazeEnv
from actors.envs.tooluse import ToolUseEnv

_REGISTRY: dict[str, Callable[..., Environment]] = {
    "digits": DigitsEnv,
    "maze": MazeEnv,
    "tooluse": ToolUseEnv,
    "arith": ArithEnv,
    "chain": ChainEnv,
}
ENV_NAMES: tuple[str, ...] = tuple(_REGISTRY)
MEMBERS = ("name", "max_new_tokens", "stop", "reset", "step", "compact")


class EnvConfigError(ValueError, TypeError):
    """``actor.env`` or ``actor.env_kwargs`` cannot make an environment; ``key`` says which.
    Both a ValueError and a TypeError, the two kinds of what it reports (a wrong name or value,
    an argument the factory does not take, an object that is not an Environment)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


def env_factory(name: str) -> Callable[..., Environment]:
    """The registered factory called `name`, or the callable at import path 'module:attribute'."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"environment must be a name or 'package.module:factory', got {name!r}")
    if name in _REGISTRY:
        return _REGISTRY[name]
    module_name, colon, attribute = name.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(
            f"unknown environment {name!r}; known: {', '.join(ENV_NAMES)}, or an import path "
            "'package.module:factory'"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises while it loads
        raise ValueError(
            f"environment {name!r}: cannot import module {module_name!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    try:
        factory = operator.attrgetter(attribute)(module)
    except AttributeError:
        raise ValueError(
            f"environment {name!r}: module {module_name!r} has no attribute {attribute!r}"
        ) from None
    if not callable(factory):
        raise ValueError(f"environment {name!r}: {attribute!r} is not callable")
    return factory


def check_environment(env: object, name: str) -> Environment:
    """Refuse an object that does not meet the Environment protocol, naming what it lacks."""
    what = f"environment {name!r} (a {type(env).__name__})"
    missing = [member for member in MEMBERS if not hasattr(env, member)]
    if missing:
        raise TypeError(
            f"{what} does not meet the Environment protocol (actors/envs/base.py): missing "
            f"{', '.join(missing)}"
        )
    problems = [
        f"{member} is not callable"
        for member in ("reset", "step", "compact")
        if not callable(getattr(env, member))
    ]
    if not isinstance(env.name, str) or not env.name:
        problems.append(f"name must be a non-empty str, got {env.name!r}")
    tokens = env.max_new_tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        problems.append(f"max_new_tokens must be an int >= 1, got {tokens!r}")
    if not isinstance(env.stop, list) or not all(isinstance(s, str) and s for s in env.stop):
        problems.append(f"stop must be a list of non-empty str, got {env.stop!r}")
    if problems:
        raise TypeError(f"{what} does not meet the Environment protocol: {'; '.join(problems)}")
    return env


def make_env(name: str, **kwargs: object) -> Environment:
    """Build an environment by name or import path; arguments and the result are checked.

    Every failure is an ``EnvConfigError`` naming the config key at fault and the factory by its
    import path: the name (``actor.env``), its arguments (``actor.env_kwargs``) or what the
    factory built or raised."""
    try:
        factory = env_factory(name)
    except ValueError as exc:
        raise EnvConfigError("actor.env", str(exc)) from None
    where = f"environment {name!r} ({_import_path(factory)})"
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # some builtins have no signature: let the call decide
        parameters = None
    if parameters is not None and not any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    ):
        unknown = sorted(set(kwargs) - set(parameters))
        if unknown:
            raise EnvConfigError(
                "actor.env_kwargs",
                f"{where} takes no argument(s) {', '.join(unknown)}; it accepts: "
                f"{', '.join(parameters) or 'none'}",
            )
    try:
        env = factory(**kwargs)
    except Exception as exc:  # the factory's own code refused its arguments, or failed
        key = "actor.env_kwargs" if isinstance(exc, (TypeError, ValueError)) else "actor.env"
        raise EnvConfigError(key, f"{where} raised {type(exc).__name__}: {exc}") from exc
    try:
        return check_environment(env, name)
    except TypeError as exc:
        raise EnvConfigError("actor.env", f"{exc} (made by {_import_path(factory)})") from None


def _import_path(factory: Callable[..., object]) -> str:
    """Where a factory lives, as an import path: ``package.module:Name``."""
    module = getattr(factory, "__module__", None) or "?"
    return f"{module}:{getattr(factory, '__qualname__', repr(factory))}"


__all__ = [
    "ENV_NAMES",
    "EnvConfigError",
    "Environment",
    "StepResult",
    "check_environment",
    "make_env",
]
