"""Gyre's embedded inference engine: continuous batching over a paged KV pool with a radix prefix cache.

The engine is a synchronous state machine driven by `step()`; `AsyncEngine` runs it in a worker thread. Each step:
1. admits waiting requests while there is room (running limit, KV blocks), reusing cached prefix blocks;
2. gives every running request its next chunk: one token for a decoding request, up to the step's prefill budget
   (`max_prefill_tokens`) of prompt for a prefilling one, so long prompts are cut into chunks and decodes never
   wait behind a whole prefill;
3. runs one forward pass over all chunks, samples the next token of every request whose chunk reached its end,
   checks stop conditions, and returns events (new tokens, finished requests).
Requests join and leave between steps. When KV blocks run out during decode, the most recently admitted request is
retracted: its computed blocks go to the prefix cache, it returns to the head of the queue with its output so far,
and on readmission recomputes only what the cache lost.

Prefix reuse: a request's prompt blocks enter the radix cache as soon as its prefill completes (so siblings of a
GRPO group share them) and its whole sequence when it finishes or is aborted (so the next turn of an agent session
finds everything up to its new observation). A weight update or flush starts a new cache epoch: KV computed before
it is never cached again.

Everything here is bounded: running requests, waiting queue, context length, pinned exports.
"""

from __future__ import annotations

import collections
import random
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import attrs
import structlog
import torch

from gyre.engines.errors import EngineOverloaded, ModelFormatError, RequestError
from gyre.engines.kv_pool import KVLayout, KVPool, KVStaging, StagedRegion, torch_dtype
from gyre.engines.qwen3_paged import Qwen3Paged, Qwen3Spec, SeqChunk, read_safetensors_dir
from gyre.engines.radix_cache import RadixCache, RadixNode
from gyre.engines.sampling import (
    RequestSampler,
    SamplingParams,
    StopChecker,
    load_eos_token_ids,
    load_tokenizer,
    sample_next,
)
from gyre.runtime.validators import count

__all__ = [
    "EmbeddedEngine",
    "EngineConfig",
    "EngineOverloaded",
    "EngineStats",
    "ExportedPrefix",
    "GenerateOutput",
    "KVLayout",
    "RequestError",
    "SamplingParams",
    "StepEvent",
]

log = structlog.get_logger(__name__)

MEMORY_TAGS = frozenset({"weights", "kv_cache", "cuda_graph"})
# Uncached blocks a waiting request must share with one still prefilling before it waits for that prefill.
SIBLING_MIN_BLOCKS = 2


@attrs.frozen
class EngineConfig:
    """Sizes and limits of one embedded engine."""

    block_size_tokens: int = attrs.field(default=16, validator=count)
    """Tokens per KV block; also the granularity of prefix sharing."""
    num_blocks: int = attrs.field(default=2048, validator=count)
    """KV blocks in the pool."""
    max_running_requests: int = attrs.field(default=64, validator=count)
    """Requests decoded together at most."""
    max_context_tokens: int = attrs.field(default=8192, validator=count)
    """Prompt plus output tokens of one request at most."""
    max_prefill_tokens: int = attrs.field(default=4096, validator=count)
    """Prompt tokens computed per step at most (chunked prefill budget)."""
    dtype: str = "float32"
    """Weights and KV element type: float32, bfloat16 or float16."""
    num_threads: int | None = None
    """torch intra-op threads; None leaves torch's setting alone."""
    # Fields beyond INTERFACES.md's list; the ones above keep its order, so positional use still works.
    max_waiting_requests: int = attrs.field(default=1024, validator=count)
    """Queued requests at most; beyond it `submit` raises EngineOverloaded."""
    max_exports: int = attrs.field(default=256, validator=count)
    """Exported prefixes pinned at once at most."""
    decode_staging_bytes: int = 256 << 20
    """Memory for contiguous copies of the decoding requests' K/V (saves a gather of every context per layer
    per step); a decode group that needs more falls back to gathering. 0 disables staging."""
    seed: int = 0
    """Seeds the per-request seeds of requests that give none, so a run is reproducible."""
    kv_staging_tokens: int | None = None
    """Tokens of KV the export/import staging buffer holds (rounded up to blocks): exports and imports that fit move
    as one contiguous transfer, others block by block. None: one max-context prefix (the largest export there can
    be; a quarter of the pool in the usual configurations). 0 disables staging."""

    def __attrs_post_init__(self) -> None:
        torch_dtype(self.dtype)
        staging = self.kv_staging_tokens
        if staging is not None and (type(staging) is not int or staging < 0):
            raise ValueError(f"kv_staging_tokens must be None or an int >= 0, got {self.kv_staging_tokens!r}")
        if type(self.decode_staging_bytes) is not int or self.decode_staging_bytes < 0:
            raise ValueError(f"decode_staging_bytes must be an int >= 0, got {self.decode_staging_bytes!r}")
        if self.max_context_tokens > self.num_blocks * self.block_size_tokens:
            raise ValueError(
                f"max_context_tokens {self.max_context_tokens} exceeds the pool "
                f"({self.num_blocks} blocks x {self.block_size_tokens} tokens): a long request could never run"
            )


