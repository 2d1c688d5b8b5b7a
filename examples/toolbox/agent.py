"""The toolbox example agent: a small coding-agent-like program that talks to Gyre's proxy with the openai SDK.

Run it in the task's workspace (its working directory):

    OPENAI_BASE_URL=http://127.0.0.1:PORT/v1 OPENAI_API_KEY=KEY python agent.py "Add the numbers in data.txt ..."

It does what long-horizon agents do, in miniature, so that one execution makes the branching tree Gyre's
trajectory processor is built for:
- a tool loop over read_file, write_file, calculator and delegate, bounded in turns;
- context compression: when the conversation passes a character budget, a summary call (X-Gyre-Call: summary)
  and a fresh context made of the task plus the summary;
- sub-agents: delegate(task) runs a nested loop with its own X-Gyre-Agent id (the main agent is "main");
- retries: a reply whose tool call did not parse (left as <tool_call> text by the proxy), names an unknown tool or
  carries arguments that are not a JSON object is asked for again, a bounded number of times.

The loop (Agent) takes the model as a plain callable, so the scripted expert drives the very same loop to write
its demonstrations. Exit codes: 0 the agent finished, 2 bad usage, 3 turn budget spent without finishing, 1 the
model endpoint failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import attrs
import structlog


def load_sibling(name: str) -> ModuleType:
    """Import a module of this folder by path under a private name.

    examples/ is not a package on sys.path (nothing in gyre imports it), yet this file runs both as a script and
    as a module a topology loads by path; loading siblings by path works the same in every case, and the private
    name keeps one copy per process.
    """
    qualified = f"_gyre_toolbox_{name}"
    module = sys.modules.get(qualified)
    if module is None:
        spec = importlib.util.spec_from_file_location(qualified, Path(__file__).resolve().with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None, name
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[qualified]
            raise
    return module


prompts = load_sibling("prompts")
tools = load_sibling("tools")

log = structlog.get_logger("toolbox.agent")

MAIN_AGENT_ID = "main"
CALL_TURN = "turn"
CALL_SUMMARY = "summary"
MAX_SUMMARY_CHARS = 600
"""A summary longer than this is cut: it must be smaller than the context it replaces."""
LOG_CHARS = 120
"""Head of a tool call's arguments and observation that the debug log shows (enough to see a copy error)."""


@attrs.frozen
class ToolCall:
    """A tool call as the OpenAI API returns it."""

    id: str
    name: str
    arguments_json: str


@attrs.frozen
class ModelReply:
    """One assistant reply, in the shape the agent needs."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str = "stop"

    def message(self) -> dict[str, Any]:
        """The assistant message to put back into the conversation, exactly as the model produced it."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
                for call in self.tool_calls
            ]
        return message


CallModel = Callable[[list[dict[str, Any]], tuple[dict[str, Any], ...], str, str], ModelReply]
"""call_model(messages, tools, agent_id, call_kind) -> reply; call_kind is "turn" or "summary"."""


@attrs.frozen
class AgentConfig:
    """Bounds of one agent run."""

    max_turns: int = attrs.field(default=10, validator=attrs.validators.ge(1))
    """Ordinary model calls of the main agent (summary calls and retries not counted)."""
    sub_agent_max_turns: int = attrs.field(default=6, validator=attrs.validators.ge(1))
    """Ordinary model calls of each sub-agent."""
    max_sub_agents: int = attrs.field(default=2, validator=attrs.validators.ge(0))
    """Sub-agents one execution may spawn; further delegate calls get an error observation."""
    max_retries: int = attrs.field(default=2, validator=attrs.validators.ge(0))
    """Extra attempts at a call whose reply is malformed."""
    context_budget_chars: int = attrs.field(default=240, validator=attrs.validators.ge(1))
    """Each agent (main or sub) compresses its context before a call once prompts.conversation_chars passes this."""
    max_summaries: int = attrs.field(default=2, validator=attrs.validators.ge(0))
    """Compressions per agent; after these the context just grows (the turn bound still ends the run)."""


@attrs.frozen
class AgentResult:
    """How one agent (main or sub) ended."""

    agent_id: str
    finished: bool
    """True when the agent gave a final answer; False when it ran out of turns."""
    final_text: str
    turns: int
    retries: int
    summaries: int


def reply_problem(reply: ModelReply, allowed: frozenset[str], *, call_kind: str = CALL_TURN) -> str | None:
    """Why a reply cannot be used as it is, or None.

    The proxy leaves a tool call that does not parse as <tool_call> text in the content; an unknown tool name or
    arguments that are not a JSON object are malformed too. A summary must be plain text.
    """
    if "<tool_call>" in reply.content or "</tool_call>" in reply.content:
        return "unparsed tool call in the text"
    if call_kind == CALL_SUMMARY:
        return "tool call in a summary" if reply.tool_calls else None
    for call in reply.tool_calls:
        if call.name not in allowed:
            return f"unknown tool {call.name!r}"
        try:
            arguments = json.loads(call.arguments_json)
        except json.JSONDecodeError:
            return f"arguments of {call.name} are not JSON"
        if not isinstance(arguments, dict):
            return f"arguments of {call.name} are not a JSON object"
    return None


