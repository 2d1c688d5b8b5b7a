"""The backend protocol (what the proxy asks of a rollout engine, and what comes back) and its implementations.

The protocol: a `BackendRequest` goes in, a `BackendResult` comes out; `BackendRejected` says the request is wrong
(the proxy answers 400), `BackendUnavailable` that no engine can serve it now (503, which the SDKs retry). A
`GenerateBackend` has `generate`; a `StreamingBackend` also has `generate_streaming`, which hands output ids to an
`OnOutput` as the engine produces them and returns the result `generate` would return.

Implementations: `SGLangBackend` drives one or more `SGLangClient`s, one per cell; `EmbeddedBackend` drives an
in-process `AsyncEngine` (what `gyre serve` and the tests use); the bus-hosted proxy uses `RoutedBackend`
(routing.py), which reaches its cells' engines through `engine_generate` here. The proxy cannot tell them apart.

Over HTTP, `stream_generate` reads SGLang's streamed /generate (`data: {...}` chunks, then `data: [DONE]`); it
accepts chunks whose output_ids and log-probs are cumulative (SGLang's default and Gyre's engine server) or only the
new ones (SGLang's --incremental-streaming-output): `meta_info.completion_tokens` says how many ids exist, so the new
ones are that many minus those already seen, taken from the end of the chunk's lists.

`SGLangBackend`'s routing is deliberately minimal (sticky by session key, new sessions to the cell with the fewest
calls in flight, a bounded map): the bus-hosted proxy replaces it with the swappable routing policy.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import aclosing
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence

import attrs
import structlog

from gyre.actors.errors import ActorError
from gyre.engines.errors import EngineClosed, EngineFailed, EngineOverloaded, RequestError

__all__ = [
    "BackendRequest",
    "BackendResult",
    "BackendRejected",
    "BackendUnavailable",
    "GenerateBackend",
    "StreamingBackend",
    "OnOutput",
    "SGLangBackend",
    "EmbeddedBackend",
    "StreamProgress",
    "engine_generate",
    "sampling_params_from_dict",
    "result_from_sglang",
    "stream_generate",
]

log = structlog.get_logger(__name__)


# -- the protocol ------------------------------------------------------------------------------------------------


@attrs.frozen
class BackendRequest:
    """One generation the proxy asks of a rollout engine."""

    rid: str
    """Request id, unique per call ("<execution_id>/<call_index>"), for aborts."""
    execution_id: str
    """The execution whose call this is."""
    session_key: str
    """Sticky-routing key: calls with the same key share a prefix and should go to the same cell."""
    prompt_ids: tuple[int, ...]
    """The rendered prompt."""
    sampling_params: dict[str, Any]
    """SGLang's sampling_params form: max_new_tokens, temperature, top_p, top_k, stop, stop_token_ids,
    sampling_seed."""


@attrs.frozen
class BackendResult:
    """What one generation produced."""

    output_ids: tuple[int, ...]
    """The generated ids, in order."""
    output_logprobs: tuple[float, ...]
    """The behaviour log-prob of each output id."""
    output_versions: tuple[int, ...]
    """The weight version that produced each output id."""
    finish_reason: str
    """"stop", "length" or "abort"."""
    cached_tokens: int
    """Prompt tokens the engine found in its prefix cache."""
    cell: str
    """The cell whose engine generated (the last one, for a resumed generation)."""
    matched_stop: int | str | None = None
    """The stop token id or stop string that ended the output, when the engine says."""


class BackendRejected(ActorError, ValueError):
    """The engine refused the request as invalid (the proxy answers 400)."""


class BackendUnavailable(ActorError, RuntimeError):
    """No engine can take the request now (the proxy answers 503; the SDKs retry)."""


class GenerateBackend(Protocol):
    async def generate(self, request: BackendRequest) -> BackendResult: ...


OnOutput = Callable[[tuple[int, ...]], Awaitable[None]]
"""Receives output ids as they are generated: each id once, in order, across resubmissions of the call."""


class StreamingBackend(GenerateBackend, Protocol):
    async def generate_streaming(self, request: BackendRequest, on_output: OnOutput) -> BackendResult:
        """Like `generate` (the same result), calling `on_output` with new ids as they come. An exception raised by
        `on_output` aborts the generation and propagates."""
        ...


# -- engines over HTTP (SGLang's API) ----------------------------------------------------------------------------

# SGLang's sampling_params keys that the embedded engine understands, and its SamplingParams field for each.
_EMBEDDED_FIELDS = {
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "sampling_seed": "seed",
    "ignore_eos": "ignore_eos",
}


def _version(value: Any) -> int:
    """SGLang reports weight_version as a string; Gyre sets it to str(int). The initial "default" counts as 0."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def result_from_sglang(response: Mapping[str, Any], cell: str) -> BackendResult:
    """Translate SGLang's /generate answer (output_ids, meta_info) into a BackendResult.

    Per-token versions come from `meta_info.output_token_versions` when the server gives them (Gyre's engine
    server); SGLang gives one `weight_version` per request, which then stands for every token.
    """
    meta = response.get("meta_info") or {}
    output_ids = tuple(int(t) for t in response.get("output_ids") or ())
    logprobs = tuple(float(entry[0]) for entry in meta.get("output_token_logprobs") or ())
    if len(logprobs) != len(output_ids):
        raise BackendUnavailable(f"engine returned {len(output_ids)} ids but {len(logprobs)} log-probs")
    versions_raw = meta.get("output_token_versions")
    if versions_raw is not None:
        versions = tuple(_version(v) for v in versions_raw)
    else:
        versions = (_version(meta.get("weight_version")),) * len(output_ids)
    reason = meta.get("finish_reason")
    matched = None
    if isinstance(reason, Mapping):
        finish, matched = str(reason.get("type", "")), reason.get("matched")
    else:
        finish = "" if reason is None else str(reason)
    if finish not in ("stop", "length", "abort"):
        raise BackendUnavailable(f"engine returned an unknown finish_reason {reason!r}")
    return BackendResult(
        output_ids=output_ids,
        output_logprobs=logprobs,
        output_versions=versions,
        finish_reason=finish,
        cached_tokens=int(meta.get("cached_tokens") or 0),
        cell=cell,
        matched_stop=matched if isinstance(matched, (int, str)) else None,
    )


