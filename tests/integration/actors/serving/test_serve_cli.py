"""`gyre serve` as a user starts it: the key from the environment, never on the command line or in the output; the
key is checked; the process logs through configure_logging. The model is the tiny one; nothing is faked."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gyre_serve_takes_its_key_from_the_environment_and_never_prints_it(tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    key = "env-key-" + os.urandom(8).hex()
    port = free_port()
    output = tmp_path / "serve.log"
    with open(output, "w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "gyre.runtime.cli", "serve", str(tiny_model_dir), "--port", str(port),
             "--max-context-tokens", "512", "--num-threads", "1"],
            stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ, GYRE_API_KEY=key),
        )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)
        for _ in range(1200):  # up to ~2 minutes for the engine to load; a bound, not a measurement
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert process.poll() is None, output.read_text()
                time.sleep(0.1)
        else:
            pytest.fail("gyre serve did not come up")
        assert [m.id for m in models] == [tiny_model_dir.name]
        answer = client.chat.completions.create(model=tiny_model_dir.name, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2)
        assert answer.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        process.terminate()
        process.wait(30)
    printed = output.read_text()
    assert "$GYRE_API_KEY" in printed and "model_call" in printed  # the banner, and the call's log line
    assert key not in printed
