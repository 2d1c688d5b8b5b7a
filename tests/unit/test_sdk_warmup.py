"""The SDK warm-ups: each sends one request to a refusing local port, returns quietly, and leaves no thread behind
(the warm launcher forks right after them)."""

from __future__ import annotations

import subprocess
import sys

import pytest

WARMUPS = ("openai_client", "anthropic_client")


@pytest.mark.parametrize("name", WARMUPS)
def test_a_warm_up_imports_the_request_path_and_leaves_no_thread(name: str) -> None:
    # A fresh interpreter: in this one the SDKs' modules may already be imported by other tests.
    code = f"""
import sys, threading
from gyre.actors import sdk_warmup
sdk = "openai" if "{name}".startswith("openai") else "anthropic"
resource = {{"openai": "openai.resources.chat.completions", "anthropic": "anthropic.resources.messages"}}[sdk]
sdk_warmup.{name}()
assert resource in sys.modules, sorted(m for m in sys.modules if m.startswith(sdk + ".resources"))
assert threading.active_count() == 1, threading.enumerate()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