@attrs.define
class StreamProgress:
    """What one streamed generation has delivered so far; kept by the caller, so that output already passed on
    survives a stream that breaks off (it is then resumed from, like an aborted generation's partial output)."""

    output_ids: list[int] = attrs.field(factory=list)
    output_logprobs: list[float] = attrs.field(factory=list)
    output_versions: list[int] = attrs.field(factory=list)
    per_token_versions: bool = False
    """Whether the engine sent `output_token_versions` (else each chunk's weight_version stood for its tokens)."""

    def partial_result(self, cell: str) -> BackendResult:
        """The output so far as an aborted generation's result."""
        return BackendResult(
            output_ids=tuple(self.output_ids),
            output_logprobs=tuple(self.output_logprobs),
            output_versions=tuple(self.output_versions),
            finish_reason="abort",
            cached_tokens=0,
            cell=cell,
        )


def _tail(values: Sequence[Any], count: int, what: str) -> list[Any]:
    if len(values) < count:
        raise BackendUnavailable(f"engine streamed {count} new ids but only {len(values)} {what}")
    return list(values[len(values) - count :]) if count else []


async def stream_generate(
    client: Any,
    input_ids: Sequence[int],
    sampling_params: Mapping[str, Any],
    rid: str,
    on_output: OnOutput,
    progress: StreamProgress,
) -> dict[str, Any]:
    """Stream one /generate through an SGLangClient, passing new ids to `on_output` and recording them in
    `progress`; returns the response a non-streamed /generate would have given (all ids, log-probs, the final
    meta_info), for `result_from_sglang`. An exception from `on_output` closes the stream (the server aborts)."""
    final: dict[str, Any] | None = None
    stream = client.generate_stream(list(input_ids), dict(sampling_params), rid=rid, return_logprob=True)
    async with aclosing(stream) as chunks:
        async for chunk in chunks:
            meta = chunk.get("meta_info") or {}
            ids = chunk.get("output_ids") or []
            total = meta.get("completion_tokens")
            total = len(ids) if not isinstance(total, int) else total
            count = total - len(progress.output_ids)
            if count < 0 or count > len(ids):
                raise BackendUnavailable(
                    f"engine streamed {len(ids)} ids for {total} completion tokens after {len(progress.output_ids)}"
                )
            new_ids = [int(t) for t in _tail(ids, count, "ids")]
            logprobs = [float(entry[0]) for entry in _tail(meta.get("output_token_logprobs") or (), count, "log-probs")]
            versions_raw = meta.get("output_token_versions")
            if versions_raw is not None:
                progress.per_token_versions = True
                versions = [_version(v) for v in _tail(versions_raw, count, "versions")]
            else:
                versions = [_version(meta.get("weight_version"))] * count
            progress.output_ids.extend(new_ids)
            progress.output_logprobs.extend(logprobs)
            progress.output_versions.extend(versions)
            if new_ids:
                await on_output(tuple(new_ids))
            if meta.get("finish_reason") is not None:
                final = chunk  # read on to the end ([DONE]) so that the connection can be reused
    if final is None:
        raise BackendUnavailable("the engine's stream ended without a finished chunk")
    meta = dict(final.get("meta_info") or {})
    meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(progress.output_logprobs, progress.output_ids)]
    if progress.per_token_versions:
        meta["output_token_versions"] = list(progress.output_versions)
    else:
        meta.pop("output_token_versions", None)
    return {"text": final.get("text", ""), "output_ids": list(progress.output_ids), "meta_info": meta}