@attrs.frozen
class GenerateOutput:
    """The result of one finished (or aborted) request."""

    rid: str
    output_ids: tuple[int, ...]
    """Generated tokens; a matched stop token is the last one."""
    output_logprobs: tuple[float, ...]
    """log p(token) under the logits divided by the request's temperature (1 when greedy; no top-p/top-k: see
    engines/sampling.py); empty without return_logprob."""
    output_versions: tuple[int, ...]
    """Weight version that produced each output token."""
    finish_reason: str
    """"stop", "length" or "abort"."""
    matched_stop: int | str | None
    """The stop token id or stop string that ended the request, else None."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache at admission."""


@attrs.frozen
class StepEvent:
    """What happened to one request in one step: new tokens and/or the end."""

    rid: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finished: GenerateOutput | None = None


@attrs.frozen
class ExportedPrefix:
    """Cached blocks pinned for a peer to read (see `export_prefix`)."""

    handle: str
    num_tokens: int
    """Tokens covered: len(block_ids) * block_size."""
    block_ids: tuple[int, ...]
    staging_addr: int = 0
    """Address of a contiguous copy of the blocks in the exporter's staging buffer, in `KVLayout.block_addrs`
    order ([layers, 2, blocks, ...]); 0 when the export is not staged (staging full or off): read block by block."""
    staging_nbytes: int = 0
    """Size of that copy: len(block_ids) * layers * 2 * block_nbytes, or 0."""


@attrs.frozen
class EngineStats:
    """A snapshot of the engine's load and cache (trio-style statistics record)."""

    running: int
    waiting: int
    paused: bool
    free_blocks: int
    total_blocks: int
    cached_blocks: int
    """Blocks held by the prefix cache."""
    cached_tokens_total: int
    """Prompt tokens served from the prefix cache, summed over admitted requests."""
    prompt_tokens_total: int
    generated_tokens_total: int
    prefix_hit_rate: float
    """cached_tokens_total / prompt_tokens_total (0 before any request)."""
    weight_version: int
    steps: int
    retractions: int
    exports: int
    """Exported prefixes still pinned."""
    memory_released: tuple[str, ...]


