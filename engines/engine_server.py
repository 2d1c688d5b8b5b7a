"""HTTP face of the embedded engine: the subset of SGLang's server API that RL frameworks use, plus /gyre/kv/*.

Routes (SGLang shapes; see shared/reference/sglang.md):
- POST /generate: {input_ids, sampling_params, rid, return_logprob, logprob_start_len, stream} ->
  {text, output_ids, meta_info{id, finish_reason, prompt_tokens, completion_tokens, cached_tokens, weight_version,
  output_token_logprobs [[logprob, id, null], ...], output_token_versions, e2e_latency}}. `output_token_versions`
  (the weight version of every output token) is Gyre's addition. With `logprob_start_len >= 0` the prompt's
  log-probs come back as `input_token_logprobs` (first entry null). `stream: true` answers with server-sent events,
  `data: {...}` per step with cumulative text/output_ids/log-probs, then `data: [DONE]`.
- POST /abort_request, /pause_generation, /continue_generation, /flush_cache (400 while requests are in flight and
  generation is not paused), /update_weights_from_disk, /update_weights_from_tensor, /release_memory_occupation,
  /resume_memory_occupation; GET /model_info, /health, /get_load (engine statistics).
- POST /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group: SGLang's
  broadcast path (engines/weight_broadcast.py has the protocol), over gloo on CPU: the server joins the sender's
  group as `rank_offset` (it has one rank) and receives each bucket the sender broadcasts. At most
  MAX_WEIGHT_GROUPS groups at once.
- GET /gyre/live_sequences: prompt + output so far of every generation in the engine (after a pause in place: what
  a KV migration moves, partial outputs included). A cell that hosts this server as a child process asks it while
  draining; SGLang has no such route, so against SGLang the cell aborts and the proxy re-prefills.
- POST /gyre/kv/export, /gyre/kv/import, /gyre/kv/release: move one prefix's KV blocks between two embedded
  engines through Mooncake. The exporter pins the blocks and copies them into one contiguous region of its staging
  buffer (`staging_addr`, `staging_nbytes`); the importer reads that region with one transfer entry and scatters it
  into its pool, or, for an export without a staged copy, reads the pinned blocks one (layer, K/V, run) at a time.

/update_weights_from_tensor payload (Gyre's own, SGLang's pickled format is not accepted): `serialized_named_tensors`
is the base64 text of a safetensors file holding Hugging Face named tensors (or a one-element list of it, as
SGLang sends one entry per TP rank); `load_format` must be null or "safetensors_base64". Tensors may be a subset
(bucketed updates); `weight_version` (int, or a string of one) tags the tokens generated afterwards.

Errors: malformed JSON, unknown fields, bad values -> 400 {"error": {"message", "type"}}; a full queue -> 503; a
/generate while the engine's memory is released (its cell trains) -> 503 "engine_released", so that a call routed
just before the cell drained is retried elsewhere rather than refused; a broken engine -> 500. Handlers never let an exception escape to aiohttp.

Access: every route but /health needs `Authorization: Bearer <key>` (SGLang's header for its --api-key), compared in
constant time; a missing or wrong key is 401. A server a cell hosts in its own process checks the run's engine token
(`run_token("engine")`, which the run's clients send by default); the standalone server (`main`) takes a key file, the
GYRE_ENGINE_API_KEY environment variable or --api-key, and otherwise makes a key, writes it to a 0600 file in a 0700
directory and logs that file's path, never the key. Browsers are kept out twice: a request with an Origin header not
allowed is 403 (only browsers send one), and a POST body must be application/json (415 otherwise), since a page can
send text/plain across origins without asking the server first. The key holds anyone else off: a weight swap, a
pause or a KV export's memory address is for the run only.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import hmac
import json
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Collection

import attrs
import structlog
from aiohttp import hdrs, web

from gyre.engines.async_engine import AsyncEngine
from gyre.engines.embedded_engine import (
    EmbeddedEngine,
    EngineConfig,
    ExportedPrefix,
    GenerateOutput,
    KVLayout,
    SamplingParams,
)
from gyre.engines.errors import (
    BadRequest,
    EngineClosed,
    EngineFailed,
    EngineKeyError,
    EngineOverloaded,
    RequestError,
    TransferError,
)
from gyre.engines.sglang_client import API_KEY_PURPOSE, check_api_key, read_api_key_file
from gyre.engines import weight_broadcast
from gyre.runtime.run_secrets import run_token

log = structlog.get_logger(__name__)

SAMPLING_FIELDS = frozenset(
    {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "seed", "sampling_seed",
     "ignore_eos", "skip_special_tokens", "no_stop_trim"}
)
GENERATE_FIELDS = frozenset({"input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "stream"})
MAX_BODY_BYTES = 2 << 30  # weight updates arrive as one body
SERVER_KEY: web.AppKey = web.AppKey("gyre_server")
API_KEY_ENV = "GYRE_ENGINE_API_KEY"
"""The environment variable the standalone server reads its key from (when no --api-key-file or --api-key)."""
OPEN_PATHS = frozenset({"/health"})
"""Routes answered without a key: a supervisor or load balancer probes them and they tell nothing."""
MAX_WEIGHT_GROUPS = 4
"""Weight-update groups a server holds at once: a sender forms one per server lifetime (a new one after a failed
update), and each holds a store connection and the backend's sockets; more means a sender that leaks groups."""
WEIGHT_GROUP_TIMEOUT_S = 120.0
"""How long joining a group, or receiving one bucket, may take: the sender's side joins within its own HTTP call."""
MIN_API_KEY_CHARS = 16  # a key short enough to guess protects nothing; run_token and generated keys are 64
GENERATED_KEY_BYTES = 32


