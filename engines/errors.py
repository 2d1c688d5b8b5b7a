"""The engines layer's errors: one base, `EngineError`, under the runtime's `GyreError`.

Each error also keeps the builtin it always was (`ValueError` for bad input, `RuntimeError` for a failure outside
the caller's control), so an `except ValueError` written before this family existed still catches it. The modules
that raise them import them from here and re-export them, so `from gyre.engines.trainer import TrainerError` keeps
working; new code imports from `gyre.engines.errors`.

This module imports nothing but `gyre.runtime.errors`: a caller can catch an engine's errors without importing
torch or the engine itself.
"""

from __future__ import annotations

from gyre.runtime.errors import GyreError

__all__ = [
    "ChatTemplateError",
    "ConversionError",
    "EngineClosed",
    "EngineError",
    "EngineFailed",
    "EngineOverloaded",
    "ModelFormatError",
    "OutOfBlocks",
    "RequestError",
    "SFTError",
    "TrainerError",
    "TransferError",
]


class EngineError(GyreError):
    """Base of every error the engines layer raises on purpose."""


# Model directories and weights (model_format, qwen3_paged, weight_convert, chat_template).


class ModelFormatError(EngineError, ValueError):
    """A model directory, config or weight update that Gyre cannot read or run (missing or unreadable file,
    unsupported architecture or option, tensors of the wrong names or shapes)."""


class ConversionError(ModelFormatError):
    """A state dict that does not match the model spec it is converted with."""


class ServedModelMismatch(ModelFormatError):
    """An engine server holds another model than the model directory it is used with (vocabulary or layout
    differ), or one Gyre cannot read."""


class ChatTemplateError(EngineError, ValueError):
    """A conversation the template cannot render (unknown role, non-text content, malformed tool call), or a model
    directory without a tokenizer."""


# The embedded engine and its awaitable face (embedded_engine, async_engine, kv_pool).


class RequestError(EngineError, ValueError):
    """A request or control call the embedded engine refuses (bad input, wrong state). The server answers 400."""


class EngineOverloaded(RequestError):
    """The waiting queue is full: explicit backpressure. The server answers 503; retry later."""


class EngineFailed(EngineError, RuntimeError):
    """The engine's step raised: the engine is broken and every pending request failed with this error."""


class EngineClosed(EngineError, RuntimeError):
    """The AsyncEngine was closed (by its owner)."""


class OutOfBlocks(EngineError, RuntimeError):
    """The pool has fewer free blocks than asked for; the caller evicts, waits or retracts."""


# Training (trainer, sft).


class TrainerError(EngineError, ValueError):
    """Bad input to the trainer: wrong shapes or ids, a loss that is not a differentiable scalar, a flat tensor of
    the wrong size, or a process set up with model parallelism this trainer does not use."""


class SFTError(EngineError, ValueError):
    """Demonstrations that cannot be trained on (empty, too long, malformed)."""


# Bulk memory transfer (transfer).


class TransferError(EngineError, RuntimeError):
    """A Mooncake operation failed. The message says what, with whom, and which memory is now unsafe to reuse.

    After a failed transfer, `unsafe_ranges` lists the (addr, nbytes) ranges whose contents are unknown and that
    the transport may still write, on the `unsafe_side` ("local": ours, after a read; "remote": the peer's, after a
    write). Their owner must not hand them out again as if clean (e.g. an engine should quarantine, not free, KV
    blocks a failed import was filling); Mooncake offers no way to wait for stragglers of a failed batch.
    """

    def __init__(
        self, message: str, *, unsafe_side: str | None = None, unsafe_ranges: tuple[tuple[int, int], ...] = ()
    ) -> None:
        super().__init__(message)
        self.unsafe_side = unsafe_side
        self.unsafe_ranges = unsafe_ranges


# ---- The engine server and its HTTP client (engine_server, sglang_client) ----------------------------------------

__all__ += [
    "BadRequest",
    "CapabilityMissing",
    "EngineKeyError",
    "EngineTimeout",
    "EngineUnauthorized",
    "EngineUnreachable",
    "KVTransferFailed",
    "RequestRejected",
    "SGLangError",
    "ServerError",
]


class BadRequest(EngineError):
    """A request the engine server refuses before it reaches the engine; `status` and `type` go into the answer."""

    def __init__(self, message: str, type_: str = "invalid_request_error", status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.type = type_
        self.status = status


class EngineKeyError(EngineError, ValueError):
    """An engine server's API key that is missing, unreadable or malformed (the message never holds the key)."""


class SGLangError(EngineError, RuntimeError):
    """Base of the HTTP client's errors; `endpoint` and `status` (None when no HTTP answer came) say where."""

    def __init__(self, endpoint: str, status: int | None, message: str) -> None:
        where = f"{endpoint} -> {status}" if status is not None else endpoint
        super().__init__(f"{where}: {message}")
        self.endpoint = endpoint
        self.status = status
        self.message = message


class RequestRejected(SGLangError):
    """The server refused the request (4xx, or success=false); the message is the server's own."""


class EngineUnauthorized(RequestRejected):
    """The server refused the client's key (401): the client holds no key, or another than the server's."""


class CapabilityMissing(SGLangError):
    """The server has no such endpoint (404), e.g. /gyre/kv/* on a real SGLang server: fall back."""


class ServerError(SGLangError):
    """The server failed (5xx)."""


class KVTransferFailed(ServerError):
    """The importing server could not read the exported blocks (Mooncake failed): fall back to re-prefill."""


class EngineUnreachable(SGLangError):
    """No HTTP answer: connection refused or reset."""


class EngineTimeout(SGLangError, TimeoutError):
    """The request did not finish within its timeout."""
