"""`gyre bench xlong`: million-token executions through the real proxy, event log, trajectory tree and processor.

A scripted agent drives the real proxy application (HTTP, OpenAI API, sessions, rendering, id reuse, records)
over a zero-latency scripted backend for the long contexts (the model server is the outer edge faked; the embedded
engine cannot run a 128K context here), and over the embedded engine on the tiny model for a short one
(`engine_execution`: real sampled ids, log-probs and id reuse of what a model wrote, contexts to ~3K tokens, a
proxy whose max_context_tokens is the engine's). Executions (defaults): one of 400 calls whose main context grows
to ~128K tokens and is compressed (a summary call, then a fresh history) each time it would pass it, with sub-agents
(their own system prompt, X-Gyre-Agent) every 25 main turns, ~1M unique tokens in all; one of 50 calls that stays
under 40K; the engine's, 24 calls to ~3K tokens with one compression and sub-agents every 8 turns. Each record is
encoded as the bus encodes it (the real codec, an EVENT envelope) and appended to a real event log.

Figures, and the same for whole-prompt records (each call's full prompt_ids, as before issue 29) as the baseline in
the same run:
- `bus_bytes_per_unique_token`, `log_bytes_per_unique_token`: bytes of the records (bus frames; log file) over the
  distinct token positions of the executions' trees.
- `proxy_overhead_p50_ms_at_1k` / `_at_128k`: the proxy's own time per call (its HTTP handler, body read and JSON
  parse included, minus the backend's time), over probe calls that add the same few tokens to a ~1K and to a
  ~128K-token conversation, taken in turn so that the machine's other load weighs on both alike; `call_p50_ms_*`
  is what the client saw (its own JSON encoding included). `..._at_128k_many_messages`: the same at ~128K in ~1000
  messages of ~250 tokens (per-message costs show there).
- `prompt_ids_carried` against `prompt_tokens_sent`; `records_with_whole_prompt` (first calls of a conversation
  with a system part of its own: each execution's first, each sub-agent's) and `records_branching` (a fresh
  history after a compression, which shares the system part).
- `builder_peak_rss_mb`: resident memory the trajectory trees add in a fresh process that reads the event log
  and adds every record (what the builder's handler does), and `builder_add_s`; `processor_s` for the group's
  samples (`build_group_samples` with the ranked processor, what the builder runs) and per million unique tokens.
- `samples_equal`: the samples from incremental records equal those from whole-prompt records.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing
import os
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from gyre.actors.serving.backends import BackendRequest, BackendResult
from gyre.actors.serving.http_app import AGENT_HEADER, CALL_HEADER, ProxyHttpConfig, build_proxy_app
from gyre.actors.serving.sessions import ProxySessions, ProxySessionsConfig
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.samples import ExecutionScored
from gyre.policies.trajectory_processor import RankedTrajectoryProcessor, build_group_samples
from gyre.policies.trajectory_tree import PromptRebuilder, TrajectoryTree, TreeConfig
from gyre.runtime.codec import Codec
from gyre.runtime.envelope import Envelope, Kind
from gyre.runtime.event_log import EventLogWriter, read_log

__all__ = ["XlongConfig", "ExecutionShape", "run_xlong_bench", "register"]

TARGET_BYTES_PER_TOKEN = 16.0
TARGET_OVERHEAD_RATIO = 2.0
TARGET_BUILDER_MB = 100.0
TARGET_PROCESS_S = 2.0
_WORDS = ("file", "def", "return", "self", "import", "value", "error", "test", "path", "config", "data", "list",
          "for", "if", "None", "print", "class", "yield", "open", "line")


@attrs.frozen
class ExecutionShape:
    """One scripted execution."""

    calls: int
    """Model calls it makes in all (main turns, summaries, sub-agent turns)."""
    tool_tokens: int
    """About how many tokens each main tool result adds."""
    context_limit_tokens: int = 128 * 1024
    """The main agent compresses when its next prompt would pass this."""
    sub_agent_every: int = 25
    """Main turns between sub-agents (0: none)."""
    sub_agent_calls: int = 4
    sub_agent_tool_tokens: int = 1500


ENGINE_EXECUTION = ExecutionShape(24, 150, context_limit_tokens=3072, sub_agent_every=8, sub_agent_calls=2,
                                  sub_agent_tool_tokens=100)
"""The default short execution over the embedded engine."""


@attrs.frozen
class XlongConfig:
    executions: tuple[ExecutionShape, ...] = (ExecutionShape(400, 2400), ExecutionShape(50, 600))
    output_tokens: int = 48
    """About how many tokens each answer has."""
    probe_calls: int = 60
    """Calls measured at ~1K and at ~128K context, in turn (after 5 unmeasured ones each)."""
    probe_tool_tokens: int = 64
    probe_context_tokens: int = 128 * 1024
    probe_many_message_tokens: int = 250
    """A third probe at ~128K grows its conversation in messages of this many tokens (~1000 messages, where the
    other has ~40 of 8K): what costs per message shows there (0: no such probe)."""
    seed: int = 0
    engine_execution: ExecutionShape | None = ENGINE_EXECUTION
    """An execution driven over the embedded engine on the tiny model (None: none)."""
    engine_context_tokens: int = 4096
    """The embedded engine's max_context_tokens, and its proxy's."""
    engine_output_tokens: int = 24
    """max_tokens of each call to the engine (a random model rarely stops by itself)."""


class ZeroLatencyBackend:
    """Answers at once with ids drawn from the request id (the same call gets the same answer): a short text and
    the turn's end token, log-probs and a weight version per 25 calls. Times itself (it is part of each call)."""

    def __init__(self, template: Any, output_tokens: int) -> None:
        self.template = template
        self.output_tokens = output_tokens
        self.last_s = 0.0

    async def generate(self, request: BackendRequest) -> BackendResult:
        start = time.perf_counter()
        seed = int.from_bytes(hashlib.sha256(request.rid.encode()).digest()[:8], "little")
        rng = random.Random(seed)
        text = " ".join(f"{rng.choice(_WORDS)}{rng.randrange(100)}" for _ in range(max(1, self.output_tokens // 3)))
        ids = tuple(self.template.encode(text)) + (self.template.stop_token_ids[0],)
        index = int(request.rid.rsplit("/", 1)[-1])
        result = BackendResult(ids, tuple(-0.05 * (1 + k % 7) for k in range(len(ids))), (index // 25,) * len(ids),
                               "stop", 0, "scripted")
        self.last_s = time.perf_counter() - start
        return result


class _Recorder:
    """The proxy's on_call_completed: encodes each record as the bus does and appends it to an event log."""

    def __init__(self, log_path: Path) -> None:
        self.codec = Codec()
        self.writer = EventLogWriter(log_path)
        self.records: list[ModelCallCompleted] = []
        self.bus_bytes = 0
        self._seq = 0

    def frame(self, message: ModelCallCompleted) -> tuple[bytes, bytes]:
        self._seq += 1
        envelope = Envelope(msg_id=self._seq, sender="proxy", receiver="", topic="gyre.model_calls",
                            time_s=float(self._seq), correlation_id=0, causation_id=0, kind=Kind.EVENT)
        return self.codec.encode(envelope, message)

    def __call__(self, message: ModelCallCompleted) -> None:
        header, body = self.frame(message)
        self.bus_bytes += len(header) + len(body)
        if message.group_id != "probe":  # the probes are timed like the rest, but not part of the executions
            self.writer.append(float(self._seq), header, body)
            self.records.append(message)


def _text(rng: random.Random, tokens: int) -> str:
    return " ".join(f"{rng.choice(_WORDS)}{rng.randrange(100)}" for _ in range(max(1, tokens // 3)))


class _Agent:
    """Talks to the proxy over HTTP as an OpenAI client would, sending its whole conversation every call."""

    def __init__(self, http: Any, base_url: str, key: str, rng: random.Random, timing: dict[str, float],
                 backend: ZeroLatencyBackend) -> None:
        self.http, self.url, self.key, self.rng = http, base_url + "/v1/chat/completions", key, rng
        self.timing, self.backend = timing, backend
        self.max_tokens = 256
        self.calls = 0
        self.samples: list[tuple[int, float, float]] = []  # (prompt tokens, client s, proxy overhead s)

    async def call(self, messages: list[dict[str, Any]], agent: str = "main", kind: str = "turn") -> tuple[str, int]:
        body = {"model": "gyre", "messages": messages, "max_tokens": self.max_tokens, "temperature": 1.0}
        headers = {"Authorization": f"Bearer {self.key}", AGENT_HEADER: agent, CALL_HEADER: kind}
        start = time.perf_counter()
        async with self.http.post(self.url, json=body, headers=headers) as response:
            answer = await response.json()
        elapsed = time.perf_counter() - start
        if response.status != 200:
            raise RuntimeError(f"xlong call failed: {response.status} {answer}")
        self.calls += 1
        used = answer["usage"]
        overhead = self.timing["handler_s"] - self.backend.last_s
        self.samples.append((int(used["prompt_tokens"]), elapsed, overhead))
        return answer["choices"][0]["message"]["content"], int(used["prompt_tokens"]) + int(used["completion_tokens"])

    async def run(self, shape: ExecutionShape) -> None:
        rng = self.rng
        system = "You are a careful coding agent. " + _text(rng, 400)
        task = {"role": "user", "content": "Task: " + _text(rng, 200)}
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}, task]
        context = 0
        turn = 0
        while self.calls < shape.calls:
            if context + shape.tool_tokens + 200 > shape.context_limit_tokens:
                summary, _ = await self.call([*messages, {"role": "user", "content": "Summarise the work so far."}],
                                             kind="summary")
                messages = [{"role": "system", "content": system},
                            {"role": "user", "content": task["content"] + "\nSummary so far: " + summary}]
                context = 0  # a fresh, short history
                continue
            content, context = await self.call(messages)
            messages.append({"role": "assistant", "content": content})
            turn += 1
            if shape.sub_agent_every and turn % shape.sub_agent_every == 0:
                result = await self._sub_agent(shape, turn)
            else:
                result = _text(rng, shape.tool_tokens)
            messages.append({"role": "user", "content": "Tool result:\n" + result})

    async def _sub_agent(self, shape: ExecutionShape, turn: int) -> str:
        rng = self.rng
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a sub-agent that explores one question. " + _text(rng, 200)},
            {"role": "user", "content": f"Question {turn}: " + _text(rng, 100)},
        ]
        content = ""
        for _ in range(shape.sub_agent_calls):
            if self.calls >= shape.calls:
                break
            content, _ = await self.call(messages, agent=f"sub-{turn}")
            messages += [{"role": "assistant", "content": content},
                         {"role": "user", "content": _text(rng, shape.sub_agent_tool_tokens)}]
        return content

    async def grow(self, context_tokens: int, message_tokens: int = 8000) -> list[dict[str, Any]]:
        """A conversation grown to about `context_tokens` in user messages of up to `message_tokens` (unmeasured
        calls)."""
        rng = self.rng
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a probe. " + _text(rng, 300)}]
        context = 0
        while context < context_tokens - 1500:
            messages.append({"role": "user", "content": _text(rng, min(message_tokens,
                                                                        context_tokens - 1000 - context))})
            content, context = await self.call(messages)
            messages.append({"role": "assistant", "content": content})
        return messages

    async def step(self, messages: list[dict[str, Any]], tool_tokens: int) -> tuple[int, float, float]:
        """One call that adds `tool_tokens` to the conversation; its (prompt tokens, client s, proxy s)."""
        messages.append({"role": "user", "content": _text(self.rng, tool_tokens)})
        content, _ = await self.call(messages)
        messages.append({"role": "assistant", "content": content})
        return self.samples[-1]


async def _probe(agents: dict[str, _Agent], contexts: dict[str, tuple[int, int]], calls: int, tool_tokens: int
                 ) -> dict[str, list[tuple[int, float, float]]]:
    """Calls at each context in turn (1K, 128K, 1K, ...), so that whatever else the machine does weighs on both
    alike; the first 5 of each are not measured."""
    conversations = {name: await agents[name].grow(*contexts[name]) for name in agents}
    measured: dict[str, list[tuple[int, float, float]]] = {name: [] for name in agents}
    for i in range(calls + 5):
        for name, agent in agents.items():
            sample = await agent.step(conversations[name], tool_tokens)
            if i >= 5:
                measured[name].append(sample)
    return measured


async def _serve(app: Any) -> tuple[Any, str]:
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _drive_engine(config: XlongConfig, template: Any, model_dir: Path, recorder: _Recorder,
                        http: Any, rng: random.Random) -> dict[str, Any]:
    """The short execution over the embedded engine: its own proxy app (same recorder), the engine's context."""
    from gyre.actors.serving.backends import EmbeddedBackend
    from gyre.engines.async_engine import AsyncEngine
    from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig

    assert config.engine_execution is not None
    context = config.engine_context_tokens
    engine_config = EngineConfig(num_blocks=2 * -(-context // 16) + 16, max_context_tokens=context,
                                 max_prefill_tokens=min(2048, context), num_threads=1)
    engine = AsyncEngine(EmbeddedEngine(model_dir, engine_config))
    sessions = ProxySessions(template, ProxySessionsConfig(max_executions=4))
    app = build_proxy_app(ProxyHttpConfig(max_context_tokens=context), sessions, EmbeddedBackend(engine, "tiny"),
                          recorder, clock=time.monotonic)
    runner, base_url = await _serve(app)
    started = time.perf_counter()
    try:
        agent = _Agent(http, base_url, sessions.issue_key("engine-0", "xlong"), rng, {"handler_s": 0.0},
                       ZeroLatencyBackend(template, 0))
        agent.max_tokens = config.engine_output_tokens
        await agent.run(config.engine_execution)
    finally:
        await runner.cleanup()
        await engine.close()
    return {"calls": agent.calls, "drive_s": round(time.perf_counter() - started, 1)}


async def _drive(config: XlongConfig, template: Any, log_path: Path, model_dir: Path | None) -> dict[str, Any]:
    import aiohttp
    from aiohttp import web

    recorder = _Recorder(log_path)
    backend = ZeroLatencyBackend(template, config.output_tokens)
    sessions = ProxySessions(template, ProxySessionsConfig(max_executions=16))
    http_config = ProxyHttpConfig(max_context_tokens=256 * 1024, max_body_bytes=256 * 2**20,
                                  max_json_string_chars=16 * 2**20, body_read_timeout_s=120.0)
    app = build_proxy_app(http_config, sessions, backend, recorder, clock=time.monotonic)
    timing = {"handler_s": 0.0}

    @web.middleware
    async def timed(request: Any, handler: Any) -> Any:
        start = time.perf_counter()
        try:
            return await handler(request)
        finally:
            timing["handler_s"] = time.perf_counter() - start

    app.middlewares.insert(0, timed)
    runner, base_url = await _serve(app)
    rng = random.Random(config.seed)
    out: dict[str, Any] = {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            started = time.perf_counter()
            for index, shape in enumerate(config.executions):
                key = sessions.issue_key(f"x{index}", "xlong")
                await _Agent(http, base_url, key, rng, timing, backend).run(shape)
            out["drive_s"] = time.perf_counter() - started
            if model_dir is not None:
                out["engine"] = await _drive_engine(config, template, model_dir, recorder, http, rng)
            contexts = {"1k": (1024, 8000), "128k": (config.probe_context_tokens, 8000)}
            if config.probe_many_message_tokens:
                contexts["128k_many"] = (config.probe_context_tokens, config.probe_many_message_tokens)
            agents = {name: _Agent(http, base_url, sessions.issue_key(f"probe-{name}", "probe"), rng, timing, backend)
                      for name in contexts}
            out["probes"] = await _probe(agents, contexts, config.probe_calls, config.probe_tool_tokens)
    finally:
        await runner.cleanup()
        recorder.writer.close()
    out["records"] = recorder.records
    out["bus_bytes"] = sum(len(h) + len(b) for h, b in map(recorder.frame, out["records"]))
    return out


def _whole_records(records: list[ModelCallCompleted], log_path: Path) -> int:
    """Write the baseline log (each record with its whole prompt) and return the bus bytes of its frames."""
    rebuilder = PromptRebuilder(TreeConfig(max_calls=1 << 16, max_stored_tokens=1 << 26))
    recorder = _Recorder(log_path)
    try:
        for record in records:
            rebuilder.add(record)
            prompt = rebuilder.prompt_ids(record)
            recorder(attrs.evolve(record, extends_call=-1, shared_tokens=0, new_prompt_ids=prompt))
            recorder.records.clear()
    finally:
        recorder.writer.close()
    return recorder.bus_bytes


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _build_from_log(log_path: str) -> dict[str, Any]:
    """In a fresh process: read the log, add every record to its execution's tree, build the group's samples."""
    import gc

    codec = Codec()
    gc.collect()
    before = _rss_mb()
    trees: dict[str, TrajectoryTree] = {}
    config = TreeConfig(max_calls=1 << 16, max_stored_tokens=1 << 26)
    started = time.perf_counter()
    decode_s = 0.0
    for record in read_log(log_path, codec):
        t = time.perf_counter()
        call = record.decode(codec)
        decode_s += time.perf_counter() - t
        tree = trees.get(call.execution_id)
        if tree is None:
            tree = trees[call.execution_id] = TrajectoryTree(call.execution_id, call.group_id, config)
        tree.add_call(call)
    add_s = time.perf_counter() - started - decode_s
    gc.collect()
    after = _rss_mb()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    scores = [ExecutionScored(e, "xlong", float(i % 2 == 0), False, "") for i, e in enumerate(sorted(trees))]
    started = time.perf_counter()
    landed = build_group_samples("xlong", trees, scores, RankedTrajectoryProcessor())
    process_s = time.perf_counter() - started
    digest = hashlib.sha256(repr(landed.samples).encode()).hexdigest()
    stats = [tree.statistics() for tree in trees.values()]
    return {
        "unique_tokens": sum(s.stored_tokens for s in stats),
        "call_tokens": sum(s.call_tokens for s in stats),
        "calls": sum(s.num_calls for s in stats),
        "pending": sum(t.pending_calls for t in trees.values()),
        "rss_added_mb": round(after - before, 1),
        "peak_rss_mb": round(peak, 1),
        "rss_before_mb": round(before, 1),
        "decode_s": round(decode_s, 3),
        "add_s": round(add_s, 3),
        "process_s": round(process_s, 3),
        "samples": len(landed.samples),
        "sample_tokens": landed.num_tokens,
        "samples_digest": digest,
    }


def _in_fresh_process(log_path: Path) -> dict[str, Any]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_build_from_log, (str(log_path),))


def _many_messages(probes: dict[str, list[tuple[int, float, float]]], at_1k: float) -> dict[str, Any]:
    if "128k_many" not in probes:
        return {}
    at_many = _p50_ms(probes["128k_many"], 2)
    return {"proxy_overhead_p50_ms_at_128k_many_messages": at_many,
            "proxy_overhead_ratio_128k_many_messages_to_1k": round(at_many / at_1k, 2),
            "probe_many_messages_prompt_tokens": probes["128k_many"][0][0]}


def _p50_ms(samples: list[tuple[int, float, float]], which: int) -> float:
    return round(statistics.median(s[which] for s in samples) * 1e3, 3)


def run_xlong_bench(config: XlongConfig = XlongConfig()) -> dict[str, Any]:
    from gyre.engines.chat_template import ChatTemplate
    from gyre.engines.model_format import init_model_dir

    with tempfile.TemporaryDirectory(prefix="gyre-xlong-") as tmp:
        root = Path(tmp)
        init_model_dir(root / "model", "tiny", seed=config.seed)  # the tokenizer, and the engine's weights
        template = ChatTemplate.from_model_dir(root / "model")
        engine_model = root / "model" if config.engine_execution is not None else None
        driven = asyncio.run(_drive(config, template, root / "incremental.glog", engine_model))
        records = driven["records"]
        whole_bus = _whole_records(records, root / "whole.glog")
        incremental = _in_fresh_process(root / "incremental.glog")
        whole = _in_fresh_process(root / "whole.glog")
        log_bytes = (root / "incremental.glog").stat().st_size
        whole_log_bytes = (root / "whole.glog").stat().st_size
    unique = incremental["unique_tokens"]
    probes = driven["probes"]
    at_1k, at_128k = _p50_ms(probes["1k"], 2), _p50_ms(probes["128k"], 2)
    path_tokens = {(r.execution_id, r.call_index): r.prompt_tokens + len(r.output_ids) for r in records}
    per_execution = {}
    for record in records:
        entry = per_execution.setdefault(record.execution_id, {"calls": 0, "max_prompt_tokens": 0, "summaries": 0,
                                                                "sub_agent_calls": 0})
        entry["calls"] += 1
        entry["max_prompt_tokens"] = max(entry["max_prompt_tokens"], record.prompt_tokens)
        entry["summaries"] += record.call_kind == "summary"
        entry["sub_agent_calls"] += record.agent_id.startswith("sub-")
    result = {
        "executions": per_execution,
        "calls": len(records),
        "unique_tokens": unique,
        "prompt_tokens_sent": sum(r.prompt_tokens for r in records),
        "prompt_ids_carried": sum(len(r.new_prompt_ids) for r in records),
        "records_with_whole_prompt": sum(r.extends_call < 0 for r in records),
        "records_branching": sum(r.extends_call >= 0 and r.shared_tokens < path_tokens[(r.execution_id, r.extends_call)]
                                 for r in records),
        "bus_bytes_per_unique_token": round(driven["bus_bytes"] / unique, 2),
        "log_bytes_per_unique_token": round(log_bytes / unique, 2),
        "builder_peak_rss_mb": incremental["rss_added_mb"],
        "builder_process_peak_rss_mb": incremental["peak_rss_mb"],
        "builder_add_s": incremental["add_s"],
        "decode_s": incremental["decode_s"],
        "processor_s": incremental["process_s"],
        "processor_s_per_million_tokens": round(incremental["process_s"] / (unique / 1e6), 3),
        "proxy_overhead_p50_ms_at_1k": at_1k,
        "proxy_overhead_p50_ms_at_128k": at_128k,
        "proxy_overhead_ratio_128k_to_1k": round(at_128k / at_1k, 2),
        "call_p50_ms_at_1k": _p50_ms(probes["1k"], 1),
        "call_p50_ms_at_128k": _p50_ms(probes["128k"], 1),
        "probe_prompt_tokens": [probes["1k"][0][0], probes["128k"][0][0]],
        **_many_messages(probes, at_1k),
        "samples": incremental["samples"],
        "sample_tokens": incremental["sample_tokens"],
        "samples_equal": incremental["samples_digest"] == whole["samples_digest"],
        "pending_calls": incremental["pending"],
        "drive_s": round(driven["drive_s"], 1),
        "engine_execution": driven.get("engine"),
        "baseline_whole_prompt_records": {
            "bus_bytes_per_unique_token": round(whole_bus / unique, 2),
            "log_bytes_per_unique_token": round(whole_log_bytes / unique, 2),
            "builder_peak_rss_mb": whole["rss_added_mb"],
            "builder_add_s": whole["add_s"],
            "decode_s": whole["decode_s"],
            "processor_s": whole["process_s"],
        },
    }
    result["bus_bytes_reduction"] = round(whole_bus / driven["bus_bytes"], 1)
    result["targets"] = {
        "bytes_per_unique_token_max": TARGET_BYTES_PER_TOKEN,
        "overhead_ratio_max": TARGET_OVERHEAD_RATIO,
        "builder_mb_max": TARGET_BUILDER_MB,
        "processor_s_max": TARGET_PROCESS_S,
    }
    result["targets_met"] = {
        "bus_bytes": result["bus_bytes_per_unique_token"] <= TARGET_BYTES_PER_TOKEN,
        "log_bytes": result["log_bytes_per_unique_token"] <= TARGET_BYTES_PER_TOKEN,
        "proxy_overhead_ratio": result["proxy_overhead_ratio_128k_to_1k"] <= TARGET_OVERHEAD_RATIO,
        "builder_memory": result["builder_peak_rss_mb"] <= TARGET_BUILDER_MB,
        "processor_time": result["processor_s"] <= TARGET_PROCESS_S,
    }
    return result


def _handle(args: argparse.Namespace) -> int:
    from gyre.runtime.logs import configure_logging

    configure_logging("warning")  # here, not in run_xlong_bench: a library call leaves the process's logging alone
    shapes = (ExecutionShape(args.calls, args.tool_tokens, context_limit_tokens=args.context_limit_tokens),
              ExecutionShape(50, 600))
    engine = attrs.evolve(ENGINE_EXECUTION, calls=args.engine_calls) if args.engine_calls else None
    config = XlongConfig(executions=shapes, probe_calls=args.probe_calls, probe_context_tokens=args.probe_context,
                         seed=args.seed, engine_execution=engine)
    result = run_xlong_bench(config)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        base = result["baseline_whole_prompt_records"]
        print(f"xlong: {result['calls']} calls, {result['unique_tokens']:,} unique tokens, "
              f"{result['prompt_tokens_sent']:,} prompt tokens sent")
        print(f"  bus bytes/unique token {result['bus_bytes_per_unique_token']} (whole prompts "
              f"{base['bus_bytes_per_unique_token']}), log {result['log_bytes_per_unique_token']} "
              f"({base['log_bytes_per_unique_token']})")
        print(f"  proxy overhead p50 {result['proxy_overhead_p50_ms_at_1k']} ms at 1K, "
              f"{result['proxy_overhead_p50_ms_at_128k']} ms at 128K"
              + (f", {result['proxy_overhead_p50_ms_at_128k_many_messages']} ms at 128K in messages of ~250 tokens"
                 if "proxy_overhead_p50_ms_at_128k_many_messages" in result else ""))
        if result["engine_execution"]:
            print(f"  embedded engine: {result['engine_execution']['calls']} calls in "
                  f"{result['engine_execution']['drive_s']} s")
        print(f"  builder +{result['builder_peak_rss_mb']} MB, add {result['builder_add_s']} s, "
              f"process {result['processor_s']} s; samples equal: {result['samples_equal']}")
    return 0 if result["samples_equal"] and not result["pending_calls"] else 1


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("xlong", help="bytes, memory and time per call of million-token executions")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--calls", type=_positive, default=400, help="calls of the long execution (default 400)")
    p.add_argument("--tool-tokens", type=_positive, default=2400, help="tokens per tool result (default 2400)")
    p.add_argument("--context-limit-tokens", type=_positive, default=128 * 1024,
                   help="the long execution compresses past this context (default 131072)")
    p.add_argument("--probe-calls", type=_positive, default=60, help="measured calls per probe (default 60)")
    p.add_argument("--probe-context", type=_positive, default=128 * 1024,
                   help="context of the long probe, tokens (default 131072)")
    p.add_argument("--engine-calls", type=int, default=24,
                   help="calls of the short execution over the embedded engine on the tiny model (0: none; default 24)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_handle)

