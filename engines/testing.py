"""Public testing helpers of the engines layer: a fake SGLang server that really generates.

`build_fake_sglang_app` serves Gyre's embedded engine behind *only* SGLang's own routes and fields, so that code
written for SGLang (a cell of engine kind "server" or "url", the proxy's `--engine-url`, the KV migrator) can be
tested here against SGLang's API rather than Gyre's superset of it. Taken from SGLang's source
(sglang/srt/entrypoints/http_server.py for the routes, managers/io_struct.py `GenerateReqInput` for /generate's
body, sampling/sampling_params.py `SamplingParams` for sampling_params; see shared/reference/sglang.md):

- no /gyre/* route (a 404, as on SGLang), no `output_token_versions`; `weight_version` is a string ("default" until
  an update names one), one per request;
- sampling_params go through SGLang's key set: an unknown key is a 400, as SGLang's `SamplingParams(**params)`
  raises; keys SGLang knows but the embedded engine cannot honour (min_p, penalties, regex, ...) are accepted at
  their defaults and refused (400) otherwise, so a test never passes on a parameter that was silently ignored;
- top-level fields of /generate outside `GenerateReqInput` are ignored (SGLang's HTTP layer builds the dataclass
  through pydantic, which drops unknown fields), but the fields it knows and this fake cannot serve (text,
  input_embeds, image_data, lora_path, batches) are a 400;
- /model_info and /get_model_info answer SGLang's fields (model_path, tokenizer_path, is_generation,
  preferred_sampling_params, weight_version), not Gyre's layout: a cell checks the model through model_path;
- /pause_generation takes {"mode"} (SGLang >= 0.5.6; `legacy_pause=True` serves the older body-less route that only
  aborts); /get_load answers SGLang's per-rank list;
- with an `api_key`, every route but /health and /health_generate needs `Authorization: Bearer <key>` (SGLang's
  --api-key middleware); the error body is {"error": {"message"}} (SGLang's ORJSONResponse) with 400/401/404.

Run it as a process: `python -m gyre.engines.testing --model-dir D --port P` (key from GYRE_ENGINE_API_KEY, or none).
It is a test fixture, not a server to deploy: it trusts its callers as SGLang's HTTP layer does.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Awaitable, Callable

import structlog
from aiohttp import hdrs, web

from gyre.engines.async_engine import AsyncEngine
from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig, GenerateOutput
from gyre.engines.engine_server import API_KEY_ENV, sampling_params_from_json
from gyre.engines.errors import BadRequest, EngineClosed, EngineFailed, EngineOverloaded, RequestError

__all__ = ["FAKE_SGLANG_ROUTES", "SGLANG_GENERATE_FIELDS", "SGLANG_SAMPLING_DEFAULTS", "build_fake_sglang_app",
           "spread_state_dict"]

log = structlog.get_logger(__name__)

SGLANG_GENERATE_FIELDS = frozenset({
    "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "sampling_params", "rid",
    "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs",
    "stream", "log_metrics", "return_hidden_states", "modalities", "session_params", "lora_path", "lora_id",
    "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room", "data_parallel_rank",
    "no_logs", "priority",
})
"""GenerateReqInput's fields (io_struct.py)."""
SERVED_GENERATE_FIELDS = frozenset({"input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
                                    "stream", "log_metrics", "no_logs", "priority", "return_text_in_logprobs"})
SGLANG_SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "stop_regex": None, "temperature": 1.0,
    "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "no_stop_trim": False, "custom_params": None, "stream_interval": None, "logit_bias": None, "sampling_seed": None,
}
"""SamplingParams' keyword arguments and their defaults (sampling_params.py)."""
HONOURED_SAMPLING = frozenset({"max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k",
                               "ignore_eos", "skip_special_tokens", "no_stop_trim", "sampling_seed"})
"""The keys the embedded engine really applies; the rest must stay at SGLang's default."""
OPEN_PATHS = frozenset({"/health", "/health_generate"})