def _error(status: int, message: str, type_: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": type_}}, status=status)


async def _body(request: web.Request, allowed: frozenset[str], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON object body, with no fields outside `allowed` and every field in `required`."""
    raw = await request.read()
    if not raw.strip():
        body: Any = {}
    else:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise BadRequest(f"body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown fields {unknown}; allowed: {sorted(allowed)}")
    missing = [name for name in required if name not in body]
    if missing:
        raise BadRequest(f"missing fields {missing}")
    return body


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean")
    return value


def _version(value: Any, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool):
        raise BadRequest("weight_version must be an int or a string of an int")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise BadRequest(f"weight_version must be an int or a string of an int, got {value!r}")


def _token_ids(value: Any, name: str = "input_ids") -> list[int]:
    if not isinstance(value, list):
        raise BadRequest(f"{name} must be a list of token ids (one request per call)")
    if not value:
        raise BadRequest(f"{name} is empty")
    kinds = set(map(type, value))  # one pass in C: a prompt is hundreds of ids, and every call sends one
    if kinds != {int}:
        if list in kinds:
            raise BadRequest(f"batched {name} are not supported: send one request per call")
        raise BadRequest(f"{name} must hold ints only")
    return value


def _decode_tensors(payload: str) -> dict[str, Any]:
    from safetensors.torch import load as load_safetensors

    return load_safetensors(base64.b64decode(payload, validate=True))


def sampling_params_from_json(raw: Any) -> tuple[SamplingParams, dict[str, bool]]:
    """SamplingParams from SGLang's sampling_params object, plus the text-only options (skip_special_tokens,
    no_stop_trim). BadRequest for unknown fields or bad values."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be an object")
    unknown = sorted(set(raw) - SAMPLING_FIELDS)
    if unknown:
        raise BadRequest(f"unknown sampling_params {unknown}; supported: {sorted(SAMPLING_FIELDS)}")
    if "seed" in raw and "sampling_seed" in raw:
        raise BadRequest("give seed or sampling_seed, not both")
    fields: dict[str, Any] = {}
    for name in ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos"):
        if raw.get(name) is not None:
            fields[name] = raw[name]
    seed = raw.get("seed", raw.get("sampling_seed"))
    if seed is not None:
        fields["seed"] = seed
    if isinstance(fields.get("stop"), list) and not fields["stop"]:
        del fields["stop"]
    text_options = {}
    for name, default in (("skip_special_tokens", True), ("no_stop_trim", False)):
        text_options[name] = _bool(raw, name, default)
    try:
        return SamplingParams(**fields), text_options
    except (ValueError, TypeError) as error:
        raise BadRequest(f"bad sampling_params: {error}") from None


