"""`gyre bench engine`: what the embedded engine buys on an agent-like workload, measured in one run.

The workload is what Gyre's rollouts look like: many sessions that share a system prompt, each turn appending a tool
observation to its history and generating a reply. The same sessions run on
- the embedded engine (continuous batching over all sessions, radix prefix cache: a turn computes only its new
  observation), and
- transformers' `generate` on the same model directory (batched with left padding, re-prefilling every history each
  turn, which is what a plain `generate` loop does),
with greedy decoding and `ignore_eos`/`min_new_tokens` so both generate exactly the same number of tokens. The two
backends take turns (embedded, transformers, embedded, ...) for `backend_repeats` passes each, so that load drifting
on a shared machine falls on both alike; tokens/s are medians over passes and the speedup is the median of the
ratios of passes run back to back.

It also measures moving the sessions' KV cache from one engine to another through Mooncake (export, read the
blocks, import into the peer's radix cache) against Mooncake's raw loopback bandwidth for the same bytes in one
contiguous read, and the trainer's forward+backward throughput on the sessions' final histories. The two engines
of the KV move live in this process, each with its own Mooncake agent, talking TCP over loopback as two processes
would. Each session's export is gathered into the exporter's staging buffer and read with one entry (a per-block
read would pay Mooncake's ~100 us per TCP entry for every 4 KiB block of the tiny model); `kv_entries_sent`
shows how many entries the move took.

Wall-clock timing is fine here: this is a benchmark, not an actor.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import structlog

log = structlog.get_logger(__name__)


@attrs.frozen
class EngineBenchConfig:
    """Shape of the workload and of the measurements."""

    sessions: int = 8
    """Concurrent agent sessions."""
    turns: int = 6
    """Model calls per session."""
    system_tokens: int = 256
    """Shared system prompt (tool descriptions) length; every session starts with it."""
    task_tokens: int = 64
    """Per-session task description after the system prompt."""
    observation_tokens_min: int = 32
    """Shortest tool observation appended before a turn (drawn uniformly per session and turn)."""
    observation_tokens_max: int = 128
    """Longest tool observation."""
    output_tokens: int = 32
    """Tokens generated per turn, exactly (greedy, end-of-sequence ignored)."""
    seed: int = 0
    threads: int = 1
    """torch intra-op threads for every backend. 1 by default: on a shared 2-core machine a second thread makes
    every small op wait at a barrier for a descheduled peer (transformers fell from 48 to 3 tokens/s that way)."""
    backend_repeats: int = 3
    """Timed passes over the workload per backend, alternating between the two (medians are reported)."""
    kv_repeats: int = 5
    """Repetitions of the KV move, each followed by the raw read of the same bytes (medians are reported)."""
    trainer_steps: int = 3
    """Timed forward+backward passes (after one warm-up)."""
    preset: str = "tiny"

    def __attrs_post_init__(self) -> None:
        for name in ("sessions", "turns", "output_tokens", "threads", "backend_repeats", "kv_repeats", "trainer_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.observation_tokens_min <= self.observation_tokens_max:
            raise ValueError("need 1 <= observation_tokens_min <= observation_tokens_max")
        if self.system_tokens < 1 or self.task_tokens < 0:
            raise ValueError("system_tokens must be >= 1 and task_tokens >= 0")


@attrs.frozen
class Workload:
    """Token ids of every session's prefix and of every (session, turn) observation, drawn from the seed."""

    prefixes: tuple[tuple[int, ...], ...]
    observations: tuple[tuple[tuple[int, ...], ...], ...]
    """observations[s][t] is appended to session s before turn t (turn 0's is its first user message)."""


def build_workload(config: EngineBenchConfig, vocab_size: int) -> Workload:
    """Random ordinary token ids below the special tokens (the tiny model's specials sit at the top of its vocab)."""
    rng = random.Random(config.seed)
    top = max(2, vocab_size - 64)
    draw = lambda n: tuple(rng.randrange(1, top) for _ in range(n))  # noqa: E731
    system = draw(config.system_tokens)
    prefixes = tuple(system + draw(config.task_tokens) for _ in range(config.sessions))
    observations = tuple(
        tuple(
            draw(rng.randint(config.observation_tokens_min, config.observation_tokens_max))
            for _ in range(config.turns)
        )
        for _ in range(config.sessions)
    )
    return Workload(prefixes, observations)