def spread_state_dict(spec: Any, seed: int, std: float = 0.08) -> dict[str, Any]:
    """HF weights for parity checks: matrices drawn wider than init (`std`, from `seed`) and every norm weight random
    in [0.5, 1.5) (from seed + 1), so a wrong mapping, a dropped tie or a misrouted expert shows far above a parity
    tolerance, where init's unit norms would hide a swapped norm."""
    import torch

    from gyre.engines.model_format import init_state_dict

    state = init_state_dict(spec, seed=seed, std=std)
    g = torch.Generator().manual_seed(seed + 1)
    for name, tensor in state.items():
        if tensor.dim() == 1:
            state[name] = torch.rand(tensor.shape, generator=g) + 0.5
    return state


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _sglang_sampling(raw: Any) -> dict[str, Any]:
    """SGLang's reading of sampling_params, mapped onto what the embedded engine takes (BadRequest otherwise)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be an object")
    unknown = sorted(set(raw) - set(SGLANG_SAMPLING_DEFAULTS))
    if unknown:  # SGLang: SamplingParams(**sampling_params) raises TypeError
        raise BadRequest(f"SamplingParams.__init__() got an unexpected keyword argument '{unknown[0]}'")
    unserved = sorted(k for k, v in raw.items() if k not in HONOURED_SAMPLING and v != SGLANG_SAMPLING_DEFAULTS[k])
    if unserved:
        raise BadRequest(f"the fake SGLang server cannot honour sampling_params {unserved}")
    params = {k: v for k, v in raw.items() if k in HONOURED_SAMPLING}
    if params.get("top_k") == -1:  # SGLang's "no top-k"
        del params["top_k"]
    if "max_new_tokens" not in params:
        params["max_new_tokens"] = SGLANG_SAMPLING_DEFAULTS["max_new_tokens"]
    return params


class FakeSGLang:
    """The route handlers over one AsyncEngine."""

    def __init__(self, engine: AsyncEngine, model_path: str, legacy_pause: bool = False,
                 hicache_storage_backend: str = "") -> None:
        self.engine = engine
        self.model_path = model_path
        self.legacy_pause = legacy_pause
        self.hicache_storage_backend = hicache_storage_backend
        self.weight_version = "default"
        self._released = False

    async def _json(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise BadRequest(f"invalid JSON: {error}") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        return body

    def _meta(self, output_rid: str, finish: Any, prompt: int, ids: list[int], logprobs: list[float],
              cached: int, started: float, return_logprob: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {"id": output_rid, "finish_reason": finish, "prompt_tokens": prompt,
                                "completion_tokens": len(ids), "cached_tokens": cached,
                                "weight_version": self.weight_version, "e2e_latency": time.monotonic() - started}
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, ids)]
        return meta

    @staticmethod
    def _finish(output: GenerateOutput) -> dict[str, Any]:
        if output.finish_reason == "stop":
            return {"type": "stop", "matched": output.matched_stop}
        if output.finish_reason == "length":
            return {"type": "length", "length": len(output.output_ids)}
        return {"type": "abort", "message": "Abort before prefill" if not output.output_ids else "Abort"}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        body = await self._json(request)
        body = {k: v for k, v in body.items() if k in SGLANG_GENERATE_FIELDS}  # pydantic drops the rest
        unserved = sorted(k for k in body if k not in SERVED_GENERATE_FIELDS and body[k] is not None)
        if unserved:
            raise BadRequest(f"the fake SGLang server serves token ids only, not {unserved}")
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
            raise BadRequest("input_ids must be a non-empty list of token ids (one request per call)")
        if self._released:  # SGLang with its memory released: the scheduler cannot run it
            raise BadRequest("memory is released; resume it first", "engine_released", 503)
        params, _ = sampling_params_from_json(_sglang_sampling(body.get("sampling_params")))
        rid = body.get("rid")
        return_logprob = bool(body.get("return_logprob", False))
        if body.get("stream"):
            return await self._stream(request, rid, ids, params, return_logprob, started)
        output = await self.engine.generate(rid, ids, params, return_logprob)
        out_ids = list(output.output_ids)
        return web.json_response({"output_ids": out_ids, "meta_info": self._meta(
            output.rid, self._finish(output), output.prompt_tokens, out_ids, list(output.output_logprobs),
            output.cached_tokens, started, return_logprob)})

    async def _stream(self, request: web.Request, rid: Any, ids: list[int], params: Any, return_logprob: bool,
                      started: float) -> web.StreamResponse:
        events = self.engine.stream(rid, ids, params, return_logprob)
        first = await events.__anext__()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        out_ids: list[int] = []
        logprobs: list[float] = []
        event = first
        try:
            while True:
                out_ids.extend(event.token_ids)
                logprobs.extend(event.logprobs)
                done = event.finished
                finish = self._finish(done) if done is not None else None
                cached = done.cached_tokens if done is not None else 0
                chunk = {"output_ids": list(out_ids), "meta_info": self._meta(
                    event.rid, finish, len(ids), out_ids, logprobs, cached, started, return_logprob)}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if done is not None:
                    break
                event = await events.__anext__()
        except (EngineFailed, EngineClosed, RequestError) as error:
            await response.write(b"data: " + json.dumps({"error": {"message": str(error)}}).encode() + b"\n\n")
        finally:
            await events.aclose()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if body.get("abort_all"):
            await self.engine.abort_all()
        elif isinstance(body.get("rid"), str):
            await self.engine.abort(body["rid"])
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if self.legacy_pause:
            if body:
                raise BadRequest("this SGLang (<= 0.5.5) takes no body on /pause_generation")
            mode = "abort"
        else:
            mode = body.get("mode", "abort")
            if mode not in ("abort", "retract", "in_place"):
                raise BadRequest(f"invalid mode {mode!r}")
        await self.engine.pause(mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self.engine.continue_generation()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if not await self.engine.flush_cache():
            return web.Response(status=400, text="Cache not flushed. Please check the server log.")
        return web.Response(status=200, text="Cache flushed.")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path is required")
        if body.get("abort_all_requests"):
            await self.engine.abort_all()
        version = body.get("weight_version")
        number = int(version) if isinstance(version, str) and version.isdigit() else 0
        try:
            await self.engine.load_weights_from_disk(path, number)
        except RequestError as error:  # SGLang: {"success": false} with 400
            return web.json_response({"success": False, "message": str(error), "num_paused_requests": 0},
                                     status=400)
        if version is not None:
            self.weight_version = str(version)
        self.model_path = path
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        await self.engine.release_memory(body.get("tags"))
        self._released = True
        return web.Response(status=200)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        await self.engine.resume_memory(body.get("tags"))
        self._released = False
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "tokenizer_path": self.model_path,
                                  "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": self.weight_version, "has_image_understanding": False,
                                  "has_audio_understanding": False, "model_type": "qwen3", "architectures":
                                  ["Qwen3ForCausalLM"]})

    async def server_info(self, request: web.Request) -> web.Response:
        """A few of ServerArgs' fields, as SGLang's /server_info answers them all (plus its version). The HiCache
        fields say what the server was started with; this fake has no hierarchical cache, so a test can check what
        a caller decides from them, not the cache itself."""
        return web.json_response({
            "model_path": self.model_path, "tp_size": 1, "dp_size": 1, "skip_tokenizer_init": True,
            "enable_hierarchical_cache": bool(self.hicache_storage_backend),
            "hicache_storage_backend": self.hicache_storage_backend or None, "version": "0.5.6-gyre-fake",
        })

    async def get_load(self, request: web.Request) -> web.Response:
        stats = await self.engine.stats()
        return web.json_response([{"dp_rank": 0, "num_reqs": stats.running, "num_waiting_reqs": stats.waiting,
                                   "num_tokens": 0}])

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.failure is not None:
            return web.Response(status=503)
        return web.Response(status=200)


FAKE_SGLANG_ROUTES: tuple[tuple[str, str, str], ...] = (
    ("POST", "/generate", "generate"),
    ("POST", "/abort_request", "abort_request"),
    ("POST", "/pause_generation", "pause_generation"),
    ("POST", "/continue_generation", "continue_generation"),
    ("POST", "/flush_cache", "flush_cache"),
    ("GET", "/flush_cache", "flush_cache"),
    ("POST", "/update_weights_from_disk", "update_weights_from_disk"),
    ("POST", "/release_memory_occupation", "release_memory_occupation"),
    ("POST", "/resume_memory_occupation", "resume_memory_occupation"),
    ("GET", "/model_info", "model_info"),
    ("GET", "/get_model_info", "model_info"),
    ("GET", "/get_load", "get_load"),
    ("GET", "/server_info", "server_info"),
    ("GET", "/get_server_info", "server_info"),
    ("GET", "/health", "health"),
    ("GET", "/health_generate", "health"),
)
"""SGLang's routes that the fake serves (http_server.py), as (method, path, FakeSGLang method)."""


