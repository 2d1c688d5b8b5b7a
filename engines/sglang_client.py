"""An async HTTP client for SGLang's server API, and for Gyre's embedded engine server which speaks the same subset.

One class drives both: a cell does not care which engine it hosts. The embedded server adds /gyre/kv/* (export and
import of one prefix's KV blocks through Mooncake); a real SGLang server answers those with 404, which this client
turns into `CapabilityMissing` so the caller falls back to re-prefill (or to HiCache on SGLang).

Errors are typed: a 4xx carries the server's own message (`RequestRejected`), a 5xx is `ServerError`, no
connection is `EngineUnreachable`, a deadline is `EngineTimeout`. The embedded server's error `type` refines
them: "capability_missing" (a server started without --kv-transfer) is `CapabilityMissing` too, and
"transfer_failed" (Mooncake could not move the blocks) is `KVTransferFailed`. Bodies with `"success": false`
(SGLang's way of refusing a weight update with status 200 on some versions) are also `RequestRejected`.

Authentication: every request carries `Authorization: Bearer <key>`, the header SGLang's servers check when started
with --api-key and the one Gyre's engine server checks on every route but /health. The key is, in order: the
client's `api_key`, the file `ClientConfig.api_key_file` names, or `run_token("engine")`, which every process of a
run derives alike, so in-run clients (the proxy's, the KV migrator's) and in-run servers (the cells') agree with no
wiring. A refused key is `EngineUnauthorized` (a `RequestRejected`, 401).

SGLang's versions differ (see shared/reference/sglang.md): servers up to 0.5.5 take no body on /pause_generation
(and have no "in_place" mode) and some serve /get_model_info rather than /model_info. `ClientConfig.pause_body`
False speaks to the former (an "in_place" pause is then `CapabilityMissing`, so a caller falls back to abort and
re-prefill); `model_info` tries /model_info and falls back to /get_model_info on a 404.

Log-probs: both engines report a sampled token's log-prob at the request's temperature (SGLang's default; see
engines/temperature.py), which the trainer reproduces. Do not start SGLang with SGLANG_RETURN_ORIGINAL_LOGPROB: its
log-probs would then be taken at temperature 1 and no longer match the trainer's at other temperatures.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import aiohttp
import attrs
import structlog

from gyre.engines.errors import (
    CapabilityMissing,
    EngineKeyError,
    EngineTimeout,
    EngineUnauthorized,
    EngineUnreachable,
    KVTransferFailed,
    RequestRejected,
    ServerError,
    SGLangError,
)
from gyre.runtime.run_secrets import run_token

__all__ = [
    "API_KEY_PURPOSE",
    "CapabilityMissing",
    "ClientConfig",
    "EngineKeyError",
    "EngineTimeout",
    "EngineUnauthorized",
    "EngineUnreachable",
    "KVTransferFailed",
    "RequestRejected",
    "SGLangClient",
    "SGLangError",
    "ServerError",
    "auth_headers",
    "check_api_key",
    "finish_reason_type",
    "read_api_key_file",
]

log = structlog.get_logger(__name__)

API_KEY_PURPOSE = "engine"
"""The run token's purpose for engine servers: `run_token(API_KEY_PURPOSE)` is every in-run server's key."""
MAX_KEY_FILE_BYTES = 4096  # a key is a line of text; a bigger file is the wrong file, not a key


@attrs.frozen
class ClientConfig:
    """Deadlines and connection bounds of one `SGLangClient`."""

    generate_timeout_s: float = 3600.0
    """Whole-request deadline for /generate: long agent turns on a busy engine can take many minutes."""
    control_timeout_s: float = 300.0
    """Deadline for control calls (pause, flush, weight updates, KV export/import)."""
    connect_timeout_s: float = 10.0
    """Deadline for opening a connection."""
    max_connections: int = 256
    """Connections this client keeps to its server at most; more concurrent calls queue in aiohttp."""
    api_key_file: str | None = None
    """A file holding the servers' key (a standalone engine server's key file, or the --api-key a real SGLang
    server was started with); None: the run's engine token, which every in-run engine server checks. The config
    names a file, never the key, because configs are recorded in event logs."""
    pause_body: bool = True
    """Send /pause_generation a {"mode"} body (SGLang >= 0.5.6 and Gyre's server). False for SGLang <= 0.5.5, whose
    route takes no body and only aborts."""


def check_api_key(key: str) -> str:
    """`key` if it can ride in an `Authorization: Bearer` header (printable ASCII, no spaces); EngineKeyError else.

    The error never quotes the key: it may be a real one with a typo."""
    if not isinstance(key, str) or not key:
        raise EngineKeyError("an engine API key must be a non-empty string")
    if not all("!" <= ch <= "~" for ch in key):
        raise EngineKeyError(
            f"an engine API key must be printable ASCII without spaces ({len(key)} characters given)"
        )
    return key


def read_api_key_file(path: str | os.PathLike[str]) -> str:
    """The key in the file at `path` (surrounding whitespace, e.g. a final newline, stripped); EngineKeyError if it
    is missing, unreadable, too big or holds no valid key. Warns when others than its owner may read it."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            raw = file.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as error:
        raise EngineKeyError(f"cannot read the engine API key file {path}: {error.strerror or error}") from None
    if len(raw) > MAX_KEY_FILE_BYTES:
        raise EngineKeyError(f"{path} is over {MAX_KEY_FILE_BYTES} bytes: not an API key file")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("engine_api_key_file_open_to_others", path=str(path), mode=oct(stat.S_IMODE(mode)))
    try:
        key = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise EngineKeyError(f"{path} holds non-ASCII bytes: not an API key file") from None
    if not key:
        raise EngineKeyError(f"the engine API key file {path} is empty")
    try:
        return check_api_key(key)
    except EngineKeyError as error:
        raise EngineKeyError(f"{path}: {error}") from None


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """The header that authenticates to an engine server, exactly as SGLang's servers check it
    (`Authorization: Bearer <key>`): with `api_key`, or the run's engine token when None."""
    key = check_api_key(api_key) if api_key is not None else run_token(API_KEY_PURPOSE)
    return {"Authorization": f"Bearer {key}"}


def finish_reason_type(meta_info: dict[str, Any]) -> str:
    """"stop" | "length" | "abort" from SGLang's meta_info.finish_reason ({"type": ...}), or "" if absent."""
    reason = meta_info.get("finish_reason")
    if isinstance(reason, dict):
        return str(reason.get("type", ""))
    return "" if reason is None else str(reason)


class SGLangClient:
    """Async client of one engine server at `base_url` (e.g. "http://127.0.0.1:30000").

    Pass an aiohttp `session` to share connections across clients; otherwise the client opens its own on first
    use and closes it in `close()`. The key it sends is `api_key` if given, else the one in `config.api_key_file`,
    else the run's engine token (see the module docstring).
    """

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession | None = None,
        config: ClientConfig = ClientConfig(),
        api_key: str | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.config = config
        self._session = session
        self._owns_session = session is None
        if api_key is None and config.api_key_file is not None:
            api_key = read_api_key_file(config.api_key_file)
        # Sent per request, not set on the session: a shared session may talk to servers with other keys.
        self._headers = auth_headers(api_key)

    # ---- generation ---------------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
        return_logprob: bool = True,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """POST /generate with token ids; returns SGLang's response dict (output_ids, meta_info, text)."""
        body = self._generate_body(input_ids, sampling_params, rid, return_logprob, stream=False)
        return await self._post("/generate", body, timeout_s or self.config.generate_timeout_s)

    async def generate_stream(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
        return_logprob: bool = True,
        timeout_s: float | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """POST /generate with stream=true; yields each server-sent chunk (SGLang's `data: {...}` events)."""
        body = self._generate_body(input_ids, sampling_params, rid, return_logprob, stream=True)
        session = await self._get_session()
        timeout = self._timeout(timeout_s or self.config.generate_timeout_s)
        try:
            async with session.post(
                self.base_url + "/generate", json=body, timeout=timeout, headers=self._headers
            ) as resp:
                if resp.status >= 400:
                    await self._raise_for(resp, "/generate")
                async for raw in resp.content:
                    line = raw.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if isinstance(chunk, dict) and "error" in chunk:
                        # The engine failed mid-stream (Gyre's server names the error type) vs a refused request.
                        error = chunk["error"]
                        kind = error.get("type") if isinstance(error, dict) else None
                        failed = kind in ("EngineFailed", "EngineClosed")
                        raise (ServerError if failed else RequestRejected)("/generate", resp.status, _error_text(chunk))
                    yield chunk
        except asyncio.TimeoutError as error:
            raise EngineTimeout("/generate", None, f"stream not finished within {timeout.total} s") from error
        except aiohttp.ClientConnectionError as error:
            raise EngineUnreachable("/generate", None, f"{type(error).__name__}: {error}") from error

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request, or every request when `rid` is None. Unknown ids are not an error (SGLang)."""
        body = {"rid": "", "abort_all": True} if rid is None else {"rid": rid}
        await self._post("/abort_request", body, self.config.control_timeout_s)

    async def pause(self, mode: str = "abort") -> dict[str, Any]:
        """Pause generation: "abort" ends running requests, "in_place" keeps them for continue_generation()."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        if not self.config.pause_body:
            if mode != "abort":
                raise CapabilityMissing("/pause_generation", None,
                                        f"{self.base_url} (SGLang <= 0.5.5) pauses by aborting only, not {mode!r}")
            return await self._request("POST", "/pause_generation", None, self.config.control_timeout_s)
        return await self._post("/pause_generation", {"mode": mode}, self.config.control_timeout_s)

    async def continue_generation(self) -> dict[str, Any]:
        return await self._post("/continue_generation", {}, self.config.control_timeout_s)

    async def flush_cache(self) -> bool:
        """Drop the prefix cache. False when the server refuses because requests are in flight (SGLang: 400)."""
        try:
            await self._post("/flush_cache", {}, self.config.control_timeout_s)
        except RequestRejected as error:
            log.info("flush_cache_refused", base_url=self.base_url, reason=error.message)
            return False
        return True

    # ---- weights and memory -------------------------------------------------------------------------------

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int | str | None = None, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._post("/update_weights_from_disk", body, self.config.control_timeout_s)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[Any],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: int | str | None = None,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """POST /update_weights_from_tensor; the payload format is the server's (SGLang: one entry per TP rank)."""
        body: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._post("/update_weights_from_tensor", body, self.config.control_timeout_s)

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> dict[str, Any]:
        body = dict(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        return await self._post("/init_weights_update_group", body, self.config.control_timeout_s)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        flush_cache: bool = True,
        weight_version: int | str | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = dict(
            names=list(names),
            dtypes=list(dtypes),
            shapes=[list(s) for s in shapes],
            group_name=group_name,
            flush_cache=flush_cache,
        )
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._post("/update_weights_from_distributed", body, self.config.control_timeout_s)

    async def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        return await self._post("/destroy_weights_update_group", {"group_name": group_name},
                                self.config.control_timeout_s)

    async def release_memory(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """Free weights and/or KV cache (tags from {"weights", "kv_cache", "cuda_graph"}; None = all)."""
        body = {"tags": None if tags is None else list(tags)}
        return await self._post("/release_memory_occupation", body, self.config.control_timeout_s)

    async def resume_memory(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        body = {"tags": None if tags is None else list(tags)}
        return await self._post("/resume_memory_occupation", body, self.config.control_timeout_s)

    # ---- status -------------------------------------------------------------------------------------------

    async def model_info(self) -> dict[str, Any]:
        """GET /model_info, or /get_model_info where the server has only that (older SGLang)."""
        try:
            return await self._get("/model_info")
        except CapabilityMissing:
            return await self._get("/get_model_info")

    async def server_info(self) -> dict[str, Any]:
        """GET /server_info (the server's arguments and version), or /get_server_info on older SGLang. Gyre's engine
        server has neither: CapabilityMissing."""
        try:
            return await self._get("/server_info")
        except CapabilityMissing:
            return await self._get("/get_server_info")

    async def get_load(self) -> dict[str, Any]:
        """GET /get_load: Gyre's server answers its EngineStats fields (running, waiting, free_blocks, ...); SGLang
        answers its own load record (a list of per-rank dicts on recent versions)."""
        return await self._get("/get_load")

    async def live_sequences(self) -> list[list[int]]:
        """Prompt + output so far of every generation in the engine (Gyre's server only; CapabilityMissing on
        SGLang, which has no such route)."""
        answer = await self._get("/gyre/live_sequences")
        sequences = answer.get("sequences") if isinstance(answer, dict) else None
        if not isinstance(sequences, list):
            raise ServerError("/gyre/live_sequences", None, f"unexpected answer {answer!r:.200}")
        return sequences

    async def health(self) -> bool:
        """True when the server answers /health with 200; False when it is down, starting or unhealthy."""
        try:
            await self._get("/health")
        except (EngineUnreachable, ServerError, EngineTimeout):
            return False
        return True

    async def wait_healthy(self, timeout_s: float, poll_interval_s: float = 0.2) -> None:
        """Poll /health until it answers 200; EngineTimeout after `timeout_s` of the event loop's clock."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.health():
            if loop.time() >= deadline:
                raise EngineTimeout("/health", None, f"{self.base_url} not healthy within {timeout_s} s")
            await asyncio.sleep(poll_interval_s)

    # ---- KV blocks (Gyre's embedded engine only) ----------------------------------------------------------

    async def export_kv(self, input_ids: Sequence[int]) -> dict[str, Any]:
        """Pin the KV of the longest cached prefix of `input_ids` for a peer to read; CapabilityMissing on SGLang."""
        return await self._post("/gyre/kv/export", {"input_ids": list(input_ids)}, self.config.control_timeout_s)

    async def import_kv(self, input_ids: Sequence[int], export: dict[str, Any]) -> dict[str, Any]:
        """Read the blocks described by `export` (another server's export_kv answer) into this server's cache.

        Returns {imported_tokens, bytes, seconds}. CapabilityMissing when either side cannot move KV blocks.
        """
        if isinstance(export, dict) and "transfer_peer" in export and not export["transfer_peer"]:
            raise CapabilityMissing("/gyre/kv/import", None, "the exporting server has no transfer agent")
        body = {"input_ids": list(input_ids), "export": export}
        return await self._post("/gyre/kv/import", body, self.config.control_timeout_s)

    async def release_kv(self, handle: str) -> dict[str, Any]:
        """Unpin an export once its reader is done (or gave up)."""
        return await self._post("/gyre/kv/release", {"handle": handle}, self.config.control_timeout_s)

    # ---- plumbing -----------------------------------------------------------------------------------------

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _generate_body(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        rid: str | None,
        return_logprob: bool,
        stream: bool,
    ) -> dict[str, Any]:
        if not input_ids:
            raise ValueError("input_ids must not be empty")
        body: dict[str, Any] = {
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": dict(sampling_params),
            "return_logprob": return_logprob,
            "stream": stream,
        }
        if return_logprob:
            body["logprob_start_len"] = -1  # log-probs of output tokens only
        if rid is not None:
            body["rid"] = rid
        return body

    def _timeout(self, total_s: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total_s, connect=self.config.connect_timeout_s)

    async def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.config.max_connections)
            )
        return self._session

    async def _post(self, endpoint: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        return await self._request("POST", endpoint, body, timeout_s)

    async def _get(self, endpoint: str) -> dict[str, Any]:
        return await self._request("GET", endpoint, None, self.config.control_timeout_s)

    async def _request(self, method: str, endpoint: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        session = await self._get_session()
        try:
            async with session.request(
                method, self.base_url + endpoint, json=body, timeout=self._timeout(timeout_s), headers=self._headers
            ) as resp:
                if resp.status >= 400:
                    await self._raise_for(resp, endpoint)
                text = await resp.text()
        except asyncio.TimeoutError as error:
            raise EngineTimeout(endpoint, None, f"no answer within {timeout_s} s from {self.base_url}") from error
        except aiohttp.ClientConnectionError as error:
            raise EngineUnreachable(endpoint, None, f"{self.base_url}: {type(error).__name__}: {error}") from error
        if not text:
            return {}
        try:
            result = json.loads(text)
        except json.JSONDecodeError:
            return {"text": text}  # e.g. SGLang's /health_generate answers plain text
        if isinstance(result, dict) and result.get("success") is False:
            raise RequestRejected(endpoint, resp.status, str(result.get("message", result)))
        return result

    async def _raise_for(self, resp: aiohttp.ClientResponse, endpoint: str) -> None:
        text = await resp.text()
        kind = ""
        try:
            payload = json.loads(text)
            message = _error_text(payload)
            if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
                kind = str(payload["error"].get("type", ""))
        except (json.JSONDecodeError, ValueError):
            message = text.strip() or resp.reason or ""
        if resp.status == 401:
            raise EngineUnauthorized(
                endpoint, 401, f"{message} ({self.base_url} refused this client's key: give the server's key as "
                f"api_key or ClientConfig.api_key_file, or run both in one run)"
            )
        if resp.status == 404:
            raise CapabilityMissing(endpoint, 404, f"{self.base_url} has no {endpoint} ({message})")
        if kind == "capability_missing":
            raise CapabilityMissing(endpoint, resp.status, message)
        if kind == "transfer_failed":
            raise KVTransferFailed(endpoint, resp.status, message)
        if resp.status < 500:
            raise RequestRejected(endpoint, resp.status, message)
        raise ServerError(endpoint, resp.status, message)


def _error_text(payload: Any) -> str:
    """The human message inside an error body: SGLang uses {"error": {"message"}}, {"message"} or {"detail"}."""
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("message", "detail"):
            if key in payload:
                return str(payload[key])
    return json.dumps(payload)