async def engine_generate(
    client: Any,
    cell: str,
    prompt_ids: Sequence[int],
    sampling_params: Mapping[str, Any],
    rid: str,
    on_output: OnOutput | None = None,
    progress: StreamProgress | None = None,
) -> BackendResult:
    """One generation on an SGLangClient, streamed to `on_output` (recording what was delivered in `progress`) when
    given, as a BackendResult. The client's errors (gyre.engines.sglang_client) propagate: what they mean depends
    on the caller (SGLangBackend maps them to the protocol's two kinds; RoutedBackend retries some elsewhere)."""
    if on_output is None:
        response = await client.generate(prompt_ids, sampling_params, rid=rid, return_logprob=True)
    else:
        assert progress is not None, "a streamed generation records its progress"
        response = await stream_generate(client, prompt_ids, sampling_params, rid, on_output, progress)
    return result_from_sglang(response, cell)


@attrs.define
class _Cell:
    name: str
    client: Any
    in_flight: int = 0


class SGLangBackend:
    """A GenerateBackend over SGLang-compatible servers: `cells` maps a cell name to its `SGLangClient`."""

    def __init__(self, cells: Mapping[str, Any], max_sessions: int = 65536) -> None:
        if not cells:
            raise ValueError("SGLangBackend needs at least one cell")
        self._cells = [_Cell(name, client) for name, client in cells.items()]
        self._sticky: OrderedDict[str, _Cell] = OrderedDict()
        self._max_sessions = max_sessions

    def _route(self, session_key: str) -> _Cell:
        cell = self._sticky.get(session_key)
        if cell is None:
            cell = min(self._cells, key=lambda c: c.in_flight)
            self._sticky[session_key] = cell
            while len(self._sticky) > self._max_sessions:
                self._sticky.popitem(last=False)
        else:
            self._sticky.move_to_end(session_key)
        return cell

    async def generate(self, request: BackendRequest) -> BackendResult:
        return await self._on_cell(request, None)

    async def generate_streaming(self, request: BackendRequest, on_output: OnOutput) -> BackendResult:
        return await self._on_cell(request, on_output)

    async def _on_cell(self, request: BackendRequest, on_output: OnOutput | None) -> BackendResult:
        """Generate on the session's cell, counting it in flight and mapping client errors to the protocol's."""
        from gyre.engines.sglang_client import RequestRejected, SGLangError

        cell = self._route(request.session_key)
        cell.in_flight += 1
        progress = StreamProgress() if on_output is not None else None
        try:
            return await engine_generate(
                cell.client, cell.name, request.prompt_ids, request.sampling_params, request.rid, on_output, progress
            )
        except RequestRejected as error:
            raise BackendRejected(error.message) from None
        except SGLangError as error:
            raise BackendUnavailable(f"cell {cell.name}: {error}") from None
        finally:
            cell.in_flight -= 1