class _Request:
    __slots__ = (
        "rid", "tokens", "prompt_len", "params", "return_logprob", "sampler", "stopper", "max_new_tokens",
        "logprobs", "versions", "block_table", "computed", "cached_tokens", "node", "epoch", "admitted", "serial",
    )

    def __init__(self, rid: str, prompt: list[int], params: SamplingParams, return_logprob: bool) -> None:
        self.rid = rid
        self.tokens = prompt
        self.prompt_len = len(prompt)
        self.params = params
        self.return_logprob = return_logprob
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.block_table: list[int] = []
        self.computed = 0
        self.cached_tokens = 0
        self.node: RadixNode | None = None
        self.epoch = -1
        self.admitted = False
        self.serial = 0

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class EmbeddedEngine:
    """See the module docstring. Not thread-safe: call it from one thread (AsyncEngine does)."""

    def __init__(self, model_dir: str | Path, config: EngineConfig = EngineConfig()) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_dir = str(model_dir)
        try:
            self.spec = Qwen3Spec.from_model_dir(model_dir)
            self.model = Qwen3Paged(self.spec, config.dtype, staging_max_bytes=config.decode_staging_bytes)
            self.model.load_hf_state_dict(read_safetensors_dir(model_dir))
        except ModelFormatError as error:
            raise RequestError(str(error)) from error
        self.weight_version = 0
        self._weights_source = (self.model_dir, 0)
        self.tokenizer = load_tokenizer(model_dir)
        self.eos_token_ids = load_eos_token_ids(model_dir)
        self.pool: KVPool | None = None
        self.cache: RadixCache | None = None
        self.staging: KVStaging | None = None
        self._new_pool()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._by_rid: dict[str, _Request] = {}
        self._pending: list[StepEvent] = []
        self._paused = False
        self._stalled = False
        self._epoch = 0
        self._exports: dict[str, tuple[RadixNode, StagedRegion | None]] = {}
        self._export_seq = 0
        self._seeds = random.Random(config.seed)
        self._released: set[str] = set()
        self._counters = collections.Counter()

    # ---- requests -----------------------------------------------------------------------------------------

    def submit(
        self, rid: str, input_ids: Sequence[int], params: SamplingParams = SamplingParams(), return_logprob: bool = True
    ) -> None:
        """Queue a request. RequestError for bad input or a duplicate rid; EngineOverloaded when the queue is full."""
        if not isinstance(rid, str) or not rid:
            raise RequestError("rid must be a non-empty string")
        if rid in self._by_rid:
            raise RequestError(f"request {rid!r} is already in flight")
        if not isinstance(params, SamplingParams):
            raise RequestError("params must be SamplingParams")
        prompt = self._check_ids(input_ids)
        if len(prompt) >= self.config.max_context_tokens:
            raise RequestError(
                f"prompt of {len(prompt)} tokens leaves no room under max_context_tokens "
                f"{self.config.max_context_tokens}"
            )
        if self._released:
            raise RequestError(f"memory is released ({sorted(self._released)}); resume it first")
        if len(self._waiting) >= self.config.max_waiting_requests:
            raise EngineOverloaded(f"waiting queue is full ({self.config.max_waiting_requests} requests)")
        request = _Request(rid, prompt, params, return_logprob)
        request.max_new_tokens = min(params.max_new_tokens, self.config.max_context_tokens - len(prompt))
        try:
            request.stopper = StopChecker(params, self.eos_token_ids, self.tokenizer, request.max_new_tokens)
        except ValueError as error:
            raise RequestError(str(error)) from None
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request.sampler = RequestSampler(params, seed)
        self._waiting.append(request)
        self._by_rid[rid] = request
        self._stalled = False

    def _check_ids(self, input_ids: Sequence[int]) -> list[int]:
        if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
            raise RequestError("input_ids must be a sequence of ints")
        ids = list(input_ids)
        if not ids:
            raise RequestError("input_ids is empty")
        vocab = self.spec.vocab_size
        # The common case in C (a type set, min, max); the loop only to name the first bad id.
        if set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= vocab:
            for token in ids:
                if type(token) is not int or not 0 <= token < vocab:
                    raise RequestError(f"token id {token!r} is not an int in [0, {vocab})")
        return ids

    def has_work(self) -> bool:
        """Whether `step()` would do anything now (False while paused, released or stalled on blocks)."""
        if self._pending:
            return True
        if self._paused or self._released or self._stalled:
            return False
        return bool(self._running or self._waiting)

    def abort(self, rid: str) -> bool:
        """Finish a queued or running request with reason "abort" (its event comes with the next step)."""
        request = self._by_rid.get(rid)
        if request is None:
            return False
        self._finish(request, "abort", None)
        return True

    def abort_all(self) -> int:
        requests = list(self._running) + list(self._waiting)
        for request in requests:
            self._finish(request, "abort", None)
        return len(requests)

    def pause(self, mode: str = "abort") -> int:
        """Stop stepping. "abort" aborts every request; "in_place" keeps them and their KV; "retract" keeps them
        queued but releases their KV to the prefix cache. Returns the number of requests affected."""
        if mode not in ("abort", "in_place", "retract"):
            raise RequestError(f"pause mode must be 'abort', 'in_place' or 'retract', got {mode!r}")
        self._paused = True
        if mode == "abort":
            return self.abort_all()
        if mode == "retract":
            running = list(self._running)
            for request in reversed(running):
                self._retract(request)
            return len(running)
        return len(self._running) + len(self._waiting)

    def continue_generation(self) -> None:
        self._paused = False
        self._stalled = False

    @property
    def paused(self) -> bool:
        return self._paused

    def live_sequences(self) -> dict[str, tuple[int, ...]]:
        """rid -> prompt + output so far of every queued or running request: what a KV migration of generations
        paused in place moves (their computed blocks are exported with `export_prefix`)."""
        return {request.rid: tuple(request.tokens) for request in list(self._running) + list(self._waiting)}

    # ---- the step -----------------------------------------------------------------------------------------

    def step(self) -> list[StepEvent]:
        """Admit, run one forward pass, sample, and return what happened since the last step."""
        events, self._pending = self._pending, []
        if self._paused or self._released:
            return events
        self._admit()
        chunks, owners = self._schedule()
        if not chunks:
            self._stalled = not events and bool(self._waiting or self._running)
            if self._stalled:
                log.warning("engine_stalled_no_kv_blocks_for_any_waiting_request", waiting=len(self._waiting))
            return events + self._take_pending()
        self._counters["steps"] += 1
        logits = self.model.forward(chunks, self.pool)  # type: ignore[arg-type]
        # Only "last" chunks produce logits rows, one each, in chunk order.
        samplers: list[RequestSampler] = []
        sampled: list[_Request] = []
        for chunk, request in zip(chunks, owners):
            request.computed += len(chunk.token_ids)
            if chunk.logits == "last":
                samplers.append(request.sampler)
                sampled.append(request)
            if len(chunk.token_ids) > 1:
                self._cache_prefix(request)  # prefill progress: requests waiting for this prefix can share it
            if request.computed == request.prompt_len and not request.output_ids and request.max_new_tokens == 0:
                self._finish(request, "length", None)
        if sampled:
            # Each token's noise comes from (seed, its absolute position): a resumed generation continues alike.
            tokens, logprobs = sample_next(logits, samplers, [len(r.tokens) for r in sampled])
            for request, token, logprob in zip(sampled, tokens, logprobs):
                request.tokens.append(token)
                request.versions.append(self.weight_version)
                if request.return_logprob:
                    request.logprobs.append(logprob)
                self._counters["generated_tokens"] += 1
                result = request.stopper.check(request.output_ids)
                if result is not None:
                    self._finish(request, result.finish_reason, result.matched, token_event=True)
                else:
                    events.append(
                        StepEvent(
                            request.rid,
                            (token,),
                            (logprob,) if request.return_logprob else (),
                            (self.weight_version,),
                        )
                    )
        return events + self._take_pending()

    def _take_pending(self) -> list[StepEvent]:
        events, self._pending = self._pending, []
        return events

    def _admit(self) -> None:
        """Admit waiting requests in order while there is room. A request that shares at least
        `SIBLING_MIN_BLOCKS` uncached blocks with a request still prefilling waits for that prefill to reach the
        cache (usually one step) instead of computing the same prefix twice: GRPO groups and sessions that start
        with one system prompt arrive together, and nothing is cached for them yet."""
        if not self._waiting:
            return
        prefilling = [r for r in self._running if r.computed < len(r.tokens) - 1 and r.epoch == self._epoch]
        deferred = 0
        for request in list(self._waiting):
            if len(self._running) >= self.config.max_running_requests:
                break
            if prefilling and self._sibling_prefilling(request, prefilling):
                deferred += 1
                if deferred >= self.config.max_running_requests:
                    break  # bounds the scan of a long queue of siblings
                continue
            if not self._try_admit(request):
                break  # no KV room: later requests wait too (first come, first served)
            self._waiting.remove(request)
            self._running.append(request)
            if request.computed < len(request.tokens) - 1:
                prefilling.append(request)

    def _sibling_prefilling(self, request: _Request, prefilling: list[_Request]) -> bool:
        assert self.cache is not None
        size = self.config.block_size_tokens
        limit = (len(request.tokens) - 1) // size
        cached = len(self.cache.match_prefix(request.tokens, max_blocks=limit).block_ids)
        tokens = request.tokens
        for other in prefilling:
            theirs = other.tokens
            shared = 0
            end = min(limit, len(theirs) // size)
            while shared < end:
                block = slice(shared * size, (shared + 1) * size)
                if tokens[block] != theirs[block]:
                    break
                shared += 1
            if shared >= cached + SIBLING_MIN_BLOCKS:
                return True
        return False

    def _try_admit(self, request: _Request) -> bool:
        cache, pool, size = self.cache, self.pool, self.config.block_size_tokens
        assert cache is not None and pool is not None
        tokens = request.tokens
        # At least the last token is computed: its logits give the next token.
        match = cache.match_prefix(tokens, max_blocks=(len(tokens) - 1) // size)
        needed = -(-len(tokens) // size) - len(match.block_ids)
        # Headroom: each running request may need one more block at its next block boundary.
        if not self._make_room(needed + len(self._running), protect=match.node):
            return False
        cache.lock(match.node)
        pool.incref(match.block_ids)
        request.block_table = list(match.block_ids) + pool.alloc(needed)
        request.node = match.node
        request.computed = len(match.block_ids) * size
        request.epoch = self._epoch
        self._counters["admissions"] += 1
        request.serial = self._counters["admissions"]  # a new identity per admission: staged K/V never carries over
        if not request.admitted:
            request.admitted = True
            request.cached_tokens = request.computed
            self._counters["prompt_tokens"] += request.prompt_len
            self._counters["cached_tokens"] += request.computed
        return True

    def _make_room(self, blocks: int, protect: RadixNode | None = None) -> bool:
        """Evict cached blocks until `blocks` are free; False (nothing evicted) if that is impossible."""
        pool, cache = self.pool, self.cache
        assert pool is not None and cache is not None
        short = blocks - pool.num_free
        if short <= 0:
            return True
        if protect is not None:
            cache.lock(protect)  # the blocks about to be matched must survive the eviction
        try:
            if cache.num_evictable_blocks() < short:
                return False
            cache.evict(short)
        finally:
            if protect is not None:
                cache.unlock(protect)
        return pool.num_free >= blocks

    def _schedule(self) -> tuple[list[SeqChunk], list[_Request]]:
        budget = self.config.max_prefill_tokens
        chunks: list[SeqChunk] = []
        owners: list[_Request] = []
        size = self.config.block_size_tokens
        for request in list(self._running):
            if request not in self._running:  # retracted to make room for an earlier request
                continue
            remaining = len(request.tokens) - request.computed
            if remaining == 1:
                if len(request.tokens) > len(request.block_table) * size and not self._grow(request):
                    continue
                take = 1
            else:
                take = min(remaining, budget)
                if take <= 0:
                    continue
                budget -= take
            end = request.computed + take
            reaches_end = end == len(request.tokens)
            wants_logits = reaches_end and request.max_new_tokens > 0
            chunks.append(
                SeqChunk(request.tokens[request.computed : end], request.computed, request.block_table,
                         "last" if wants_logits else "none", seq_key=request.serial)
            )
            owners.append(request)
        return chunks, owners

    def _grow(self, request: _Request) -> bool:
        """One more block for a decoding request; retracts the newest other requests if the pool is full."""
        assert self.pool is not None
        while not self._make_room(1):
            victim = self._running[-1]
            self._retract(victim)
            if victim is request:
                return False
        request.block_table.extend(self.pool.alloc(1))
        return True

    def _retract(self, request: _Request) -> None:
        """Move a running request back to the head of the queue; its computed KV goes to the prefix cache."""
        self._release_blocks(request)
        self._running.remove(request)
        self._waiting.appendleft(request)
        self._counters["retractions"] += 1
        log.info("request_retracted_for_kv_space", rid=request.rid, tokens=len(request.tokens))

    def _cache_prefix(self, request: _Request) -> None:
        """Put the request's full computed blocks into the radix cache and share the cache's copies."""
        cache, pool = self.cache, self.pool
        if cache is None or pool is None or request.epoch != self._epoch or not request.block_table:
            return
        full = min(request.computed // self.config.block_size_tokens, len(request.block_table))
        if full == 0:
            return
        match = cache.insert(request.tokens, request.block_table[:full])
        for i, tree_block in enumerate(match.block_ids):
            mine = request.block_table[i]
            if mine != tree_block:  # the cache already held these tokens: use its block, drop our duplicate
                pool.incref([tree_block])
                pool.decref([mine])
                request.block_table[i] = tree_block
        cache.lock(match.node)
        if request.node is not None:
            cache.unlock(request.node)
        request.node = match.node

    def _release_blocks(self, request: _Request) -> None:
        if request.block_table and self.pool is not None:
            self._cache_prefix(request)
            self.pool.decref(request.block_table)
        if request.node is not None and self.cache is not None:
            self.cache.unlock(request.node)
        request.block_table = []
        request.node = None
        request.computed = 0

    def _finish(self, request: _Request, reason: str, matched: int | str | None, token_event: bool = False) -> None:
        if request in self._running:
            self._release_blocks(request)
            self._running.remove(request)
        else:
            self._waiting.remove(request)
            self._release_blocks(request)
        del self._by_rid[request.rid]
        output = GenerateOutput(
            rid=request.rid,
            output_ids=tuple(request.output_ids),
            output_logprobs=tuple(request.logprobs),
            output_versions=tuple(request.versions),
            finish_reason=reason,
            matched_stop=matched,
            prompt_tokens=request.prompt_len,
            cached_tokens=request.cached_tokens,
        )
        if token_event:
            new = (
                (request.tokens[-1],),
                (request.logprobs[-1],) if request.return_logprob else (),
                (request.versions[-1],),
            )
        else:
            new = ((), (), ())
        self._pending.append(StepEvent(request.rid, *new, finished=output))
        self._stalled = False

    # ---- weights ------------------------------------------------------------------------------------------

    def load_weights(self, hf_state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy (some or all) Hugging Face named tensors into the model and tag later tokens with `version`.

        Requests paused in place keep their KV (as SGLang does); the prefix cache is dropped, since KV computed
        with other weights must not be reused by new requests.
        """
        if type(version) is not int:
            raise RequestError(f"weight version must be an int, got {version!r}")
        if "weights" in self._released:
            raise RequestError("weights are released; resume them first")
        try:
            self.model.load_hf_state_dict(hf_state_dict, partial=True)
        except ModelFormatError as error:
            raise RequestError(str(error)) from error
        self.weight_version = version
        self._new_epoch()
        log.info("weights_loaded", version=version, tensors=len(hf_state_dict))

    def load_weights_from_disk(self, model_dir: str | Path, version: int) -> None:
        """Load a whole checkpoint of the same architecture from an HF model directory."""
        try:
            spec = Qwen3Spec.from_model_dir(model_dir)
            if spec != self.spec:
                raise RequestError(f"{model_dir} holds a different architecture than the running model")
            state = read_safetensors_dir(model_dir)
        except ModelFormatError as error:
            raise RequestError(str(error)) from error
        if type(version) is not int:
            raise RequestError(f"weight version must be an int, got {version!r}")
        if "weights" in self._released:
            raise RequestError("weights are released; resume them first")
        try:
            self.model.load_hf_state_dict(state, partial=False)
        except ModelFormatError as error:
            raise RequestError(str(error)) from error
        self.weight_version = version
        self._weights_source = (str(model_dir), version)
        self._new_epoch()
        log.info("weights_loaded_from_disk", version=version, model_dir=str(model_dir))

    def _new_epoch(self) -> None:
        self._epoch += 1
        if self.cache is not None:
            self.cache.reset()

    def flush_cache(self) -> bool:
        """Drop the prefix cache. Refused (False) while requests are in flight and not paused, as in SGLang."""
        if (self._running or self._waiting) and not self._paused:
            return False
        self._new_epoch()
        return True

    # ---- memory -------------------------------------------------------------------------------------------

    def _new_pool(self) -> None:
        self.pool = KVPool(
            self.spec.num_layers,
            self.config.num_blocks,
            self.config.block_size_tokens,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            self.config.dtype,
        )
        self.cache = RadixCache(self.pool, self.config.block_size_tokens)
        size = self.config.block_size_tokens
        tokens = self.config.kv_staging_tokens
        blocks = -(-(self.config.max_context_tokens if tokens is None else tokens) // size)
        self.staging = KVStaging(self.pool, blocks) if blocks > 0 else None

    def _tags(self, tags: Iterable[str] | None) -> set[str]:
        chosen = set(MEMORY_TAGS if tags is None else tags)
        unknown = chosen - MEMORY_TAGS
        if unknown:
            raise RequestError(f"unknown memory tags {sorted(unknown)}; expected a subset of {sorted(MEMORY_TAGS)}")
        return chosen - {"cuda_graph"}  # nothing to release on CPU

    def release_memory(self, tags: Iterable[str] | None = None) -> None:
        """Free the KV pool and/or the weights (e.g. while this machine trains). Needs an idle engine."""
        chosen = self._tags(tags)
        if self._running or self._waiting:
            raise RequestError("release_memory needs an idle engine: abort or finish requests first")
        if "kv_cache" in chosen and self.pool is not None:
            self._exports.clear()  # their pins die with the pool
            self._new_epoch()
            self.model.drop_staging()
            self.pool = None
            self.cache = None
            self.staging = None
            self._released.add("kv_cache")
        if "weights" in chosen and self.model.has_weights:
            self.model.release_weights()
            self._released.add("weights")
        log.info("memory_released", tags=sorted(chosen))

    def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        """Re-create what `release_memory` freed. Weights come back from the last checkpoint loaded from disk (and
        its version): callers that pushed tensors since then push them again after resuming."""
        chosen = self._tags(tags)
        if "kv_cache" in chosen and "kv_cache" in self._released:
            self._new_pool()
            self._released.discard("kv_cache")
        if "weights" in chosen and "weights" in self._released:
            source, version = self._weights_source
            self.model.load_hf_state_dict(read_safetensors_dir(source), partial=False)
            self.weight_version = version
            self._released.discard("weights")
            self._new_epoch()
        self._stalled = False
        log.info("memory_resumed", tags=sorted(chosen), weight_version=self.weight_version)

    # ---- log-probs, export, import -------------------------------------------------------------------------

    def _require_pool(self) -> tuple[KVPool, RadixCache]:
        if self.pool is None or self.cache is None or "weights" in self._released:
            raise RequestError(f"memory is released ({sorted(self._released)}); resume it first")
        return self.pool, self.cache

    def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """log p(t_i | t_<i) for i = 1..n-1, computed through the paged path (chunked like a prefill)."""
        pool, cache = self._require_pool()
        ids = self._check_ids(token_ids)
        if len(ids) > self.config.max_context_tokens:
            raise RequestError(f"{len(ids)} tokens exceed max_context_tokens {self.config.max_context_tokens}")
        size = self.config.block_size_tokens
        needed = -(-len(ids) // size)
        if not self._make_room(needed):
            raise RequestError(f"no room for {needed} KV blocks now; retry when requests finish")
        blocks = pool.alloc(needed)
        try:
            result: list[float] = []
            step = self.config.max_prefill_tokens
            for start in range(0, len(ids), step):
                chunk = ids[start : start + step]
                logits = self.model.forward([SeqChunk(chunk, start, blocks, "all")], pool)
                logprobs = torch.log_softmax(logits, -1)
                following = ids[start + 1 : start + 1 + len(chunk)]
                index = torch.tensor(following, dtype=torch.long).unsqueeze(-1)
                result.extend(logprobs[: len(following)].gather(-1, index).squeeze(-1).tolist())
            full = len(ids) // size
            if full:
                cache.insert(ids, blocks[:full])
        finally:
            pool.decref(blocks)
        return result

    def _cache_running(self) -> None:
        for request in self._running:
            self._cache_prefix(request)

    def export_prefix(self, token_ids: Sequence[int]) -> ExportedPrefix:
        """Pin the cached blocks of the longest cached prefix of `token_ids` so a peer can read them.

        Live requests' computed blocks are cached first, so a session paused mid-generation exports everything it
        has computed. When the staging buffer has room, the blocks are also copied into one contiguous region of it
        (`staging_addr`), so a peer moves them with one transfer entry instead of one per (layer, K/V, block run);
        the region stays untouched until the export is released. Release the pin with `release_export(handle)`.
        """
        pool, cache = self._require_pool()
        ids = self._check_ids(token_ids)
        if len(self._exports) >= self.config.max_exports:
            raise RequestError(f"{len(self._exports)} exports are pinned (max {self.config.max_exports})")
        self._cache_running()
        match = cache.match_prefix(ids)
        region = None
        if match.block_ids and self.staging is not None:
            region = self.staging.reserve(len(match.block_ids))
            if region is None:
                log.debug("staging_buffer_full_export_goes_block_by_block", blocks=len(match.block_ids))
            else:
                self.staging.gather(pool, match.block_ids, region)
        cache.lock(match.node)
        self._export_seq += 1
        handle = f"export-{self._export_seq}"
        self._exports[handle] = (match.node, region)
        return ExportedPrefix(
            handle,
            len(match.block_ids) * self.config.block_size_tokens,
            match.block_ids,
            staging_addr=region.addr if region is not None else 0,
            staging_nbytes=region.nbytes if region is not None else 0,
        )

    def release_export(self, handle: str) -> None:
        """Unpin an export's blocks and free its staging region (its reader must be done with both)."""
        entry = self._exports.pop(handle, None)
        if entry is None:
            raise RequestError(f"unknown export handle {handle!r}")
        node, region = entry
        if self.cache is not None:
            self.cache.unlock(node)
        if region is not None and self.staging is not None:
            self.staging.release(region)
        self._stalled = False

    def import_exported(
        self,
        token_ids: Sequence[int],
        export: ExportedPrefix,
        remote: KVLayout,
        read: Callable[[list[int], list[int], list[int]], int],
    ) -> tuple[int, int]:
        """Import the prefix a peer engine exported, moving its bytes with `read`; returns (tokens, bytes moved).

        `token_ids` are the exported tokens (len == export.num_tokens); `remote` is the exporter's layout;
        `read(local_addrs, remote_addrs, sizes)` copies the peer's ranges into ours and returns the bytes moved
        (e.g. `functools.partial(TransferAgent.read, agent, peer)`; our pool and staging buffer must be registered
        with it). A staged export whose region fits in our staging buffer moves with one entry into it and is then
        scattered into the new blocks; otherwise every (layer, K/V, block run) is its own entry, straight into the
        pool. If `read` fails, the blocks are freed and the error propagates; the staging region it was filling is
        quarantined unless the error's `unsafe_ranges` is present and empty (nothing can still arrive).
        """
        ids = self._check_ids(token_ids)
        local = self.kv_layout()
        if not local.compatible_with(remote):
            raise RequestError(f"incompatible KV layouts: local {local}, exported {remote}")
        blocks = len(export.block_ids)
        if blocks * local.block_size_tokens != export.num_tokens or len(ids) != export.num_tokens:
            raise RequestError(
                f"export covers {export.num_tokens} tokens with {blocks} blocks of {local.block_size_tokens}; "
                f"{len(ids)} tokens given"
            )
        entry_nbytes = local.num_layers * 2 * local.block_nbytes
        if export.staging_addr and export.staging_nbytes != blocks * entry_nbytes:
            raise RequestError(
                f"export stages {export.staging_nbytes} bytes for {blocks} blocks; expected {blocks * entry_nbytes}"
            )
        moved = 0

        def fill(dest: list[int]) -> None:
            nonlocal moved
            pool, staging = self.pool, self.staging
            assert pool is not None and len(dest) == blocks  # import_prefix allocates one block per exported block
            region = staging.reserve(blocks) if export.staging_addr and staging is not None else None
            if region is None:
                remote_addrs = remote.block_addrs(export.block_ids)
                moved += read(local.block_addrs(dest), remote_addrs, [local.block_nbytes] * len(remote_addrs))
                return
            assert staging is not None
            try:
                try:
                    moved += read([region.addr], [export.staging_addr], [region.nbytes])
                except BaseException as error:
                    if getattr(error, "unsafe_ranges", None) != ():
                        staging.quarantine(region)  # bytes of the failed read may still land in it
                        log.warning("staging_region_quarantined_after_a_failed_read", blocks=blocks)
                    raise
                staging.scatter(region, pool, dest)
            finally:
                staging.release(region)

        tokens = self._import_checked(ids, fill)
        return tokens, moved

    def import_prefix(self, token_ids: Sequence[int], fill: Callable[[list[int]], None]) -> int:
        """Cache the KV of `token_ids`' full blocks, written by `fill` into freshly allocated blocks.

        `fill(dest_block_ids)` must write block i of the prefix (tokens [i*bs, (i+1)*bs)) into dest_block_ids[i],
        for every full block of `token_ids`, e.g. by reading the exporter's blocks with `KVLayout.block_addrs`.
        Returns the tokens imported: 0 when the cache already held the whole prefix (fill is not called).
        If fill raises, the blocks are freed and the error propagates.
        """
        return self._import_checked(self._check_ids(token_ids), fill)

    def _import_checked(self, ids: list[int], fill: Callable[[list[int]], None]) -> int:
        pool, cache = self._require_pool()
        if len(ids) > self.config.max_context_tokens:
            raise RequestError(f"{len(ids)} tokens exceed max_context_tokens {self.config.max_context_tokens}")
        size = self.config.block_size_tokens
        full = len(ids) // size
        if full == 0 or len(cache.match_prefix(ids).block_ids) == full:
            return 0
        if not self._make_room(full):
            raise RequestError(f"no room for {full} KV blocks now; retry when requests finish")
        # Any free blocks will do; in ascending order they form runs that fill writes with few large copies.
        blocks = sorted(pool.alloc(full))
        try:
            fill(list(blocks))
            cache.insert(ids, blocks)
        finally:
            pool.decref(blocks)
        self._stalled = False
        return full * size

    def kv_layout(self) -> KVLayout:
        pool, _ = self._require_pool()
        return pool.layout()

    # ---- statistics ---------------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        prompt = self._counters["prompt_tokens"]
        cached = self._counters["cached_tokens"]
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            paused=self._paused,
            free_blocks=self.pool.num_free if self.pool is not None else 0,
            total_blocks=self.config.num_blocks,
            cached_blocks=self.cache.num_cached_blocks if self.cache is not None else 0,
            cached_tokens_total=cached,
            prompt_tokens_total=prompt,
            generated_tokens_total=self._counters["generated_tokens"],
            prefix_hit_rate=cached / prompt if prompt else 0.0,
            weight_version=self.weight_version,
            steps=self._counters["steps"],
            retractions=self._counters["retractions"],
            exports=len(self._exports),
            memory_released=tuple(sorted(self._released)),
        )
