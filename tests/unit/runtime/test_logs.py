"""configure_logging renders an exception as a plain traceback, never with the frames' locals (Hardening, finding
1: structlog's default console renderer printed a request of megabytes in each of a RecursionError's frames)."""

from __future__ import annotations

import io
import json
import sys

import pytest
import structlog

from gyre.runtime.logs import configure_logging


@pytest.mark.parametrize("as_json", [False, True])
def test_exceptions_are_logged_without_locals(as_json: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    captured = io.StringIO()
    monkeypatch.setattr(sys, "stderr", captured)  # configure_logging prints to the stderr of its call
    configure_logging("info", json=as_json)
    try:
        def fail(request_body: str) -> None:
            raise ValueError("bad request")

        try:
            fail("-".join(["SECRET", "LOCAL"]) * 40)  # the value appears nowhere in the source
        except ValueError:
            structlog.get_logger("test").exception("call_failed")
    finally:
        structlog.reset_defaults()
    text = captured.getvalue()
    assert "call_failed" in text and "ValueError: bad request" in text and "Traceback" in text
    assert "SECRET-LOCALSECRET" not in text  # no locals
    if as_json:
        assert "ValueError" in json.loads(text.strip().splitlines()[-1])["exception"]