def sampling_params_from_dict(params: Mapping[str, Any]) -> Any:
    """SGLang's sampling_params dict -> the embedded engine's SamplingParams; unknown keys are refused."""
    from gyre.engines.embedded_engine import SamplingParams

    unknown = sorted(set(params) - set(_EMBEDDED_FIELDS))
    if unknown:
        raise BackendRejected(f"sampling params not supported by the embedded engine: {unknown}")
    fields: dict[str, Any] = {}
    for key, value in params.items():
        if key in ("stop", "stop_token_ids"):
            value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        fields[_EMBEDDED_FIELDS[key]] = value
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as error:
        raise BackendRejected(str(error)) from None


class EmbeddedBackend:
    """A GenerateBackend over an in-process `gyre.engines.async_engine.AsyncEngine` named `cell`."""

    def __init__(self, engine: Any, cell: str = "embedded") -> None:
        self.engine = engine
        self.cell = cell

    async def generate(self, request: BackendRequest) -> BackendResult:
        params = sampling_params_from_dict(request.sampling_params)
        try:
            out = await self.engine.generate(request.rid, list(request.prompt_ids), params)
        except (EngineOverloaded, EngineFailed, EngineClosed) as error:
            raise BackendUnavailable(f"cell {self.cell}: {error}") from None
        except RequestError as error:
            raise BackendRejected(str(error)) from None
        return self._result(out)

    async def generate_streaming(self, request: BackendRequest, on_output: OnOutput) -> BackendResult:
        params = sampling_params_from_dict(request.sampling_params)
        sent: list[int] = []
        out = None
        try:
            # aclosing: leaving early (on_output raised, the call was cancelled) aborts the request at once.
            async with aclosing(self.engine.stream(request.rid, list(request.prompt_ids), params)) as events:
                async for event in events:
                    if event.token_ids:
                        sent.extend(event.token_ids)
                        await on_output(tuple(event.token_ids))
                    if event.finished is not None:
                        out = event.finished
                        break
        except (EngineOverloaded, EngineFailed, EngineClosed) as error:
            raise BackendUnavailable(f"cell {self.cell}: {error}") from None
        except RequestError as error:
            raise BackendRejected(str(error)) from None
        if out is None:
            raise BackendUnavailable(f"cell {self.cell}: the engine's stream ended without a result")
        if list(out.output_ids[: len(sent)]) != sent:
            raise BackendUnavailable(f"cell {self.cell}: streamed ids differ from the result's")
        if len(out.output_ids) > len(sent):
            await on_output(tuple(out.output_ids[len(sent) :]))
        return self._result(out)

    def _result(self, out: Any) -> BackendResult:
        return BackendResult(
            output_ids=tuple(out.output_ids),
            output_logprobs=tuple(out.output_logprobs),
            output_versions=tuple(out.output_versions),
            finish_reason=out.finish_reason,
            cached_tokens=int(out.cached_tokens),
            cell=self.cell,
            matched_stop=out.matched_stop,
        )
