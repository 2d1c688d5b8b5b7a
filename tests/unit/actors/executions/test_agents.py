"""Agent specs: a spec file's command and the variables that must carry the proxy's URL and the execution's key;
the wrapper copies the executor's values into them and runs the agent unchanged, the instruction last; a broken
spec is refused with the file and the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.actors.executions.agents import (
    AgentSpec,
    AgentSpecError,
    agent_spec,
    load_agent_spec,
    mini_swe_agent_argv,
    spec_argv,
    task_set_specs,
)

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
GOOD = """
command = ["python3", "-c", "import json, os, sys; print(json.dumps([dict(os.environ), sys.argv[1:]]))", "--flag"]
[base_url_env]
MY_OPENAI = "openai"
MY_ANTHROPIC = "anthropic"
[api_key_env]
names = ["MY_KEY"]
[env]
MY_MODE = "quiet"
"""


def test_a_spec_file_runs_its_agent_with_the_proxy_in_its_own_variables(tmp_path: Path) -> None:
    (tmp_path / "agent.toml").write_text(GOOD)
    spec = load_agent_spec(tmp_path / "agent.toml")
    assert spec.base_url_env == (("MY_ANTHROPIC", "anthropic"), ("MY_OPENAI", "openai"))
    assert spec.api_key_env == ("MY_KEY",) and spec.env == {"MY_MODE": "quiet"}
    # What the executor sets, then the instruction appended, as the executor runs it.
    executor_env = {"PATH": "/usr/bin:/bin", "OPENAI_BASE_URL": "http://127.0.0.1:5/v1",
                    "ANTHROPIC_BASE_URL": "http://127.0.0.1:5", "OPENAI_API_KEY": "k-1", "ANTHROPIC_API_KEY": "k-1"}
    instruction = "fix it; don't $(touch /tmp/x) \"quote\""
    out = subprocess.run([*spec_argv(spec), instruction], env=executor_env, capture_output=True, text=True,
                         check=True)
    env, argv = json.loads(out.stdout)
    assert env["MY_OPENAI"] == "http://127.0.0.1:5/v1" and env["MY_ANTHROPIC"] == "http://127.0.0.1:5"
    assert env["MY_KEY"] == "k-1"
    assert argv == ["--flag", instruction]  # passed through untouched by the wrapper's shell


def test_an_agent_without_extra_variables_runs_as_it_is() -> None:
    assert spec_argv(AgentSpec(("my-agent", "-q"))) == ("my-agent", "-q")
    assert agent_spec("noop").command == ("true",)
    assert agent_spec("my-agent --fast 'two words'").command == ("my-agent", "--fast", "two words")


@pytest.mark.parametrize(("text", "reason"), [
    ("command = 3", "command must be a non-empty string or list"),
    ("command = []", "command must be a non-empty string or list"),
    ("command = 'a'\nextra = 1", "unknown keys"),
    ("command = 'a'\n[base_url_env]\nX = 'grpc'", "the form is \"openai\" or \"anthropic\""),
    ("command = 'a'\n[base_url_env]\nOPENAI_BASE_URL = 'openai'", "set by the executor itself"),
    ("command = 'a'\n[api_key_env]\nnames = 'K'", "names = "),
    ("command = 'a'\n[env]\n'1BAD' = 'x'", "not a variable name"),
    ("command = 'a'\n[api_key_env]\nnames = ['K']\n[env]\nK = 'x'", "named twice"),
    ("command = [", "malformed TOML"),
])
def test_a_broken_spec_is_refused_with_the_file_and_the_reason(tmp_path: Path, text: str, reason: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    with pytest.raises(AgentSpecError, match=reason) as caught:
        load_agent_spec(path)
    assert str(path) in str(caught.value)
    with pytest.raises(AgentSpecError, match="cannot be read"):
        load_agent_spec(tmp_path / "missing.toml")


def test_mini_swe_agent_options_become_its_own_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name: "/opt/bin/mini" if name == "mini" else None)
    argv = mini_swe_agent_argv("gyre", ("agent.step_limit=3",))
    assert argv[:2] == (sys.executable, "/opt/bin/mini") and argv[-1] == "--task"
    assert argv[argv.index("-c"):argv.index("-c") + 4] == ("-c", "mini.yaml", "-c", "agent.step_limit=3")
    assert "-c" not in mini_swe_agent_argv("gyre")
    with pytest.raises(AgentSpecError, match="KEY=VALUE"):
        mini_swe_agent_argv("gyre", ("step_limit",))
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(AgentSpecError, match="needs the PyPI package mini-swe-agent"):
        mini_swe_agent_argv("gyre")


def test_task_sets_of_both_formats_take_any_agent(tmp_path: Path) -> None:
    (tmp_path / "agent.toml").write_text(GOOD)
    harbor = task_set_specs(EXAMPLES / "tasks", str(tmp_path / "agent.toml"))
    assert len(harbor) >= 24 and all(s.workdir == "/app" and s.env["MY_MODE"] == "quiet" for s in harbor)
    assert harbor[0].agent_argv[0] == "/bin/sh"
    swe = task_set_specs(EXAMPLES / "swe", "noop")
    assert [s.task_id for s in swe] == ["intervals-1", "textstats-1"] and swe[0].workdir == "/testbed"
    oracle = task_set_specs(EXAMPLES / "tasks" / "fix-add", "oracle")
    assert oracle[0].agent_argv == ("bash", "/solution/solve.sh") and oracle[0].agent_mounts
    with pytest.raises(AgentSpecError, match="agent is empty"):
        task_set_specs(EXAMPLES / "tasks", "  ")
