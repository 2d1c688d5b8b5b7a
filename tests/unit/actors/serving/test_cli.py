"""`gyre serve`'s start-up (Hardening, finding 8): where the key comes from, that it is never printed, and that the
context may not exceed the model's positions."""

from __future__ import annotations

import argparse
import stat
from pathlib import Path

import pytest
import structlog

from gyre.actors.serving.cli import API_KEY_ENV, ServeConfig, ServeError, register, resolve_api_key


def parse(*words: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", "model", *words])


def test_the_key_file_comes_first_then_the_environment_then_the_flag(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    environ = {API_KEY_ENV: "from-env"}
    assert resolve_api_key(parse("--api-key-file", str(key_file), "--api-key", "flag"), environ)[0] == "from-file"
    assert resolve_api_key(parse("--api-key", "from-flag"), environ)[0] == "from-env"
    key, source = resolve_api_key(parse("--api-key", "from-flag"), {})
    assert key == "from-flag" and "from-flag" not in source


def test_without_a_key_one_is_written_to_a_private_file_whose_path_is_said(tmp_path: Path) -> None:
    key, source = resolve_api_key(parse(), {})
    path = Path(source.rsplit(" ", 1)[-1])
    try:
        assert key not in source and path.read_text().strip() == key
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    finally:
        path.unlink()
        path.parent.rmdir()


def test_a_key_file_that_is_missing_or_empty_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    for path in (tmp_path / "missing", tmp_path / "empty"):
        with pytest.raises(ServeError):
            resolve_api_key(parse("--api-key-file", str(path)), {})


def test_the_config_never_shows_its_key() -> None:
    assert "s3cret" not in repr(ServeConfig(model_dir="m", api_key="s3cret", model_name="tiny"))


def test_a_context_beyond_the_models_positions_is_refused_at_start(tiny_model_dir: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--max-context-tokens", "40000")
    args.model_dir = str(tiny_model_dir)  # max_position_embeddings 32768
    saved = structlog.get_config()
    try:
        assert args.func(args) == 2  # it configures logging first (onto this test's captured stderr) ...
    finally:
        structlog.configure(**saved)  # ... which must not outlive the test
    assert "exceeds the model's max_position_embeddings 32768" in capsys.readouterr().err


def test_the_recorder_writes_whole_prompts_rebuilt_from_incremental_records(tmp_path: Path) -> None:
    """`gyre serve --record` users get each call's whole prompt, though the proxy's records carry only new ids."""
    import json

    import attrs

    from gyre.actors.serving.cli import CallRecorder
    from gyre.policies.trajectory_tree import TreeConfig, prompt_ids_digest, whole_prompt_call

    def call(index, prompt, output, extends=-1, shared=0):
        whole = whole_prompt_call(execution_id="interactive", group_id="interactive", call_index=index, agent_id="",
                                  call_kind="", prompt_ids=prompt, output_ids=output,
                                  output_logprobs=(-0.5,) * len(output), output_versions=(0,) * len(output),
                                  finish_reason="stop", cached_tokens=0, cell="c", started_s=0.0, finished_s=1.0,
                                  sampling_temperature=1.0)
        return attrs.evolve(whole, extends_call=extends, shared_tokens=shared, new_prompt_ids=tuple(prompt[shared:]),
                            prompt_digest=prompt_ids_digest(prompt))

    path = tmp_path / "calls.jsonl"
    recorder = CallRecorder(str(path), TreeConfig(max_stored_tokens=12))
    recorder(call(0, (1, 2, 3), (4, 5)))
    recorder(call(1, (1, 2, 3, 4, 5, 6), (7,), extends=0, shared=5))
    recorder(attrs.evolve(call(2, (1, 2, 3, 4, 5, 6, 7, 8), (9,), extends=1, shared=7), prompt_digest=b"x" * 32))
    recorder(call(3, (1, 2, 3, 4, 5, 6, 7, 8), (9,), extends=1, shared=7))
    recorder(call(4, (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13), (14,), extends=3, shared=9))  # the tree is full
    recorder.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["prompt_ids"] for line in lines] == [[1, 2, 3], [1, 2, 3, 4, 5, 6], None, [1, 2, 3, 4, 5, 6, 7, 8],
                                                      None]
    assert "new_prompt_ids" not in lines[0] and lines[1]["extends_call"] == 0 and lines[1]["shared_tokens"] == 5
    assert lines[0]["prompt_digest"] == prompt_ids_digest((1, 2, 3)).hex()
    assert "does not match" in lines[2]["prompt_error"]
    assert "does not hold" in lines[4]["prompt_error"]
    assert recorder.calls_recorded == 5 and recorder.prompts_lost == 2
