"""`gyre serve MODEL_DIR [--engine-url URL ...]`: the proxy in front of an engine, for interactive use and for
collecting trajectories.

Without --engine-url the engine is an embedded one in this process. With it, the engines are servers that already
run (SGLang, `python -m sglang.launch_server --model-path ... --skip-tokenizer-init`, or Gyre's engine server),
reached only through SGLang's HTTP API; --engine-url may repeat, and sessions are routed among the servers as among
a run's rollout cells (sticky, least loaded; a server that dies is skipped and its sessions re-prefill elsewhere:
actors/serving/engine_watch.py). MODEL_DIR gives the tokenizer and the chat template, and each server is checked at
start to hold MODEL_DIR's model (vocabulary and layout); a server of another model is refused. The servers' key:
--engine-api-key-file PATH (SGLang's --api-key), else none is needed beyond Gyre's run token.

Any OpenAI or Anthropic client can talk to it (base URL http://HOST:PORT/v1 for OpenAI, http://HOST:PORT for
Anthropic). Every call must present the API key; all calls belong to one execution, "interactive", so the proxy
reuses the ids of its own earlier answers exactly, as it does in training. Each call is logged as one line, and with
--record PATH appended to PATH as one JSON object (a ModelCallCompleted with its whole prompt ids rebuilt, output
ids, log-probs, weight versions, timings: `CallRecorder`): the token-in/token-out trajectories, as a run records
them.

The key, in order: --api-key-file PATH (its first line), $GYRE_API_KEY, --api-key (discouraged: any user of the
machine can read a command line with ps). With none, a random key is written to a new 0600 file in a 0700
directory, and that file's path is printed. The key itself is never printed or logged. --max-context-tokens may
not exceed the model's max_position_embeddings. --earlier-turns chooses what a prompt holds where a checkpoint's own
chat template re-renders a turn the model generated (Qwen3 drops earlier `<think>` blocks): keep_generated (the
default: the generated ids, the prompt extending the previous call's prompt and output) or follow_template (the
template's text exactly); `ProxySessionsConfig.earlier_turns` in actors/serving/sessions.py says more. Gyre's own
template never re-renders a turn, so the flag changes nothing there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

import attrs
import structlog

from gyre.actors.errors import ActorError

log = structlog.get_logger(__name__)

INTERACTIVE_EXECUTION = "interactive"
API_KEY_ENV = "GYRE_API_KEY"
MAX_KEY_FILE_BYTES = 4096  # a key is one line; a bigger file is the wrong file
# ProxySessionsConfig's choices (sessions.EARLIER_TURNS, checked equal by a test), spelled here so that `gyre`'s start
# does not import the proxy for every command.
EARLIER_TURNS = ("keep_generated", "follow_template")


class ServeError(ActorError, ValueError):
    """`gyre serve` cannot start as asked (a key it cannot read, a context the model cannot hold)."""


@attrs.frozen
class ServeConfig:
    model_dir: str
    api_key: str = attrs.field(repr=False)  # never in a repr, hence never in a log line
    model_name: str
    max_context_tokens: int = 8192
    block_size_tokens: int = 16
    num_threads: int | None = None
    engine_urls: tuple[str, ...] = ()
    """Engine servers that already run; () serves an embedded engine."""
    engine_api_key_file: str | None = None
    """The file holding the engine servers' key (SGLang's --api-key); None: Gyre's run token."""
    engine_startup_timeout_s: float = 120.0
    record_path: str | None = None
    """Append every ModelCallCompleted here as one JSON line; None: log lines only."""
    earlier_turns: str = attrs.field(default=EARLIER_TURNS[0], validator=attrs.validators.in_(EARLIER_TURNS))
    """What a prompt holds where a checkpoint's template re-renders a generated turn (ProxySessionsConfig's
    earlier_turns): "keep_generated" or "follow_template"."""