class Agent:
    """One agent's tool loop; delegate runs a nested Agent with its own id.

    Not thread-safe and not reusable across tasks: one instance runs one task. `logger` is a structlog logger
    (default: this module's); the expert passes a quiet one when it writes hundreds of demonstrations.
    """

    def __init__(
        self,
        call_model: CallModel,
        workspace: Path,
        config: AgentConfig = AgentConfig(),
        *,
        agent_id: str = MAIN_AGENT_ID,
        sub_agent_ids: Iterator[int] | None = None,
        logger: Any = None,
    ) -> None:
        self._call_model = call_model
        self._workspace = workspace
        self._config = config
        self._agent_id = agent_id
        is_main = agent_id == MAIN_AGENT_ID
        self._tools = prompts.MAIN_TOOLS if is_main else prompts.SUB_AGENT_TOOLS
        self._allowed = prompts.tool_names(self._tools)
        self._max_turns = config.max_turns if is_main else config.sub_agent_max_turns
        # Ids count across the whole execution, so every sub-agent of one execution has its own id.
        self._sub_agent_ids = sub_agent_ids if sub_agent_ids is not None else itertools.count(1)
        self._retries = 0
        self._summaries = 0
        self._logger = logger if logger is not None else log
        self._log = self._logger.bind(agent=agent_id)

    def run(self, task_prompt: str) -> AgentResult:
        """Work on the task until a final answer or the turn bound."""
        messages = self._fresh_context(task_prompt)
        for turn in range(1, self._max_turns + 1):
            if (
                prompts.conversation_chars(messages) > self._config.context_budget_chars
                and self._summaries < self._config.max_summaries
            ):
                messages = self._compress(messages, task_prompt)
            reply, problem = self._call(messages, CALL_TURN)
            messages.append(reply.message())
            if problem is not None and not reply.tool_calls:
                # Still malformed after every retry and nothing to run: say so and let the model try again.
                messages.append({"role": "user", "content": prompts.FORMAT_HINT})
                continue
            if not reply.tool_calls:
                self._log.info("agent_finished", turns=turn)
                return self._result(True, reply.content.strip(), turn)
            for call in reply.tool_calls:
                observation = self._run_tool(call)
                self._log.debug("tool_called", tool=call.name, turn=turn, arguments=call.arguments_json[:LOG_CHARS],
                                observation=observation[:LOG_CHARS], observation_chars=len(observation))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": observation})
        self._log.warning("agent_out_of_turns", turns=self._max_turns)
        return self._result(False, "", self._max_turns)

    def _result(self, finished: bool, final_text: str, turns: int) -> AgentResult:
        return AgentResult(self._agent_id, finished, final_text, turns, self._retries, self._summaries)

    def _fresh_context(self, user_text: str) -> list[dict[str, Any]]:
        return [{"role": "system", "content": prompts.SYSTEM_PROMPT}, {"role": "user", "content": user_text}]

    def _call(self, messages: list[dict[str, Any]], call_kind: str) -> tuple[ModelReply, str | None]:
        """Call the model, asking again (same prompt) while the reply is malformed, at most max_retries times."""
        for attempt in range(self._config.max_retries + 1):
            reply = self._call_model(list(messages), self._tools, self._agent_id, call_kind)
            problem = reply_problem(reply, self._allowed, call_kind=call_kind)
            if problem is None:
                return reply, None
            self._log.info("malformed_reply", problem=problem, attempt=attempt, call_kind=call_kind)
            if attempt < self._config.max_retries:
                self._retries += 1
        return reply, problem

    def _compress(self, messages: list[dict[str, Any]], task_prompt: str) -> list[dict[str, Any]]:
        """Summary call on the whole context, then a fresh context: the task plus the summary as notes."""
        request = [*messages, {"role": "user", "content": prompts.SUMMARY_REQUEST}]
        reply, _ = self._call(request, CALL_SUMMARY)
        self._summaries += 1
        summary = reply.content.strip()[:MAX_SUMMARY_CHARS]
        before_chars = prompts.conversation_chars(messages)
        self._log.info("context_compressed", before_chars=before_chars, summary_chars=len(summary))
        return self._fresh_context(prompts.restart_prompt(task_prompt, summary))

    def _run_tool(self, call: ToolCall) -> str:
        try:
            arguments = json.loads(call.arguments_json)
        except json.JSONDecodeError:
            return "error: arguments are not JSON"
        if call.name == "delegate" and call.name in self._allowed:
            return self._delegate(arguments)
        return tools.run_tool(self._workspace, call.name, arguments)

    def _delegate(self, arguments: Any) -> str:
        task = arguments.get("task") if isinstance(arguments, dict) else None
        if not isinstance(task, str) or not task.strip():
            return "error: task must be a non-empty string"
        number = next(self._sub_agent_ids)
        if number > self._config.max_sub_agents:
            return "error: no more sub-agents"
        sub_agent = Agent(
            self._call_model,
            self._workspace,
            self._config,
            agent_id=f"sub-{number}",
            sub_agent_ids=self._sub_agent_ids,
            logger=self._logger,
        )
        result = sub_agent.run(task)
        if not result.finished:
            return "error: sub-agent did not finish"
        return result.final_text or "error: sub-agent gave no answer"