@attrs.frozen
class BackendRun:
    """One backend's pass over the workload."""

    output_tokens: int
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    outputs: tuple[tuple[tuple[int, ...], ...], ...]
    """outputs[s][t]: the ids generated for session s at turn t."""
    histories: tuple[tuple[int, ...], ...]
    """Each session's final history (prompt of the last turn plus its output)."""


def run_embedded(engine: Any, config: EngineBenchConfig, workload: Workload) -> BackendRun:
    """All sessions' turn t go in together; the engine batches them and reuses each session's cached history."""
    from gyre.engines.embedded_engine import SamplingParams

    params = SamplingParams(max_new_tokens=config.output_tokens, temperature=0.0, ignore_eos=True)
    # Warm-up outside the timed loop (first-call allocations), then an empty cache for the workload.
    engine.submit("warm-up", [1] * 16, SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    if not engine.flush_cache():
        raise RuntimeError("engine refused to flush its cache after the warm-up")
    histories = [list(p) for p in workload.prefixes]
    outputs: list[list[tuple[int, ...]]] = [[] for _ in histories]
    prompt_tokens = cached_tokens = generated = 0
    start = time.perf_counter()
    for turn in range(config.turns):
        for s, history in enumerate(histories):
            history.extend(workload.observations[s][turn])
            engine.submit(f"s{s}-t{turn}", history, params, return_logprob=True)
        done: dict[str, Any] = {}
        while engine.has_work():
            for event in engine.step():
                if event.finished is not None:
                    done[event.rid] = event.finished
        for s, history in enumerate(histories):
            out = done[f"s{s}-t{turn}"]
            if out.finish_reason != "length" or len(out.output_ids) != config.output_tokens:
                raise RuntimeError(f"embedded engine ended s{s}-t{turn} early: {out.finish_reason}")
            outputs[s].append(tuple(out.output_ids))
            history.extend(out.output_ids)
            prompt_tokens += out.prompt_tokens
            cached_tokens += out.cached_tokens
            generated += len(out.output_ids)
    seconds = time.perf_counter() - start
    return BackendRun(
        generated, seconds, prompt_tokens, cached_tokens,
        tuple(tuple(o) for o in outputs), tuple(tuple(h) for h in histories),
    )


def load_transformers(model_dir: Path) -> Any:
    """transformers' Qwen3ForCausalLM for the directory, in fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def run_transformers(model: Any, config: EngineBenchConfig, workload: Workload) -> BackendRun:
    """The same turns through `model.generate`: one left-padded batch per turn, every history prefilled anew."""
    import torch

    with torch.no_grad():  # warm-up outside the timed loop, as the embedded engine gets one
        warm = torch.ones((1, 16), dtype=torch.long)
        model.generate(input_ids=warm, max_new_tokens=2, do_sample=False, pad_token_id=0)
    histories = [list(p) for p in workload.prefixes]
    outputs: list[list[tuple[int, ...]]] = [[] for _ in histories]
    prompt_tokens = generated = 0
    start = time.perf_counter()
    for turn in range(config.turns):
        for s, history in enumerate(histories):
            history.extend(workload.observations[s][turn])
        width = max(len(h) for h in histories)
        ids = torch.zeros((len(histories), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for s, history in enumerate(histories):
            ids[s, width - len(history) :] = torch.tensor(history)
            mask[s, width - len(history) :] = 1
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=config.output_tokens,
                min_new_tokens=config.output_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        new = out[:, width:]
        for s, history in enumerate(histories):
            row = tuple(int(t) for t in new[s])
            if len(row) != config.output_tokens:
                raise RuntimeError(f"transformers generated {len(row)} tokens, expected {config.output_tokens}")
            outputs[s].append(row)
            prompt_tokens += len(history)
            history.extend(row)
            generated += len(row)
    seconds = time.perf_counter() - start
    return BackendRun(
        generated, seconds, prompt_tokens, 0, tuple(tuple(o) for o in outputs), tuple(tuple(h) for h in histories)
    )


@attrs.frozen
class KVMove:
    """Moving every session's cached history from engine A to engine B through Mooncake."""

    nbytes: int
    seconds: float
    """Export + read + import + release for all sessions (median over repeats)."""
    read_seconds: float
    """Time inside Mooncake reads only (median over repeats)."""
    raw_seconds: float
    """One contiguous Mooncake read of `nbytes` between two registered buffers (median over repeats)."""
    ratio: float
    """Median over repeats of raw_seconds / seconds, each raw read timed right after its move (same load)."""
    imported_tokens: int
    verified_cached_tokens: int
    """Prompt tokens engine B served from its cache when asked for the histories after the last import."""
    entries_requested: int
    entries_sent: int


def move_kv(source: Any, model_dir: Path, config: EngineBenchConfig, histories: tuple[tuple[int, ...], ...]) -> KVMove:
    """Export each history's cached blocks from `source`, read them into a second engine, verify it hits."""
    import torch

    from gyre.engines.embedded_engine import EmbeddedEngine, SamplingParams
    from gyre.engines.transfer import TransferAgent

    target = EmbeddedEngine(model_dir, source.config)
    agent_a, agent_b = TransferAgent(), TransferAgent()
    try:
        for engine, agent in ((source, agent_a), (target, agent_b)):  # what the engine server does at start-up
            agent.register_tensor(engine.pool.tensor)
            if engine.staging is not None:
                agent.register_tensor(engine.staging.tensor)
        layout_a = source.kv_layout()
        read_s = 0.0

        def read(local: list[int], remote: list[int], sizes: list[int]) -> int:
            nonlocal read_s
            t0 = time.perf_counter()
            try:
                return agent_b.read(agent_a.peer, local, remote, sizes)
            finally:
                read_s += time.perf_counter() - t0

        # Each move is followed by the raw read of the same byte count (one contiguous read between two registered
        # buffers), so that each pair sees the same load on a shared machine.
        runs: list[tuple[float, float, int, int]] = []
        raw: list[float] = []
        entries_requested = entries_sent = 0
        src = dst = None
        for _ in range(config.kv_repeats):
            if not target.flush_cache():
                raise RuntimeError("target engine refused to flush its cache")
            moved = imported = 0
            read_s = 0.0
            before = agent_b.statistics()
            start = time.perf_counter()
            for history in histories:
                export = source.export_prefix(history)
                try:
                    tokens, nbytes = target.import_exported(history[: export.num_tokens], export, layout_a, read)
                finally:
                    source.release_export(export.handle)
                imported += tokens
                moved += nbytes
            runs.append((time.perf_counter() - start, read_s, moved, imported))
            after = agent_b.statistics()
            entries_requested = after.entries_requested - before.entries_requested
            entries_sent = after.entries_sent - before.entries_sent
            if src is None:
                src = torch.randint(0, 255, (max(moved, 1),), dtype=torch.uint8)
                dst = torch.empty_like(src)
                agent_a.register_tensor(src)
                agent_b.register_tensor(dst)
            t0 = time.perf_counter()
            agent_b.pull_tensor(agent_a.peer, src.data_ptr(), dst)
            raw.append(time.perf_counter() - t0)
        if not torch.equal(src, dst):
            raise RuntimeError("raw Mooncake read returned different bytes")
        nbytes, imported = runs[-1][2], runs[-1][3]

        # Did it work? B must now serve every history from its cache.
        verified = 0
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        for s, history in enumerate(histories):
            target.submit(f"verify-{s}", list(history), params)
        while target.has_work():
            for event in target.step():
                if event.finished is not None:
                    verified += event.finished.cached_tokens
        return KVMove(
            nbytes=nbytes,
            seconds=statistics.median(r[0] for r in runs),
            read_seconds=statistics.median(r[1] for r in runs),
            raw_seconds=statistics.median(raw),
            ratio=statistics.median(r / run[0] for r, run in zip(raw, runs)),
            imported_tokens=imported,
            verified_cached_tokens=verified,
            entries_requested=entries_requested,
            entries_sent=entries_sent,
        )
    finally:
        agent_a.close()
        agent_b.close()


def trainer_throughput(
    model_dir: Path, config: EngineBenchConfig, histories: tuple[tuple[int, ...], ...]
) -> tuple[float, int]:
    """Forward+backward tokens/s of the megatron-core trainer on the final histories (one batch, right-padded)."""
    import torch

    from gyre.engines.trainer import MegatronTrainer, TrainerConfig

    trainer = MegatronTrainer(model_dir, TrainerConfig(num_threads=config.threads, seed=config.seed))
    width = max(len(h) for h in histories)
    ids = torch.zeros((len(histories), width), dtype=torch.long)
    for s, history in enumerate(histories):
        ids[s, : len(history)] = torch.tensor(history)
    lengths = torch.tensor([len(h) for h in histories], dtype=torch.long)
    count = float((lengths - 1).sum())

    def loss_fn(logprobs: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return -logprobs.sum() / count, {}

    trainer.forward_backward(ids, lengths, loss_fn)  # warm-up
    trainer.zero_grads()
    start = time.perf_counter()
    for _ in range(config.trainer_steps):
        trainer.forward_backward(ids, lengths, loss_fn)
    seconds = time.perf_counter() - start
    trainer.zero_grads()
    tokens = int(lengths.sum()) * config.trainer_steps
    return tokens / seconds, int(lengths.sum())


def run_bench(config: EngineBenchConfig, model_dir: Path | None = None) -> dict[str, Any]:
    """Run every measurement once and return the report (the JSON that `--json` prints)."""
    import torch

    from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig
    from gyre.engines.model_format import ModelSpec, init_model_dir

    torch.set_num_threads(config.threads)
    with tempfile.TemporaryDirectory(prefix="gyre-bench-engine-") as tmp:
        if model_dir is None:
            model_dir = init_model_dir(Path(tmp) / "model", preset=config.preset, seed=config.seed)
        spec = ModelSpec.from_model_dir(model_dir)
        workload = build_workload(config, spec.vocab_size)
        longest = max(
            len(p) + sum(len(o) for o in obs) + config.turns * config.output_tokens
            for p, obs in zip(workload.prefixes, workload.observations)
        )
        block = 16
        blocks_per_session = -(-longest // block) + 1
        engine_config = EngineConfig(
            block_size_tokens=block,
            num_blocks=max(256, 2 * config.sessions * blocks_per_session),
            max_running_requests=max(config.sessions, 1),
            max_context_tokens=max(longest + block, 1024),
            num_threads=config.threads,
            seed=config.seed,
        )
        engine = EmbeddedEngine(model_dir, engine_config)
        hf_model = load_transformers(model_dir)
        embedded_runs: list[BackendRun] = []
        hf_runs: list[BackendRun] = []
        for _ in range(config.backend_repeats):
            embedded_runs.append(run_embedded(engine, config, workload))
            hf_runs.append(run_transformers(hf_model, config, workload))
        embedded, hf = embedded_runs[-1], hf_runs[-1]
        if any(r.outputs != embedded.outputs for r in embedded_runs):
            raise RuntimeError("the embedded engine's greedy outputs differ between passes")
        kv = move_kv(engine, model_dir, config, embedded.histories)
        trainer_tps, trainer_batch_tokens = trainer_throughput(model_dir, config, embedded.histories)

    first = [(e[0], h[0]) for e, h in zip(embedded.outputs, hf.outputs)]
    match = sum(a == b for pair in first for a, b in zip(*pair)) / sum(len(p[0]) for p in first)
    embedded_tps = [r.output_tokens / r.seconds for r in embedded_runs]
    hf_tps = [r.output_tokens / r.seconds for r in hf_runs]
    gb = kv.nbytes / 1e9
    return {
        "embedded_tokens_per_s": round(statistics.median(embedded_tps), 1),
        "transformers_tokens_per_s": round(statistics.median(hf_tps), 1),
        "speedup": round(statistics.median(e / h for e, h in zip(embedded_tps, hf_tps)), 2),
        "prefix_hit_rate": round(embedded.cached_tokens / embedded.prompt_tokens, 4),
        "kv_transfer_gb_per_s": round(gb / kv.seconds, 4),
        "kv_read_gb_per_s": round(gb / kv.read_seconds, 4),
        "kv_raw_gb_per_s": round(gb / kv.raw_seconds, 4),
        "kv_transfer_vs_raw": round(kv.ratio, 3),
        "trainer_tokens_per_s": round(trainer_tps, 1),
        "output_tokens": embedded.output_tokens,
        "embedded_seconds": round(statistics.median(r.seconds for r in embedded_runs), 3),
        "transformers_seconds": round(statistics.median(r.seconds for r in hf_runs), 3),
        "embedded_tokens_per_s_runs": [round(v, 1) for v in embedded_tps],
        "transformers_tokens_per_s_runs": [round(v, 1) for v in hf_tps],
        "prompt_tokens": embedded.prompt_tokens,
        "cached_tokens": embedded.cached_tokens,
        "first_turn_greedy_match": round(match, 4),
        "kv_bytes": kv.nbytes,
        "kv_imported_tokens": kv.imported_tokens,
        "kv_verified_cached_tokens": kv.verified_cached_tokens,
        "kv_entries_requested": kv.entries_requested,
        "kv_entries_sent": kv.entries_sent,
        "trainer_batch_tokens": trainer_batch_tokens,
        "config": attrs.asdict(config),
    }


def _handle(args: argparse.Namespace) -> int:
    from gyre.runtime.logs import configure_logging

    configure_logging(level="warning")  # logs go to stderr; stdout carries only the report
    config = EngineBenchConfig(
        sessions=args.sessions,
        turns=args.turns,
        system_tokens=args.system_tokens,
        task_tokens=args.task_tokens,
        observation_tokens_min=args.observation_tokens[0],
        observation_tokens_max=args.observation_tokens[1],
        output_tokens=args.output_tokens,
        seed=args.seed,
        threads=args.threads,
        backend_repeats=args.backend_repeats,
        kv_repeats=args.kv_repeats,
        trainer_steps=args.trainer_steps,
        preset=args.preset,
    )
    report = run_bench(config, Path(args.model_dir) if args.model_dir else None)
    if args.json:
        print(json.dumps(report))
        return 0
    r = report
    lines = [
        f"workload: {config.sessions} sessions x {config.turns} turns, {config.output_tokens} tokens per turn "
        f"({r['output_tokens']} generated per pass, {config.backend_repeats} passes each), model preset "
        f"{config.preset!r}, {config.threads} threads",
        f"embedded engine   {r['embedded_tokens_per_s']:>10.1f} tokens/s  ({r['embedded_seconds']} s)",
        f"transformers      {r['transformers_tokens_per_s']:>10.1f} tokens/s  ({r['transformers_seconds']} s)",
        f"speedup           {r['speedup']:>10.2f} x",
        f"prefix hit rate   {r['prefix_hit_rate']:>10.2%}  "
        f"({r['cached_tokens']} of {r['prompt_tokens']} prompt tokens)",
        f"greedy match      {r['first_turn_greedy_match']:>10.2%}  (first turn, embedded vs transformers)",
        f"KV move           {r['kv_transfer_gb_per_s']:>10.3f} GB/s end to end, {r['kv_read_gb_per_s']:.3f} GB/s "
        f"in reads ({r['kv_bytes']} bytes, {r['kv_entries_requested']} entries -> {r['kv_entries_sent']})",
        f"Mooncake raw      {r['kv_raw_gb_per_s']:>10.3f} GB/s  (same bytes, one contiguous read); KV move at "
        f"{r['kv_transfer_vs_raw']:.2f} x raw (median of paired runs)",
        f"trainer fwd+bwd   {r['trainer_tokens_per_s']:>10.1f} tokens/s  "
        f"({r['trainer_batch_tokens']} tokens per batch)",
    ]
    print("\n".join(lines))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    defaults = EngineBenchConfig()
    p = subparsers.add_parser(
        "engine",
        help="embedded engine vs transformers on a multi-turn agent workload; KV moves; trainer throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--sessions", type=int, default=defaults.sessions)
    p.add_argument("--turns", type=int, default=defaults.turns)
    p.add_argument("--output-tokens", type=int, default=defaults.output_tokens, help="tokens generated per turn")
    p.add_argument("--system-tokens", type=int, default=defaults.system_tokens)
    p.add_argument("--task-tokens", type=int, default=defaults.task_tokens)
    p.add_argument(
        "--observation-tokens", type=int, nargs=2, metavar=("MIN", "MAX"),
        default=(defaults.observation_tokens_min, defaults.observation_tokens_max),
    )
    p.add_argument("--threads", type=int, default=defaults.threads)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--backend-repeats", type=int, default=defaults.backend_repeats,
                   help="timed passes per backend, alternating between them")
    p.add_argument("--kv-repeats", type=int, default=defaults.kv_repeats)
    p.add_argument("--trainer-steps", type=int, default=defaults.trainer_steps)
    p.add_argument("--preset", default=defaults.preset, help="model preset when no --model-dir is given")
    p.add_argument("--model-dir", default=None, help="an existing HF model directory instead of a fresh preset")
    p.set_defaults(func=_handle)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="engine_bench")
    register(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(["engine", *sys.argv[1:]])
    sys.exit(args.func(args))