class CallRecorder:
    """Appends each finished call to a JSONL file (one ModelCallCompleted per line, its fields by name, plus
    "type"); flushed per line, so a killed `gyre serve` loses no finished call.

    The proxy's records are incremental (they name the earlier call they extend and carry only the new prompt ids);
    a user of the file wants whole prompts, so the recorder rebuilds each one through a token tree of the
    execution's calls (stored once, checked against the record's digest) and writes it as "prompt_ids" in place of
    "new_prompt_ids"; "prompt_digest" is written in hex. The tree is bounded (`tree`); when it is full the
    recorder starts another, and a record that names a call of the old one is written with "prompt_ids": null and
    "prompt_error" saying why (as is one whose prompt does not rebuild)."""

    def __init__(self, path: str, tree: Any = None) -> None:
        from gyre.policies.trajectory_tree import TreeConfig

        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self.calls_recorded = 0
        self.prompts_lost = 0
        """Records written without their whole prompt (prompt_error)."""
        # 2M stored tokens (64 MB of tree) per execution: a long interactive session, not a run's worth.
        self._tree_config = tree if tree is not None else TreeConfig(max_stored_tokens=2_000_000)
        self._trees: dict[str, Any] = {}

    def _prompt_ids(self, message: Any) -> tuple[list[int] | None, str]:
        from gyre.policies.trajectory_tree import TrajectoryError, TrajectoryTree, TreeFull

        tree = self._trees.get(message.execution_id)
        if tree is None:
            tree = self._trees[message.execution_id] = TrajectoryTree(
                message.execution_id, message.group_id, self._tree_config
            )
        try:
            tree.add_call(message)
        except TreeFull:
            # Start over: later calls that extend calls of the old tree cannot be rebuilt (said in their record).
            tree = self._trees[message.execution_id] = TrajectoryTree(
                message.execution_id, message.group_id, self._tree_config
            )
            try:
                tree.add_call(message)
            except TrajectoryError as error:
                return None, str(error)
        except TrajectoryError as error:
            return None, str(error)
        try:
            return list(tree.prompt_ids(message.call_index)), ""
        except KeyError:  # it waits for a call this recorder never got
            return None, f"extends call {message.extends_call}, which this recorder does not hold"

    def __call__(self, message: Any) -> None:
        _log_call(message)
        fields = attrs.asdict(message)
        prompt_ids, error = self._prompt_ids(message)
        del fields["new_prompt_ids"]
        fields["prompt_digest"] = message.prompt_digest.hex()
        record = {"type": type(message).__name__, **fields, "prompt_ids": prompt_ids}
        if error:
            record["prompt_error"] = error
            self.prompts_lost += 1
            log.error("recorded_call_without_prompt", call_index=message.call_index, reason=error)
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        self.calls_recorded += 1

    def close(self) -> None:
        self._file.close()


def _log_call(message: Any) -> None:
    log.info(
        "model_call",
        execution_id=message.execution_id,
        call_index=message.call_index,
        agent_id=message.agent_id,
        call_kind=message.call_kind,
        prompt_tokens=message.prompt_tokens,
        output_tokens=len(message.output_ids),
        cached_tokens=message.cached_tokens,
        finish_reason=message.finish_reason,
        seconds=round(message.finished_s - message.started_s, 3),
    )


async def make_app(config: ServeConfig) -> Any:
    """The proxy application over a fresh embedded engine, or over the engine servers at `config.engine_urls`
    (call inside the loop that will serve it). EngineWatchError when a server cannot be used."""
    from gyre.actors.serving.http_app import check_context_fits
    from gyre.engines.chat_template import ChatTemplate

    check_context_fits(config.model_dir, config.max_context_tokens)
    template = ChatTemplate.from_model_dir(config.model_dir)
    recorder = CallRecorder(config.record_path) if config.record_path else None
    on_call = recorder if recorder is not None else _log_call
    if config.engine_urls:
        app = await _app_over_servers(config, template, on_call)
    else:
        app = await _app_over_embedded(config, template, on_call)
    if recorder is not None:
        async def close_recorder(_: Any) -> None:
            recorder.close()

        app.on_cleanup.append(close_recorder)
    return app


def _sessions(template: Any, config: ServeConfig) -> Any:
    from gyre.actors.serving.sessions import ProxySessions, ProxySessionsConfig

    sessions = ProxySessions(template, ProxySessionsConfig(max_executions=1, earlier_turns=config.earlier_turns))
    sessions.issue_key(INTERACTIVE_EXECUTION, INTERACTIVE_EXECUTION, api_key=config.api_key)
    return sessions


