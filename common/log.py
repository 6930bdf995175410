"""structlog setup: JSON lines in production, console on a TTY; every line carries the role."""

from __future__ import annotations

import logging
import sys

import structlog


def setup_logging(
    role: str, *, fmt: str = "auto", level: str = "info", **context: object
) -> structlog.BoundLogger:
    """Configure structlog once per process and return a logger bound to role (+ actor_id/rank ...)."""
    console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer = (
        structlog.dev.ConsoleRenderer(colors=False)
        if console
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(role=role, **context)
    return structlog.get_logger()


def bind_version(version: int) -> None:
    """Every later log line of this process carries the current policy version."""
    structlog.contextvars.bind_contextvars(policy_version=version)