class EngineServer:
    """The route handlers, bound to one AsyncEngine and an optional TransferAgent."""

    def __init__(
        self,
        engine: AsyncEngine,
        transfer_agent: Any | None = None,
        model_path: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.agent = transfer_agent
        self.model_path = model_path or engine.engine.model_dir
        self.clock = clock
        self.tokenizer = engine.engine.tokenizer
        self._registered: Any = None  # the pool tensor and staging buffer registered with the agent
        self._released: frozenset[str] = frozenset()
        """Memory tags released through this server (the engine's own record lives in its worker thread)."""
        self._weight_groups: dict[str, Any] = {}
        """group_name -> the torch ProcessGroup joined by /init_weights_update_group."""

    # ---- transfer-agent registration ----------------------------------------------------------------------

    async def register_pool(self) -> None:
        if self.agent is None or self._registered is not None:
            return
        agent = self.agent

        def register(engine: EmbeddedEngine) -> Any:
            if engine.pool is None:
                return None
            tensors = [engine.pool.tensor] + ([engine.staging.tensor] if engine.staging is not None else [])
            for tensor in tensors:
                agent.register_tensor(tensor)
            return tensors

        self._registered = await self.engine.call(register)

    async def unregister_pool(self) -> None:
        if self.agent is None or self._registered is None:
            return
        tensors, self._registered = self._registered, None
        for tensor in tensors:
            self.agent.unregister_tensor(tensor)

    # ---- helpers ------------------------------------------------------------------------------------------

    def _current_version(self) -> int:
        return self.engine.engine.weight_version  # an int read across threads: a snapshot is all we need

    def _text(self, output_ids: list[int], matched: Any, options: dict[str, bool]) -> str:
        if self.tokenizer is None or not output_ids:
            return ""
        text = self.tokenizer.decode(list(output_ids), skip_special_tokens=options["skip_special_tokens"])
        if isinstance(matched, str) and not options["no_stop_trim"]:
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        return text

    @staticmethod
    def _finish_reason(output: GenerateOutput) -> dict[str, Any]:
        if output.finish_reason == "stop":
            return {"type": "stop", "matched": output.matched_stop}
        if output.finish_reason == "length":
            return {"type": "length", "length": len(output.output_ids)}
        return {"type": "abort", "message": "request aborted"}

    # ---- /generate ----------------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        started = self.clock()
        body = await _body(request, GENERATE_FIELDS, required=("input_ids",))
        if self._released:
            raise BadRequest(f"the engine's memory is released ({sorted(self._released)}): its cell is not serving; "
                             "send the call to another engine", "engine_released", 503)
        input_ids = _token_ids(body["input_ids"])
        params, options = sampling_params_from_json(body.get("sampling_params"))
        rid = body.get("rid")
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise BadRequest("rid must be a non-empty string (one request per call)")
        return_logprob = _bool(body, "return_logprob", False)
        stream = _bool(body, "stream", False)
        start_len = body.get("logprob_start_len")
        if start_len is not None and (type(start_len) is not int or start_len < -1 or start_len >= len(input_ids)):
            raise BadRequest("logprob_start_len must be -1 or an index into input_ids")
        input_logprobs = None
        if return_logprob and start_len is not None and start_len >= 0:
            prompt = await self.engine.prompt_logprobs(input_ids)
            pairs = [[None, input_ids[0], None]] + [[lp, t, None] for lp, t in zip(prompt, input_ids[1:])]
            input_logprobs = pairs[start_len:]
        if stream:
            return await self._generate_stream(request, rid, input_ids, params, options, return_logprob, started,
                                               input_logprobs)
        output = await self.engine.generate(rid, input_ids, params, return_logprob)
        return web.json_response(self._response(output, options, return_logprob, started, input_logprobs))

    def _response(
        self,
        output: GenerateOutput,
        options: dict[str, bool],
        return_logprob: bool,
        started: float,
        input_logprobs: list | None,
    ) -> dict[str, Any]:
        ids = list(output.output_ids)
        meta: dict[str, Any] = {
            "id": output.rid,
            "finish_reason": self._finish_reason(output),
            "prompt_tokens": output.prompt_tokens,
            "completion_tokens": len(ids),
            "cached_tokens": output.cached_tokens,
            "weight_version": output.output_versions[-1] if output.output_versions else self._current_version(),
            "output_token_versions": list(output.output_versions),
            "e2e_latency": self.clock() - started,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(output.output_logprobs, ids)]
            if input_logprobs is not None:
                meta["input_token_logprobs"] = input_logprobs
        return {"text": self._text(ids, output.matched_stop, options), "output_ids": ids, "meta_info": meta}

    async def _generate_stream(
        self,
        request: web.Request,
        rid: str | None,
        input_ids: list[int],
        params: SamplingParams,
        options: dict[str, bool],
        return_logprob: bool,
        started: float,
        input_logprobs: list | None,
    ) -> web.StreamResponse:
        events = self.engine.stream(rid, input_ids, params, return_logprob)
        # The first event (or an error) comes before the 200 header, so a refused request still gets a 4xx.
        try:
            first = await events.__anext__()
        except StopAsyncIteration:  # pragma: no cover - stream always ends with a finished event
            raise BadRequest("request produced no output", "internal_error", 500) from None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        event = first
        try:
            while True:
                ids.extend(event.token_ids)
                logprobs.extend(event.logprobs)
                versions.extend(event.versions)
                if event.finished is not None:
                    chunk = self._response(event.finished, options, return_logprob, started, input_logprobs)
                else:
                    meta: dict[str, Any] = {
                        "id": event.rid,
                        "finish_reason": None,
                        "prompt_tokens": len(input_ids),
                        "completion_tokens": len(ids),
                        "weight_version": versions[-1] if versions else self._current_version(),
                        "output_token_versions": list(versions),
                        "e2e_latency": self.clock() - started,
                    }
                    if return_logprob:
                        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, ids)]
                    chunk = {"text": self._text(ids, None, options), "output_ids": list(ids), "meta_info": meta}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if event.finished is not None:
                    break
                event = await events.__anext__()
        except (EngineFailed, EngineClosed, RequestError) as error:
            payload = {"error": {"message": str(error), "type": type(error).__name__}}
            await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        finally:
            await events.aclose()  # aborts the request if the client went away
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # ---- control ------------------------------------------------------------------------------------------

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request, frozenset({"rid", "abort_all"}))
        if _bool(body, "abort_all", False):
            count = await self.engine.abort_all()
            return web.json_response({"success": True, "aborted": count})
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise BadRequest("give rid (a non-empty string) or abort_all: true")
        found = await self.engine.abort(rid)
        return web.json_response({"success": True, "aborted": int(found)})

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _body(request, frozenset({"mode"}))
        mode = body.get("mode") or "abort"
        affected = await self.engine.pause(mode)
        return web.json_response({"message": f"generation paused ({mode})", "status": "ok", "requests": affected})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await _body(request, frozenset())
        await self.engine.continue_generation()
        return web.json_response({"message": "generation continued", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            await _body(request, frozenset())
        if not await self.engine.flush_cache():
            raise BadRequest("cache not flushed: requests are in flight (pause generation first)", "engine_busy")
        return web.json_response({"success": True, "message": "cache flushed"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _body(
            request,
            frozenset({"model_path", "load_format", "weight_version", "abort_all_requests", "flush_cache"}),
            required=("model_path",),
        )
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format {body['load_format']!r} is not supported (auto or safetensors)")
        model_path = body["model_path"]
        if not isinstance(model_path, str) or not model_path:
            raise BadRequest("model_path must be a non-empty string")
        current = self.engine.engine.weight_version
        version = _version(body.get("weight_version"), current + 1)
        if _bool(body, "abort_all_requests", False):
            await self.engine.abort_all()
        await self.engine.load_weights_from_disk(model_path, version)
        self.model_path = model_path
        return web.json_response(
            {"success": True, "message": f"loaded {model_path}", "weight_version": version, "num_paused_requests": 0}
        )

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await _body(
            request,
            frozenset({"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                       "weight_version"}),
            required=("serialized_named_tensors",),
        )
        if body.get("load_format") not in (None, "safetensors_base64"):
            raise BadRequest("load_format must be null or 'safetensors_base64' (see the server's docstring)")
        payload = body["serialized_named_tensors"]
        if isinstance(payload, list):
            if len(payload) != 1:
                raise BadRequest("serialized_named_tensors: one entry expected (this engine has one rank)")
            payload = payload[0]
        if not isinstance(payload, str):
            raise BadRequest("serialized_named_tensors must be base64 text of a safetensors file")
        try:
            # Decoding a large checkpoint takes a while: keep the event loop free meanwhile.
            state = await asyncio.get_running_loop().run_in_executor(None, _decode_tensors, payload)
        except (binascii.Error, ValueError) as error:
            raise BadRequest(f"serialized_named_tensors is not base64 safetensors: {error}") from None
        except Exception as error:  # safetensors raises its own error types for corrupt headers
            raise BadRequest(f"serialized_named_tensors is not a safetensors file: {error}") from None
        if not state:
            raise BadRequest("serialized_named_tensors holds no tensors")
        version = _version(body.get("weight_version"), self.engine.engine.weight_version + 1)
        if _bool(body, "abort_all_requests", False):
            await self.engine.abort_all()
        await self.engine.load_weights(state, version)
        return web.json_response(
            {"success": True, "message": f"loaded {len(state)} tensors", "weight_version": version}
        )

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _body(
            request,
            frozenset({"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}),
            required=("master_address", "master_port", "rank_offset", "world_size", "group_name"),
        )
        address, name = body["master_address"], body["group_name"]
        port, rank, world = body["master_port"], body["rank_offset"], body["world_size"]
        backend = body.get("backend") or "gloo"
        if not isinstance(address, str) or not address or not isinstance(name, str) or not name:
            raise BadRequest("master_address and group_name must be non-empty strings")
        if not all(type(v) is int for v in (port, rank, world)) or not (0 < port < 65536 and 0 < rank < world):
            raise BadRequest("master_port must be a port, and 0 < rank_offset < world_size (rank 0 is the sender)")
        if backend not in ("gloo", "nccl"):
            raise BadRequest(f"backend must be gloo or nccl, got {backend!r}")
        if backend == "nccl":
            raise BadRequest("this engine runs on CPU: use backend gloo (nccl needs CUDA tensors)")
        if name in self._weight_groups:
            raise BadRequest(f"weight-update group {name!r} exists; destroy it first")
        if len(self._weight_groups) >= MAX_WEIGHT_GROUPS:
            raise BadRequest(f"{MAX_WEIGHT_GROUPS} weight-update groups exist; destroy one first")
        loop = asyncio.get_running_loop()
        try:
            group = await loop.run_in_executor(None, weight_broadcast.join_group, address, port, rank, world, name,
                                               backend, WEIGHT_GROUP_TIMEOUT_S)
        except weight_broadcast.WeightGroupError as error:
            raise BadRequest(str(error)) from None
        self._weight_groups[name] = group
        log.info("weight_group_joined", group_name=name, rank=rank, world_size=world, backend=backend)
        return web.json_response({"success": True, "message": f"joined {name} as rank {rank} of {world}"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await _body(
            request,
            frozenset({"names", "dtypes", "shapes", "group_name", "flush_cache", "weight_version", "load_format",
                       "abort_all_requests"}),
            required=("names", "dtypes", "shapes", "group_name"),
        )
        group = self._weight_groups.get(body["group_name"])
        if group is None:
            raise BadRequest(f"no weight-update group {body['group_name']!r}: call /init_weights_update_group")
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) or not names:
            raise BadRequest("names, dtypes and shapes must be non-empty lists")
        if not all(isinstance(n, str) for n in names) or not all(isinstance(d, str) for d in dtypes):
            raise BadRequest("names and dtypes must be strings")
        if not all(isinstance(sh, list) and all(type(d) is int and d >= 0 for d in sh) for sh in shapes):
            raise BadRequest("each shape must be a list of non-negative ints")
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest("names, dtypes and shapes must have the same length")
        try:
            for dtype in dtypes:
                weight_broadcast.parse_dtype(dtype)
        except weight_broadcast.WeightGroupError as error:
            raise BadRequest(str(error)) from None
        loop = asyncio.get_running_loop()
        try:
            state = await loop.run_in_executor(None, weight_broadcast.receive, group, names, dtypes, shapes)
        except weight_broadcast.WeightGroupError as error:
            # The group is broken (the sender went away mid-bucket): drop it, the sender forms a new one.
            weight_broadcast.leave_group(self._weight_groups.pop(body["group_name"]))
            raise BadRequest(str(error)) from None
        version = _version(body.get("weight_version"), self.engine.engine.weight_version + 1)
        if _bool(body, "abort_all_requests", False):
            await self.engine.abort_all()
        await self.engine.load_weights(state, version)
        return web.json_response({"success": True, "message": f"loaded {len(state)} tensors",
                                  "weight_version": version})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _body(request, frozenset({"group_name"}), required=("group_name",))
        group = self._weight_groups.pop(body["group_name"], None)
        if group is None:
            raise BadRequest(f"no weight-update group {body['group_name']!r}")
        weight_broadcast.leave_group(group)
        return web.json_response({"success": True, "message": f"destroyed {body['group_name']}"})

    def close_weight_groups(self) -> None:
        for group in self._weight_groups.values():
            weight_broadcast.leave_group(group)
        self._weight_groups.clear()

    @staticmethod
    def _memory_tags(body: dict) -> list[str] | None:
        tags = body.get("tags")
        if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
            raise BadRequest("tags must be null or a list of strings")
        return tags

    async def release_memory(self, request: web.Request) -> web.Response:
        body = await _body(request, frozenset({"tags"}))
        tags = self._memory_tags(body)
        await self.engine.release_memory(tags)
        self._released |= frozenset({"weights", "kv_cache"} if tags is None else set(tags) - {"cuda_graph"})
        if tags is None or "kv_cache" in tags:
            # The agent's registration keeps the old pool tensor alive until now: peers never read freed memory.
            await self.unregister_pool()
        return web.json_response({"success": True, "message": "memory released"})

    async def resume_memory(self, request: web.Request) -> web.Response:
        body = await _body(request, frozenset({"tags"}))
        tags = self._memory_tags(body)
        await self.engine.resume_memory(tags)
        self._released = frozenset() if tags is None else self._released - set(tags)
        await self.register_pool()
        return web.json_response({"success": True, "message": "memory resumed"})

    async def model_info(self, request: web.Request) -> web.Response:
        engine = self.engine.engine
        spec = engine.spec
        return web.json_response(
            {
                "model_path": self.model_path,
                "weight_version": engine.weight_version,
                "is_generation": True,
                "engine": "gyre-embedded",
                "vocab_size": spec.vocab_size,
                "num_layers": spec.num_layers,
                "hidden_size": spec.hidden_size,
                "num_heads": spec.num_heads,
                "num_kv_heads": spec.num_kv_heads,
                "head_dim": spec.head_dim,
                "ffn_size": spec.intermediate_size,
                "max_context_tokens": engine.config.max_context_tokens,
                "block_size_tokens": engine.config.block_size_tokens,
                "kv_transfer": self.agent is not None,
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.failure is not None:
            return _error(503, f"engine broken: {self.engine.failure}", "engine_failed")
        return web.json_response({"status": "ok"})

    async def get_load(self, request: web.Request) -> web.Response:
        stats = await self.engine.stats()
        return web.json_response(attrs.asdict(stats))

    async def live_sequences(self, request: web.Request) -> web.Response:
        sequences = await self.engine.call(lambda engine: engine.live_sequences())
        return web.json_response({"sequences": [list(sequences[rid]) for rid in sorted(sequences)]})

    # ---- KV export / import -------------------------------------------------------------------------------

    async def kv_export(self, request: web.Request) -> web.Response:
        body = await _body(request, frozenset({"input_ids"}), required=("input_ids",))
        input_ids = _token_ids(body["input_ids"])

        def export(engine: EmbeddedEngine) -> tuple[Any, KVLayout]:
            return engine.export_prefix(input_ids), engine.kv_layout()

        exported, layout = await self.engine.call(export)
        return web.json_response(
            {
                "handle": exported.handle,
                "num_tokens": exported.num_tokens,
                "block_ids": list(exported.block_ids),
                "staging_addr": exported.staging_addr,
                "staging_nbytes": exported.staging_nbytes,
                "transfer_peer": self.agent.peer if self.agent is not None else None,
                "layout": attrs.asdict(layout),
            }
        )

    async def kv_release(self, request: web.Request) -> web.Response:
        body = await _body(request, frozenset({"handle"}), required=("handle",))
        if not isinstance(body["handle"], str):
            raise BadRequest("handle must be a string")
        await self.engine.release_export(body["handle"])
        return web.json_response({"success": True})

    async def kv_import(self, request: web.Request) -> web.Response:
        body = await _body(request, frozenset({"input_ids", "export"}), required=("input_ids", "export"))
        if self.agent is None:
            raise BadRequest("this server runs without --kv-transfer: it cannot import KV", "capability_missing")
        input_ids = _token_ids(body["input_ids"])
        export = body["export"]
        if not isinstance(export, dict):
            raise BadRequest("export must be the object /gyre/kv/export answered")
        try:
            peer = export["transfer_peer"]
            num_tokens = export["num_tokens"]
            block_ids = export["block_ids"]
            remote = KVLayout(**export["layout"])
            # Absent in descriptors from servers without staging: they are read block by block.
            staging_addr = export.get("staging_addr", 0)
            staging_nbytes = export.get("staging_nbytes", 0)
        except (KeyError, TypeError) as error:
            raise BadRequest(f"export is missing or mangles a field: {error}") from None
        if not isinstance(peer, str) or not peer:
            raise BadRequest("the exporting server has no transfer agent (transfer_peer is null)")
        if type(num_tokens) is not int or num_tokens < 0 or num_tokens > len(input_ids):
            raise BadRequest("export.num_tokens must be an int in [0, len(input_ids)]")
        if not isinstance(block_ids, list) or not all(type(b) is int for b in block_ids):
            raise BadRequest("export.block_ids must be a list of ints")
        for name, value in (("staging_addr", staging_addr), ("staging_nbytes", staging_nbytes)):
            if type(value) is not int or value < 0:
                raise BadRequest(f"export.{name} must be an int >= 0")
        exported = ExportedPrefix(
            str(export.get("handle", "")), num_tokens, tuple(block_ids), staging_addr, staging_nbytes
        )
        tokens = input_ids[:num_tokens]
        agent = self.agent

        def read(local_addrs: list[int], remote_addrs: list[int], sizes: list[int]) -> int:
            return agent.read(peer, local_addrs, remote_addrs, sizes)

        started = self.clock()
        try:
            imported, moved = await self.engine.call(
                lambda engine: engine.import_exported(tokens, exported, remote, read)
            )
        except ValueError as error:  # block ids outside the remote layout, ...
            if isinstance(error, RequestError):  # the engine's own refusals keep their status
                raise
            raise BadRequest(f"bad export: {error}") from None
        return web.json_response(
            {"imported_tokens": imported, "bytes": moved, "seconds": self.clock() - started}
        )


def _wrap(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Callable:
    """Map every failure of a handler to a JSON error response: the server never crashes on a request."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as error:
            return _error(error.status, error.message, error.type)
        except EngineOverloaded as error:
            return _error(503, str(error), "engine_overloaded")
        except RequestError as error:
            return _error(400, str(error), "invalid_request_error")
        except (EngineFailed, EngineClosed) as error:
            return _error(500, str(error), "engine_failed")
        except TransferError as error:
            log.warning("kv_transfer_failed", error=str(error))
            return _error(502, str(error), "transfer_failed")
        except web.HTTPException:
            raise
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as error:
            log.exception("request_handler_failed", path=request.path)
            return _error(500, f"{type(error).__name__}: {error}", "internal_error")

    return wrapped


ROUTES: tuple[tuple[str, str, str], ...] = (
    ("POST", "/generate", "generate"),
    ("POST", "/abort_request", "abort_request"),
    ("POST", "/pause_generation", "pause_generation"),
    ("POST", "/continue_generation", "continue_generation"),
    ("POST", "/flush_cache", "flush_cache"),
    ("POST", "/update_weights_from_disk", "update_weights_from_disk"),
    ("POST", "/update_weights_from_tensor", "update_weights_from_tensor"),
    ("POST", "/init_weights_update_group", "init_weights_update_group"),
    ("POST", "/update_weights_from_distributed", "update_weights_from_distributed"),
    ("POST", "/destroy_weights_update_group", "destroy_weights_update_group"),
    ("POST", "/release_memory_occupation", "release_memory"),
    ("POST", "/resume_memory_occupation", "resume_memory"),
    ("POST", "/gyre/kv/export", "kv_export"),
    ("POST", "/gyre/kv/import", "kv_import"),
    ("POST", "/gyre/kv/release", "kv_release"),
    ("GET", "/model_info", "model_info"),
    ("GET", "/get_model_info", "model_info"),
    ("GET", "/health", "health"),
    ("GET", "/get_load", "get_load"),
    ("GET", "/gyre/live_sequences", "live_sequences"),
    ("GET", "/flush_cache", "flush_cache"),
)
"""Every route as (method, path, EngineServer method): the one table the app is built from, so the access rules
below cover each route and a test can walk them all."""


def server_api_key(key: str) -> str:
    """`key` if a server may check it: header-safe and at least MIN_API_KEY_CHARS long; EngineKeyError otherwise."""
    check_api_key(key)
    if len(key) < MIN_API_KEY_CHARS:
        raise EngineKeyError(f"an engine server's API key needs at least {MIN_API_KEY_CHARS} characters")
    return key


def _unauthorized(message: str) -> web.Response:
    response = _error(401, message, "authentication_error")
    response.headers[hdrs.WWW_AUTHENTICATE] = "Bearer"
    return response


def _access_guard(api_key: str, allowed_origins: frozenset[str]) -> Callable:
    """The middleware that keeps browsers and key-less callers out (see the module docstring)."""
    expected = f"Bearer {api_key}".encode("ascii")

    @web.middleware
    async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        origin = request.headers.get(hdrs.ORIGIN)
        if origin is not None and origin not in allowed_origins:
            return _error(403, f"requests from web pages are refused (Origin {origin!r} is not allowed)",
                          "forbidden_origin")
        if request.path not in OPEN_PATHS:
            given = request.headers.get(hdrs.AUTHORIZATION)
            if given is None:
                return _unauthorized("no API key: send the header Authorization: Bearer <key>")
            # surrogatepass: any header text encodes (and never to the key's bytes unless it is the key).
            if not hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected):
                return _unauthorized("wrong API key")
        # Only a body is checked: an empty POST has nothing to smuggle, and aiohttp's client labels one
        # application/octet-stream on its own.
        if request.method == hdrs.METH_POST and request.body_exists:
            if request.content_type != "application/json":
                return _error(415, f"send the body as application/json, not {request.content_type}",
                              "unsupported_media_type")
        return await handler(request)

    return guard


def build_engine_app(
    async_engine: AsyncEngine,
    transfer_agent: Any | None = None,
    *,
    model_path: str | None = None,
    clock: Callable[[], float] = time.monotonic,
    max_body_bytes: int = MAX_BODY_BYTES,
    api_key: str | None = None,
    allowed_origins: Collection[str] = (),
) -> web.Application:
    """The aiohttp application. With a `transfer_agent` (gyre.engines.transfer.TransferAgent) the KV pool is
    registered with it at startup, so peers can read exported blocks.

    Every route but /health checks `api_key`; None means the run's engine token (`run_token("engine")`), the key
    the run's SGLangClients send by default. `allowed_origins` lists the browser origins let in (none by default).
    """
    key = server_api_key(api_key) if api_key is not None else run_token(API_KEY_PURPOSE)
    server = EngineServer(async_engine, transfer_agent, model_path, clock)
    app = web.Application(
        client_max_size=max_body_bytes, middlewares=[_access_guard(key, frozenset(allowed_origins))]
    )
    app[SERVER_KEY] = server
    for method, path, name in ROUTES:
        handler = _wrap(getattr(server, name))
        if method == hdrs.METH_GET:
            app.router.add_get(path, handler)  # and HEAD, as before
        else:
            app.router.add_route(method, path, handler)

    async def on_startup(app: web.Application) -> None:
        await server.register_pool()

    async def on_cleanup(app: web.Application) -> None:
        server.close_weight_groups()
        await server.unregister_pool()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def write_generated_key(parent_dir: str | None = None) -> tuple[str, Path]:
    """A fresh random key and the file now holding it: mode 0600, alone in a new 0700 directory under
    `parent_dir` (default: $XDG_RUNTIME_DIR, the user's private runtime directory, else the temp directory)."""
    if parent_dir is None:
        runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
        parent_dir = runtime_dir if runtime_dir and os.path.isdir(runtime_dir) else None
    key = secrets.token_hex(GENERATED_KEY_BYTES)
    folder = Path(tempfile.mkdtemp(prefix="gyre-engine-key-", dir=parent_dir))  # mkdtemp makes it 0700
    path = folder / "api_key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as file:
        file.write(key + "\n")
    return key, path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Gyre's embedded inference engine behind SGLang's HTTP API")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--kv-transfer", action="store_true", help="register the KV pool with Mooncake")
    defaults = EngineConfig()
    parser.add_argument("--block-size", type=int, default=defaults.block_size_tokens)
    parser.add_argument("--num-blocks", type=int, default=defaults.num_blocks)
    parser.add_argument("--max-running", type=int, default=defaults.max_running_requests)
    parser.add_argument("--max-waiting", type=int, default=defaults.max_waiting_requests)
    parser.add_argument("--max-context", type=int, default=defaults.max_context_tokens)
    parser.add_argument("--max-prefill", type=int, default=defaults.max_prefill_tokens)
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-exports", type=int, default=defaults.max_exports)
    parser.add_argument("--kv-staging-tokens", type=int, default=None)
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="stop when the process that started this one ends (a cell hosting this server)")
    parser.add_argument("--transfer-hostname", default=None,
                        help="address Mooncake peers reach this server at (default: --host)")
    parser.add_argument("--transfer-protocol", choices=("tcp", "rdma"), default="tcp",
                        help="Mooncake transport of the KV blocks with --kv-transfer (rdma: the node needs an "
                        "RDMA NIC; the server refuses to start without one, saying so)")
    parser.add_argument("--rdma-devices", default="",
                        help="with --transfer-protocol rdma: the devices to use, comma-separated (default: all)")
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument(
        "--api-key-file", metavar="PATH",
        help=f"file holding the key every route but /health checks (Authorization: Bearer <key>). Without it, "
        f"--api-key or ${API_KEY_ENV}, the server makes a key, writes it to a 0600 file and logs that file's path",
    )
    keys.add_argument(
        "--api-key", metavar="KEY",
        help=f"the key itself. Discouraged: any user of this machine can read a command line (ps); prefer "
        f"--api-key-file or ${API_KEY_ENV}",
    )
    parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="a browser origin let in (repeatable); requests from any other origin get 403")
    args = parser.parse_args(argv)
    if args.exit_with_parent:
        _exit_with_parent()
    generated_dir: Path | None = None
    try:
        if args.api_key_file is not None:
            api_key = server_api_key(read_api_key_file(args.api_key_file))
        elif args.api_key is not None:
            api_key = server_api_key(args.api_key)
        elif os.environ.get(API_KEY_ENV):
            api_key = server_api_key(os.environ[API_KEY_ENV])
        else:
            api_key, key_path = write_generated_key()
            generated_dir = key_path.parent
            log.info("engine_api_key_file_written", path=str(key_path))
    except EngineKeyError as error:
        parser.error(str(error))  # the message names where the key came from, never the key
    try:
        _serve(args, api_key)
    finally:
        if generated_dir is not None:
            # The key dies with the server: a stale key file would only be something to steal.
            shutil.rmtree(generated_dir, ignore_errors=True)
    return 0


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """Send this process SIGTERM once its parent is gone (it is re-parented): a cell killed without stopping its
    server must not leave it holding the port and the memory. A thread, since a pre-exec hook in the parent is not
    safe in a process with threads."""
    import signal
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.warning("engine_server_parent_gone", parent_pid=parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _serve(args: argparse.Namespace, api_key: str) -> None:
    config = EngineConfig(
        block_size_tokens=args.block_size,
        num_blocks=args.num_blocks,
        max_running_requests=args.max_running,
        max_waiting_requests=args.max_waiting,
        max_context_tokens=args.max_context,
        max_prefill_tokens=args.max_prefill,
        dtype=args.dtype,
        num_threads=args.num_threads,
        seed=args.seed,
        max_exports=args.max_exports,
        kv_staging_tokens=args.kv_staging_tokens,
    )
    agent = None  # first: a transport this node cannot give is refused before the model loads
    if args.kv_transfer:
        from gyre.engines.transfer import TransferAgent, TransferConfig

        try:
            agent = TransferAgent(TransferConfig(hostname=args.transfer_hostname or args.host,
                                                 protocol=args.transfer_protocol, device_name=args.rdma_devices))
        except (TransferError, ValueError) as error:  # no RDMA device here, a device filter with tcp, ...
            log.error("engine_server_transfer_refused", error=str(error))
            raise SystemExit(f"engine_server: {error}") from None
    engine = AsyncEngine(EmbeddedEngine(args.model_dir, config))
    app = build_engine_app(engine, agent, model_path=args.model_dir, api_key=api_key,
                           allowed_origins=args.allow_origin)

    async def close_engine(app: web.Application) -> None:
        await engine.close()

    app.on_cleanup.append(close_engine)
    log.info("engine_server_starting", host=args.host, port=args.port, kv_transfer=args.kv_transfer)
    try:
        web.run_app(app, host=args.host, port=args.port, print=None)
    finally:
        if agent is not None:
            agent.close()

if __name__ == "__main__":
    raise SystemExit(main())