def _wrap(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Callable:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as error:
            return _error(error.status, error.message)
        except EngineOverloaded as error:
            return _error(503, str(error))
        except RequestError as error:
            return _error(400, str(error))
        except (EngineFailed, EngineClosed) as error:
            return _error(500, str(error))

    return wrapped


def build_fake_sglang_app(async_engine: AsyncEngine, model_path: str, *, api_key: str | None = None,
                          legacy_pause: bool = False, hicache_storage_backend: str = "") -> web.Application:
    """The fake SGLang server's aiohttp application (see the module docstring); no key check when `api_key` is
    None, as SGLang without --api-key."""
    fake = FakeSGLang(async_engine, model_path, legacy_pause, hicache_storage_backend)
    expected = f"Bearer {api_key}" if api_key is not None else None

    @web.middleware
    async def check_key(request: web.Request, handler: Callable) -> web.StreamResponse:
        if expected is not None and request.path not in OPEN_PATHS:
            if request.headers.get(hdrs.AUTHORIZATION) != expected:
                return _error(401, "Unauthorized")
        return await handler(request)

    app = web.Application(client_max_size=1 << 30, middlewares=[check_key])
    for method, path, name in FAKE_SGLANG_ROUTES:
        handler = _wrap(getattr(fake, name))
        if method == hdrs.METH_GET:
            app.router.add_get(path, handler, allow_head=False)
        else:
            app.router.add_route(method, path, handler)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A fake SGLang server over Gyre's embedded engine (for tests)")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--num-blocks", type=int, default=EngineConfig().num_blocks)
    parser.add_argument("--max-context", type=int, default=EngineConfig().max_context_tokens)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--legacy-pause", action="store_true", help="serve SGLang <= 0.5.5's body-less pause")
    parser.add_argument("--hicache-storage-backend", default="",
                        help="report HiCache with this storage backend in /server_info (no cache is kept)")
    args = parser.parse_args(argv)
    config = EngineConfig(num_blocks=args.num_blocks, max_context_tokens=args.max_context,
                          max_prefill_tokens=min(EngineConfig().max_prefill_tokens, args.max_context),
                          num_threads=args.num_threads)
    engine = AsyncEngine(EmbeddedEngine(args.model_dir, config))
    app = build_fake_sglang_app(engine, args.model_dir, api_key=os.environ.get(API_KEY_ENV) or None,
                                legacy_pause=args.legacy_pause, hicache_storage_backend=args.hicache_storage_backend)

    async def close_engine(app: web.Application) -> None:
        await engine.close()

    app.on_cleanup.append(close_engine)
    log.info("fake_sglang_server_starting", host=args.host, port=args.port)
    web.run_app(app, host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
