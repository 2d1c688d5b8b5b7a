"""`gyre serve MODEL_DIR --engine-url URL --engine-url URL`, as a user runs it against SGLang servers that already run.

The servers are the conformance fake (`python -m gyre.engines.testing`: only SGLang's own routes and fields, its key
check, no /gyre/* route), each a process of its own; `gyre serve` is a process too, driven by the real openai and
anthropic SDKs. The prompts it captured must be the model's chat template rendered by transformers; a server of
another model, or one that never answers, is refused at start; a server killed mid-session is skipped and the
session goes on on the other one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import anthropic
import openai
import pytest
import transformers

from gyre.engines.model_format import init_model_dir

ENGINE_KEY = "engine-key-" + "0123456789abcdef"
SERVE_KEY = "serve-key-" + "fedcba9876543210"
STARTUP_POLLS = 1200  # 0.1 s apart: up to ~2 minutes for a process to import torch and load the model (a bound)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, what: str) -> None:
    for _ in range(STARTUP_POLLS):
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


@contextmanager
def fake_sglang_servers(model_dirs: list[Path], logs: Path) -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """One conformance-fake SGLang process per model dir, each requiring ENGINE_KEY (SGLang's --api-key)."""
    started: list[tuple[str, subprocess.Popen]] = []
    env = dict(os.environ, GYRE_ENGINE_API_KEY=ENGINE_KEY)
    try:
        for index, model_dir in enumerate(model_dirs):
            port = free_port()
            argv = [sys.executable, "-m", "gyre.engines.testing", "--model-dir", str(model_dir), "--port", str(port),
                    "--num-threads", "1", "--num-blocks", "256", "--max-context", "1024"]
            with open(logs / f"sglang-{index}.log", "w") as out:
                started.append((f"http://127.0.0.1:{port}",
                                subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)))
        for url, process in started:
            wait_until(lambda: healthy(url) or process.poll() is not None, f"the fake SGLang server at {url}")
            assert process.poll() is None, (logs / "sglang-0.log").read_text()
        yield started
    finally:
        for _, process in started:
            if process.poll() is None:
                process.terminate()
        for _, process in started:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def serve_argv(model_dir: Path, port: int, urls: list[str], key_file: Path, *extra: str) -> list[str]:
    argv = [sys.executable, "-m", "gyre.runtime.cli", "serve", str(model_dir), "--port", str(port),
            "--model-name", "tiny", "--max-context-tokens", "1024", "--engine-api-key-file", str(key_file)]
    for url in urls:
        argv += ["--engine-url", url]
    return argv + list(extra)