async def _app_over_servers(config: ServeConfig, template: Any, on_call: Any) -> Any:
    from gyre.actors.serving.engine_watch import EngineWatch, EngineWatchConfig
    from gyre.actors.serving.http_app import ProxyHttpConfig, build_proxy_app
    from gyre.actors.serving.routing import RoutedBackend, RoutingConfig
    from gyre.engines.model_format import ModelSpec
    from gyre.engines.sglang_client import ClientConfig, SGLangClient

    client_config = ClientConfig(api_key_file=config.engine_api_key_file)
    routing = RoutingConfig(client=client_config)
    backend = RoutedBackend(routing, lambda url: SGLangClient(url, config=client_config))
    watch = EngineWatch(backend, config.engine_urls, ModelSpec.from_model_dir(config.model_dir), config.model_dir,
                        lambda url: SGLangClient(url, config=client_config),
                        EngineWatchConfig(startup_timeout_s=config.engine_startup_timeout_s))
    try:
        await watch.check_all()
    except BaseException:
        await watch.close()
        await backend.close()
        raise
    proxy_config = ProxyHttpConfig(model_names=(config.model_name,), max_context_tokens=config.max_context_tokens)
    app = build_proxy_app(proxy_config, _sessions(template, config), backend, on_call, clock=time.time)
    watching = asyncio.ensure_future(watch.run())

    async def on_shutdown(_: Any) -> None:
        backend.stop_accepting()

    async def close(_: Any) -> None:
        watching.cancel()
        try:
            await watching
        except asyncio.CancelledError:
            pass
        await watch.close()
        await backend.close()

    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(close)
    return app


