"""One retry policy for every broker client: back off on retryable errors, give up on the rest.

A broker restart, a timeout or a ``busy`` queue is retryable (the reply says so); a request the
broker refused for good is not, and reaches the caller at once. Between tries the caller repairs
what the error says (``prepare``: say HELLO again after ``unknown_actor`` or ``not_learner``) and
reports liveness to its ``Health``, so a role waiting on a broker never looks stalled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog

from common.metrics import Health
from common.transport import TransportError

log = structlog.get_logger()
T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Delays between tries: ``first_s``, doubling up to ``max_s``."""

    first_s: float = 0.2
    max_s: float = 5.0


def call_with_retry(
    attempt: Callable[[], T],
    *,
    what: str,
    health: Health,
    should_stop: Callable[[], bool] = lambda: False,
    prepare: Callable[[TransportError], None] = lambda exc: None,
    backoff: Backoff = Backoff(),  # noqa: B008 (frozen: one shared default is safe)
) -> T:
    """``attempt()`` until it returns. A retryable TransportError is logged, reported to
    ``health`` as what the role waits for, waited out, and handed to ``prepare`` right before the
    next try (whose own errors count as that try's); a non-retryable one, or any once
    ``should_stop()``, is raised."""
    delay, pending = backoff.first_s, None
    while True:
        try:
            if pending is not None:
                prepare(pending)
            return attempt()
        except TransportError as exc:
            if not exc.retryable or should_stop():
                raise
            health.beat(f"broker ({exc})")
            log.warning(
                "broker request failed, retrying", what=what, error=str(exc), retry_in_s=delay
            )
            time.sleep(delay)
            delay, pending = min(2 * delay, backoff.max_s), exc
