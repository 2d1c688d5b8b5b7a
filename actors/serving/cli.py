"""`gyre serve MODEL_DIR`: one embedded rollout engine behind the proxy, for interactive use.

Any OpenAI or Anthropic client can talk to it (base URL http://HOST:PORT/v1 for OpenAI, http://HOST:PORT for
Anthropic). Every call must present the API key; all calls belong to one execution, "interactive", so the proxy
reuses the ids of its own earlier answers exactly, as it does in training. Each call is logged as one line.
"""

from __future__ import annotations

import argparse
import os
import secrets
import time
from pathlib import Path
from typing import Any

import attrs
import structlog

log = structlog.get_logger(__name__)

INTERACTIVE_EXECUTION = "interactive"


@attrs.frozen
class ServeConfig:
    model_dir: str
    api_key: str
    model_name: str
    max_context_tokens: int = 8192
    block_size_tokens: int = 16
    num_threads: int | None = None


def _log_call(message: Any) -> None:
    log.info(
        "model_call",
        execution_id=message.execution_id,
        call_index=message.call_index,
        agent_id=message.agent_id,
        call_kind=message.call_kind,
        prompt_tokens=len(message.prompt_ids),
        output_tokens=len(message.output_ids),
        cached_tokens=message.cached_tokens,
        finish_reason=message.finish_reason,
        seconds=round(message.finished_s - message.started_s, 3),
    )


async def make_app(config: ServeConfig) -> Any:
    """The proxy application over a fresh embedded engine (call inside the loop that will serve it)."""
    from gyre.actors.serving.backends import EmbeddedBackend
    from gyre.actors.serving.http_app import ProxyHttpConfig, build_proxy_app
    from gyre.actors.serving.sessions import ProxySessions, ProxySessionsConfig
    from gyre.engines.async_engine import AsyncEngine
    from gyre.engines.chat_template import ChatTemplate
    from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig

    template = ChatTemplate.from_model_dir(config.model_dir)
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
    sessions = ProxySessions(template, ProxySessionsConfig(max_executions=1))
    sessions.issue_key(INTERACTIVE_EXECUTION, INTERACTIVE_EXECUTION, api_key=config.api_key)
    proxy_config = ProxyHttpConfig(model_names=(config.model_name,), max_context_tokens=config.max_context_tokens)
    app = build_proxy_app(proxy_config, sessions, EmbeddedBackend(engine, cell="embedded"), _log_call, clock=time.time)

    async def close_engine(_: Any) -> None:
        await engine.close()

    app.on_cleanup.append(close_engine)
    return app


def _handle(args: argparse.Namespace) -> int:
    from aiohttp import web

    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        print(f"gyre serve: {model_dir} is not a model directory (no config.json)")
        return 2
    api_key = args.api_key or os.environ.get("GYRE_API_KEY") or "gyre-" + secrets.token_urlsafe(18)
    config = ServeConfig(
        model_dir=str(model_dir),
        api_key=api_key,
        model_name=args.model_name or model_dir.resolve().name,
        max_context_tokens=args.max_context_tokens,
        num_threads=args.num_threads,
    )
    print(
        f"gyre serve: model {config.model_name!r} on http://{args.host}:{args.port}\n"
        f"  OpenAI:    OPENAI_BASE_URL=http://{args.host}:{args.port}/v1 OPENAI_API_KEY={api_key}\n"
        f"  Anthropic: ANTHROPIC_BASE_URL=http://{args.host}:{args.port} ANTHROPIC_API_KEY={api_key}",
        flush=True,
    )
    web.run_app(make_app(config), host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=5.0)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve a model directory through the proxy (OpenAI and Anthropic APIs)")
    p.add_argument("model_dir", help="model directory (config.json, model.safetensors, tokenizer files)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--api-key", default=None,
                   help="key every call must present (default: $GYRE_API_KEY, else a random key printed at start)")
    p.add_argument("--model-name", default=None, help="model id to serve (default: the directory's name)")
    p.add_argument("--max-context-tokens", type=int, default=8192)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads for the engine")
    p.set_defaults(func=_handle)
