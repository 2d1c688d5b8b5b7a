"""Logging set up while stderr is replaced (a test capturing output, a CLI called in-process) keeps working after
that stream is closed: lines go to whatever stderr is when they are written (the CI failure: "I/O operation on
closed file" in every later test that logged)."""

from __future__ import annotations

import io
import sys

import structlog

from gyre.runtime.logs import configure_logging


def test_lines_go_to_the_stderr_of_the_moment_not_the_one_at_set_up(monkeypatch) -> None:
    saved = structlog.get_config()
    try:
        temporary = io.StringIO()
        monkeypatch.setattr(sys, "stderr", temporary)
        configure_logging("info", json=True)
        structlog.get_logger("t").info("while_replaced")
        temporary.close()  # the capture ends
        later = io.StringIO()
        monkeypatch.setattr(sys, "stderr", later)
        structlog.get_logger("t").info("after_it_closed")  # raised ValueError before
        assert '"event": "after_it_closed"' in later.getvalue()
    finally:
        structlog.configure(**saved)

