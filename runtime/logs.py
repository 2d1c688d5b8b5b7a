"""structlog set-up: one canonical line per event, console rendering on a terminal and JSON lines otherwise."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

__all__ = ["CURRENT_STDERR", "configure_logging"]


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is when a line is written, not to the stream it was at set-up. A process
    that configures logging while its stderr is temporarily replaced (a test capturing output, a CLI called
    in-process) would otherwise keep writing into the replaced stream after it is closed: every later log line
    then fails with "I/O operation on closed file"."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


CURRENT_STDERR = _CurrentStderr()
"""The stream every structlog set-up of Gyre's writes to (see `_CurrentStderr`)."""


def configure_logging(level: str | None = None, json: bool | None = None) -> None:
    """Configure structlog once per process. GYRE_LOG_LEVEL (default "info") and GYRE_LOG_JSON override.

    Every entry point calls it (`gyre run`, `gyre serve`, the benchmarks, launched children): an unconfigured
    structlog renders exceptions with rich tracebacks that include locals.

    Per-message "handle" lines are emitted at debug level: at thousands of messages a second they would swamp a
    terminal, and structlog's level filter makes them free when off.
    """
    level_name = (level or os.environ.get("GYRE_LOG_LEVEL", "info")).lower()
    numeric = logging.getLevelNamesMapping().get(level_name.upper(), logging.INFO)
    if json is None:
        env = os.environ.get("GYRE_LOG_JSON")
        json = (env == "1") if env is not None else not sys.stderr.isatty()
    # Tracebacks are plain text, never structlog's default rich ones: those print every frame's locals, which on a
    # server path are the request (megabytes per frame; a RecursionError has a thousand frames).
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
        ))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=CURRENT_STDERR),
        cache_logger_on_first_use=False,
    )