@pytest.fixture()
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "engine_key"
    path.write_text(ENGINE_KEY + "\n")
    path.chmod(0o600)
    return path


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_gyre_serve_over_two_sglang_servers_answers_both_sdks_and_survives_a_dead_server(
        tiny_model_dir: Path, tmp_path: Path, key_file: Path) -> None:
    record = tmp_path / "calls.jsonl"
    port = free_port()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    with fake_sglang_servers([tiny_model_dir, tiny_model_dir], tmp_path) as servers:
        urls = [url for url, _ in servers]
        with open(tmp_path / "serve.log", "w") as sink:
            serve = subprocess.Popen(serve_argv(tiny_model_dir, port, urls, key_file, "--record", str(record)),
                                     stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ, GYRE_API_KEY=SERVE_KEY))
        try:
            base = f"http://127.0.0.1:{port}"
            wait_until(lambda: healthy(base) or serve.poll() is not None, "gyre serve")
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()
            oai = openai.OpenAI(base_url=base + "/v1", api_key=SERVE_KEY, max_retries=0, timeout=120)
            claude = anthropic.Anthropic(base_url=base, api_key=SERVE_KEY, max_retries=0, timeout=120)

            # OpenAI, two turns of one conversation.
            messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "list the files"}]
            first = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
            messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                         {"role": "user", "content": "and now the hidden ones"}]
            oai.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
            # Anthropic, one call.
            claude_messages = [{"role": "user", "content": "what is in /app?"}]
            claude.messages.create(model="tiny", system="Answer in one line.", messages=claude_messages, max_tokens=8)

            calls = read_records(record)
            assert [c["type"] for c in calls] == ["ModelCallCompleted"] * 3, (tmp_path / "serve.log").read_text()
            expected_first = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=True, return_dict=False)
            assert calls[0]["prompt_ids"] == list(expected_first)
            # Token in, token out: the second call conditions on the first call's prompt and output ids exactly.
            prefix = calls[0]["prompt_ids"] + calls[0]["output_ids"]
            assert calls[1]["prompt_ids"][: len(prefix)] == prefix
            expected_claude = tokenizer.apply_chat_template(
                [{"role": "system", "content": "Answer in one line."}, *claude_messages],
                add_generation_prompt=True, tokenize=True, return_dict=False)
            assert calls[2]["prompt_ids"] == list(expected_claude)
            assert all(c["cell"] in ("engine-0", "engine-1") for c in calls)
            assert all(len(c["output_logprobs"]) == len(c["output_ids"]) > 0 for c in calls)

            # Kill the server that holds the conversation: its next call is served by the other one.
            holder = calls[1]["cell"]
            survivor = "engine-1" if holder == "engine-0" else "engine-0"
            servers[int(holder[-1])][1].send_signal(signal.SIGKILL)
            servers[int(holder[-1])][1].wait(timeout=30)
            messages += [{"role": "user", "content": "one more"}]
            third = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
            assert third.choices[0].finish_reason in ("stop", "length")
            calls = read_records(record)
            assert calls[-1]["cell"] == survivor
            assert calls[-1]["cached_tokens"] == 0  # the survivor never saw this session: it re-prefilled it
            # A new session goes to the survivor too.
            claude.messages.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
            assert read_records(record)[-1]["cell"] == survivor
        finally:
            serve.send_signal(signal.SIGINT)
            try:
                serve.wait(timeout=30)
            except subprocess.TimeoutExpired:
                serve.kill()
    log = (tmp_path / "serve.log").read_text()
    assert ENGINE_KEY not in log and SERVE_KEY not in log
    assert "engine_server_unhealthy" in log or "engine_unreachable" in log


def test_gyre_serve_refuses_a_server_of_another_model_and_one_that_never_answers(
        tiny_model_dir: Path, tmp_path: Path, key_file: Path) -> None:
    other = init_model_dir(tmp_path / "small", preset="small", seed=0)
    with fake_sglang_servers([other], tmp_path) as servers:
        result = subprocess.run(serve_argv(tiny_model_dir, free_port(), [servers[0][0]], key_file),
                                capture_output=True, text=True, timeout=300,
                                env=dict(os.environ, GYRE_API_KEY=SERVE_KEY))
    assert result.returncode == 2, result.stderr
    assert servers[0][0] in result.stderr and "differs from" in result.stderr
    dead = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run(serve_argv(tiny_model_dir, free_port(), [dead], key_file, "--engine-startup-timeout-s", "1"),
                            capture_output=True, text=True, timeout=300, env=dict(os.environ, GYRE_API_KEY=SERVE_KEY))
    assert result.returncode == 2, result.stderr
    assert dead in result.stderr and "not healthy" in result.stderr


def test_gyre_serve_refuses_engine_flags_that_cannot_work(tiny_model_dir: Path, tmp_path: Path, key_file: Path) -> None:
    env = dict(os.environ, GYRE_API_KEY=SERVE_KEY)
    cases = [
        (["--engine-url", "127.0.0.1:30000"], "is not an http"),
        (["--engine-url", "http://127.0.0.1:1", "--engine-url", "http://127.0.0.1:1/"], "given twice"),
        (["--engine-api-key-file", str(key_file)], "needs --engine-url"),
    ]
    for extra, message in cases:
        argv = [sys.executable, "-m", "gyre.runtime.cli", "serve", str(tiny_model_dir), *extra]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 2 and message in result.stderr, (extra, result.stderr)