class OpenAIModel:
    """CallModel over an OpenAI-compatible endpoint (Gyre's proxy), labelling each call with Gyre's headers."""

    def __init__(self, client: Any, model: str, *, temperature: float, max_tokens: int) -> None:
        self._client = client
        self._model = model
        self._temperature = temperature
        self._max_tokens = max_tokens

    def __call__(
        self, messages: list[dict[str, Any]], tools_: tuple[dict[str, Any], ...], agent_id: str, call_kind: str
    ) -> ModelReply:
        completion = self._client.chat.completions.create(
            model=self._model,
            messages=messages,
            tools=list(tools_),
            temperature=self._temperature,
            max_tokens=self._max_tokens,
            extra_headers={"X-Gyre-Agent": agent_id, "X-Gyre-Call": call_kind},
        )
        choice = completion.choices[0]
        calls = tuple(
            ToolCall(call.id, call.function.name, call.function.arguments)
            for call in choice.message.tool_calls or ()
            if call.type == "function"
        )
        return ModelReply(choice.message.content or "", calls, choice.finish_reason or "stop")


def agent_argv(task_prompt: str, *, python: str = sys.executable) -> tuple[str, ...]:
    """Command line that runs this agent on a task (the executor runs it in the workspace)."""
    return (python, str(Path(__file__).resolve()), task_prompt)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = AgentConfig()
    parser = argparse.ArgumentParser(description="Toolbox example agent (OpenAI chat completions with tools).")
    parser.add_argument("prompt", nargs="?", help="the task; or use --prompt-file")
    parser.add_argument("--prompt-file", type=Path, help="read the task from this file")
    parser.add_argument("--workspace", type=Path, default=Path.cwd(), help="workspace (default: current directory)")
    parser.add_argument("--model", default=os.environ.get("GYRE_MODEL", "gyre"), help="model name (env GYRE_MODEL)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=160, help="per model call")
    parser.add_argument("--max-turns", type=int, default=defaults.max_turns)
    parser.add_argument("--sub-agent-max-turns", type=int, default=defaults.sub_agent_max_turns)
    parser.add_argument("--max-sub-agents", type=int, default=defaults.max_sub_agents)
    parser.add_argument("--max-retries", type=int, default=defaults.max_retries)
    parser.add_argument("--budget-chars", type=int, default=defaults.context_budget_chars)
    parser.add_argument("--max-summaries", type=int, default=defaults.max_summaries)
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    if (args.prompt is None) == (args.prompt_file is None):
        parser.error("give the task either as PROMPT or with --prompt-file")
    return args


def plain_http_client(base_url: str) -> Any:
    """For a plain-http endpoint (Gyre's proxy), an HTTP client whose TLS context trusts no certificate; None (the
    SDK's default client) for any other.

    Why: the default client builds a TLS context that parses the system's CA bundle, ~30 ms of CPU a client, even
    when every request goes over plain http; the executor runs thousands of agents, and the warm launcher cannot
    pay this once for them (each client builds its own context; benchmarks/studies/agent_client_cost.py: 30.2 ms against
    2.1). A context that trusts nothing is not an unverified one: were the endpoint to redirect to https, that
    connection would fail its certificate check."""
    if not base_url.startswith("http://"):
        return None
    import openai

    return openai.DefaultHttpxClient(verify=trust_nothing_tls_context())


def trust_nothing_tls_context() -> Any:
    """A TLS client context that checks certificates and host names, with no CA loaded: cheap to build, and no
    certificate passes it."""
    import ssl

    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


def main(argv: list[str] | None = None) -> int:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    args = _parse_args(argv)
    task_prompt = args.prompt if args.prompt is not None else args.prompt_file.read_text(encoding="utf-8").strip()
    try:
        config = AgentConfig(
            max_turns=args.max_turns,
            sub_agent_max_turns=args.sub_agent_max_turns,
            max_sub_agents=args.max_sub_agents,
            max_retries=args.max_retries,
            context_budget_chars=args.budget_chars,
            max_summaries=args.max_summaries,
        )
    except ValueError as error:
        print(f"agent.py: error: {error}", file=sys.stderr)
        return 2

    import openai  # here, not at the top: the loop above is used without any endpoint (by the expert)

    # The SDK reads OPENAI_BASE_URL and OPENAI_API_KEY; retries of failed HTTP calls stay off so that every
    # model call the proxy sees is one the agent meant to make.
    client = openai.OpenAI(max_retries=0, timeout=args.request_timeout_s,
                           http_client=plain_http_client(os.environ.get("OPENAI_BASE_URL", "")))
    model = OpenAIModel(client, args.model, temperature=args.temperature, max_tokens=args.max_tokens)
    try:
        result = Agent(model, args.workspace, config).run(task_prompt)
    except openai.OpenAIError as error:
        log.error("model_endpoint_failed", error=str(error))
        return 1
    return 0 if result.finished else 3


if __name__ == "__main__":
    sys.exit(main())