async def _app_over_embedded(config: ServeConfig, template: Any, on_call: Any) -> Any:
    from gyre.actors.serving.backends import EmbeddedBackend
    from gyre.actors.serving.http_app import ProxyHttpConfig, build_proxy_app
    from gyre.engines.async_engine import AsyncEngine
    from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig

    # Room for two full contexts, so one long conversation never starves the prefix cache of the next call.
    num_blocks = max(256, 2 * -(-config.max_context_tokens // config.block_size_tokens))
    engine_config = EngineConfig(
        block_size_tokens=config.block_size_tokens,
        num_blocks=num_blocks,
        max_context_tokens=config.max_context_tokens,
        max_prefill_tokens=min(4096, config.max_context_tokens),
        num_threads=config.num_threads,
    )
    engine = AsyncEngine(EmbeddedEngine(config.model_dir, engine_config))
    proxy_config = ProxyHttpConfig(model_names=(config.model_name,), max_context_tokens=config.max_context_tokens)
    app = build_proxy_app(proxy_config, _sessions(template, config), EmbeddedBackend(engine, cell="embedded"),
                          on_call, clock=time.time)

    async def close_engine(_: Any) -> None:
        await engine.close()

    app.on_cleanup.append(close_engine)
    return app


def resolve_api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, str]:
    """(key, where it came from, for the start banner): the key file, $GYRE_API_KEY, --api-key, or a new random
    key written to a fresh 0600 file. ServeError for a key file that cannot be read or holds no key."""
    if args.api_key_file:
        path = Path(args.api_key_file)
        try:
            with open(path, "rb") as file:
                raw = file.read(MAX_KEY_FILE_BYTES + 1)
        except OSError as error:
            raise ServeError(f"cannot read the API key file {path}: {error.strerror or error}") from None
        key = raw.decode("utf-8", "replace").strip().splitlines()[0].strip() if raw.strip() else ""
        if not key or len(raw) > MAX_KEY_FILE_BYTES:
            raise ServeError(f"{path} holds no API key (one line of text)")
        return key, f"the key in {path}"
    if environ.get(API_KEY_ENV):
        return environ[API_KEY_ENV], f"the key in ${API_KEY_ENV}"
    if args.api_key:
        return args.api_key, "the key given with --api-key"
    key = "gyre-" + secrets.token_urlsafe(24)
    directory = Path(tempfile.mkdtemp(prefix="gyre-serve-"))  # 0700
    path = directory / "api_key"
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(key + "\n")
    return key, f"the key written to {path}"


def _handle(args: argparse.Namespace) -> int:
    from aiohttp import web

    from gyre.actors.serving.http_app import check_context_fits
    from gyre.runtime.errors import ConfigError
    from gyre.runtime.logs import configure_logging

    configure_logging()
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        print(f"gyre serve: {model_dir} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    try:
        check_context_fits(model_dir, args.max_context_tokens)
        api_key, key_source = resolve_api_key(args, os.environ)
    except (ConfigError, ServeError) as error:
        print(f"gyre serve: {error}", file=sys.stderr)
        return 2
    engine_urls = tuple(args.engine_url or ())
    for url in engine_urls:
        if not url.startswith(("http://", "https://")):
            print(f"gyre serve: --engine-url {url!r} is not an http:// or https:// URL", file=sys.stderr)
            return 2
    if len(set(u.rstrip("/") for u in engine_urls)) != len(engine_urls):
        print("gyre serve: an --engine-url is given twice", file=sys.stderr)
        return 2
    if args.engine_api_key_file and not engine_urls:
        print("gyre serve: --engine-api-key-file needs --engine-url", file=sys.stderr)
        return 2
    config = ServeConfig(
        model_dir=str(model_dir),
        api_key=api_key,
        model_name=args.model_name or model_dir.resolve().name,
        max_context_tokens=args.max_context_tokens,
        num_threads=args.num_threads,
        engine_urls=engine_urls,
        engine_api_key_file=args.engine_api_key_file,
        engine_startup_timeout_s=args.engine_startup_timeout_s,
        record_path=args.record,
        earlier_turns=args.earlier_turns,
    )
    base = f"http://{args.host}:{args.port}"
    engines = ", ".join(engine_urls) if engine_urls else "an embedded engine"
    print(
        f"gyre serve: model {config.model_name!r} on {base} over {engines}, calls must present {key_source}\n"
        f"  OpenAI:    OPENAI_BASE_URL={base}/v1 OPENAI_API_KEY=<that key>\n"
        f"  Anthropic: ANTHROPIC_BASE_URL={base} ANTHROPIC_API_KEY=<that key>",
        flush=True,
    )
    from gyre.actors.serving.http_app import ProxyHttpConfig, runner_options

    from gyre.actors.serving.engine_watch import EngineWatchError
    from gyre.engines.errors import EngineError

    options = runner_options(ProxyHttpConfig(max_context_tokens=config.max_context_tokens))
    try:
        web.run_app(make_app(config), host=args.host, port=args.port, print=None, access_log=None,
                    shutdown_timeout=5.0, **options)
    except (EngineWatchError, EngineError) as error:  # a server that cannot be used, a key file that cannot be read
        print(f"gyre serve: {error}", file=sys.stderr)
        return 2
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve a model directory through the proxy (OpenAI and Anthropic APIs)")
    p.add_argument("model_dir", help="model directory (config.json, model.safetensors, tokenizer files)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="file whose first line is the key every call must present")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"the key itself; discouraged (ps shows it): prefer --api-key-file or ${API_KEY_ENV}. With "
                   "none of them a random key is written to a new 0600 file, whose path is printed")
    p.add_argument("--model-name", default=None, help="model id to serve (default: the directory's name)")
    p.add_argument("--max-context-tokens", type=int, default=8192)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads for the engine")
    p.add_argument("--engine-url", action="append", default=None, metavar="URL",
                   help="an engine server that already runs (SGLang, or Gyre's engine server), reached over SGLang's "
                   "HTTP API; repeat for several (sessions are routed among them). Without it: an embedded engine")
    p.add_argument("--engine-api-key-file", default=None, metavar="PATH",
                   help="file holding the engine servers' key (the --api-key SGLang was started with)")
    p.add_argument("--engine-startup-timeout-s", type=float, default=120.0,
                   help="how long each --engine-url server may take to answer /health at start (default 120)")
    p.add_argument("--record", default=None, metavar="PATH",
                   help="append every finished call (prompt and output ids, log-probs, versions) to PATH as JSONL")
    p.add_argument("--earlier-turns", choices=EARLIER_TURNS, default=EARLIER_TURNS[0],
                   help="where the model's own chat template re-renders a turn the model generated (Qwen3 drops "
                   "earlier <think> blocks): keep_generated (default) keeps the generated ids, so each prompt extends "
                   "the previous prompt and output; follow_template gives the template's text exactly")
    p.set_defaults(func=_handle)
