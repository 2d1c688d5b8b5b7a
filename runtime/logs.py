"""structlog set-up: one canonical line per event, console rendering on a terminal and JSON lines otherwise."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(level: str | None = None, json: bool | None = None) -> None:
    """Configure structlog once per process. GYRE_LOG_LEVEL (default "info") and GYRE_LOG_JSON override.

    Per-message "handle" lines are emitted at debug level: at thousands of messages a second they would swamp a
    terminal, and structlog's level filter makes them free when off.
    """
    level_name = (level or os.environ.get("GYRE_LOG_LEVEL", "info")).lower()
    numeric = logging.getLevelNamesMapping().get(level_name.upper(), logging.INFO)
    if json is None:
        env = os.environ.get("GYRE_LOG_JSON")
        json = (env == "1") if env is not None else not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
