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


# A checkpoint's template that re-renders the assistant turns before the last user message (as Qwen3 drops their
# `<think>` blocks; here it prefixes them, so the difference shows whatever the random tiny model generates).
MARKS_EARLIER_TURNS = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_query %}"
    "{{- '<|im_start|>assistant\\n(earlier) ' + (m.content or '') + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _start_serve(model_dir: Path, port: int, key: str, log: Path, *extra: str) -> subprocess.Popen:
    with open(log, "w") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "gyre.runtime.cli", "serve", str(model_dir), "--port", str(port),
             "--max-context-tokens", "512", "--num-threads", "1", *extra],
            stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ, GYRE_API_KEY=key),
        )


@pytest.mark.parametrize("earlier_turns", ["keep_generated", "follow_template"])
def test_earlier_turns_flag_decides_what_a_re_rendered_turn_becomes(tiny_model_dir: Path, tmp_path: Path,
                                                                    earlier_turns: str) -> None:
    import json
    import shutil

    from gyre.engines.chat_template import ChatTemplate

    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "marks-earlier"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = MARKS_EARLIER_TURNS
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    key, port, record = "env-key-" + os.urandom(8).hex(), free_port(), tmp_path / "calls.jsonl"
    process = _start_serve(model_dir, port, key, tmp_path / "serve.log", "--earlier-turns", earlier_turns,
                           "--record", str(record))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)
        for _ in range(1200):  # up to ~2 minutes for the engine to load; a bound, not a measurement
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert process.poll() is None, (tmp_path / "serve.log").read_text()
                time.sleep(0.1)
        else:
            pytest.fail("gyre serve did not come up")
        messages = [{"role": "user", "content": "hi"}]
        answer = client.chat.completions.create(model="marks-earlier", messages=messages, max_tokens=3,
                                                temperature=0)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                     {"role": "user", "content": "and then?"}]
        client.chat.completions.create(model="marks-earlier", messages=messages, max_tokens=3, temperature=0)
    finally:
        process.terminate()
        process.wait(30)
    first, second = [json.loads(line) for line in record.read_text().splitlines()]
    template = ChatTemplate.from_model_dir(model_dir)
    generated = first["prompt_ids"] + first["output_ids"]
    if earlier_turns == "keep_generated":
        # The second prompt extends the first prompt and its output id for id; the template's re-render is not used.
        assert second["prompt_ids"][: len(generated)] == generated
        assert "(earlier)" not in template.decode(second["prompt_ids"])
    else:
        # The template's text exactly: the earlier turn as the template writes it now.
        assert second["prompt_ids"] == template.render_ids(messages, None, True)
        assert "(earlier) " in template.decode(second["prompt_ids"])


def test_the_cli_offers_exactly_the_proxys_earlier_turns() -> None:
    from gyre.actors.serving.cli import EARLIER_TURNS as offered
    from gyre.actors.serving.sessions import EARLIER_TURNS

    assert offered == EARLIER_TURNS
