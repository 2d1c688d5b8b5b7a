"""`gyre bench switch`: role switches of a satellite under live multi-turn load, with and without KV migration.

The topology is the one of tests/integration/test_cell_switch.py: a core that trains (no samples come, so it only
waits), two satellites serving rollouts, the proxy, the micro-step claimer, the weight broker and (in the migrated
run) the KV migrator, all on the tiny model on CPU. `sessions` agents (the openai SDK through the proxy, sampling at
temperature 1.0 with a seed per call) each run a conversation turn after turn, pausing `think_s` between turns as
an agent running a tool would. Each repeat switches the satellite that holds the most sessions to training, waits
until every session it held has been served on the new cell, and switches it back, while the load goes on.

Measured, per run:
- switch latency each way: the cell's own `RoleChanged.switch_s` (from the switch order to the new role), median
  over repeats;
- prefix reuse after a switch: over the sessions the switched cell held, the first request each made on its new
  cell (the resubmission of a call that was generating, or the next turn of one that was between turns), the
  fraction of its prompt tokens served from that cell's cache. The same load runs twice in one invocation: with the
  KV migrator (`prefix_reuse_after_switch`) and without it, when aborted calls and next turns re-prefill
  (`prefix_reuse_reprefill`). Without migration the new cell may still hold a shared prefix (the chat template's
  opening) from other sessions, so the baseline need not be 0;
- lost requests: agent calls that failed, were refused or ended other than "stop"/"length", in both runs;
- weight_update_s: after the load, weight updates of the serving satellites (the model directory's weights as a new
  version, WEIGHT_UPDATES times each, median) through the path each one's engine takes. With server engines cell-a
  takes "disk" (a versioned safetensors directory written atomically, then pause in place ->
  update_weights_from_disk -> continue over HTTP) and cell-b "distributed" (pause in place -> a broadcast over a
  gloo group formed with init_weights_update_group -> update_weights_from_distributed per bucket -> continue):
  `weight_update_s` and `weight_update_distributed_s`. Embedded engines take "memory" (`weight_update_s`).

`engine_kind` "server" (the default) runs every cell's engine as a Gyre engine server child process driven only over
SGLang's HTTP API; "embedded" keeps the engines in the cells' processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs
import structlog

from gyre.actors.cells.cell import Cell, CellConfig
from gyre.actors.cells.engine_process import EngineServerConfig
from gyre.actors.cells.kv_migrator import KVMigrator, KVMigratorConfig
from gyre.actors.training.microstep_claimer import ClaimerConfig, MicroStepClaimer
from gyre.actors.serving.proxy import Proxy, ProxyConfig
from gyre.actors.serving.http_app import ProxyHttpConfig
from gyre.actors.cells.weight_broker import WeightBroker
from gyre.engines.embedded_engine import EngineConfig
from gyre.engines.trainer import TrainerConfig
from gyre.messages.cells import ROLLOUT, TRAIN, RoleChanged, SwitchRole
from gyre.messages.executions import IssueKey
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.runtime_control import StatisticsAsked
from gyre.runtime import Actor, Topology, handler
from gyre.runtime.logs import CURRENT_STDERR

__all__ = ["SwitchBenchConfig", "SwitchBenchResult", "SwitchRunFigures", "main", "register", "run_switch_bench"]

SATELLITES = ("cell-a", "cell-b")
WEIGHT_PATHS = {"cell-a": "disk", "cell-b": "distributed"}
"""How each satellite's server engine takes its weights (see the module doc)."""
WEIGHT_UPDATES = 5
"""Updates timed per satellite (the first broadcast also forms the group: the median is the steady state)."""
WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud ember field".split()


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


@attrs.frozen
class SwitchBenchConfig:
    """The load and how many switches."""

    repeats: int = attrs.field(default=5, validator=_positive)
    """Round trips (rollout -> train -> rollout) per run."""
    sessions: int = attrs.field(default=6, validator=_positive)
    """Agents issuing turns at once."""
    max_new_tokens: int = attrs.field(default=64, validator=_positive)
    """Tokens per turn at most."""
    think_s: float = attrs.field(default=0.3, validator=attrs.validators.ge(0.0))
    """Pause between an agent's turns (its tool time)."""
    opening_words: int = attrs.field(default=240, validator=_positive)
    """Words of a conversation's first message (an agent's task and system prompt are long)."""
    max_prompt_tokens: int = attrs.field(default=800, validator=_positive)
    """A conversation that grew past this starts over (the engines' context is 1024 tokens)."""
    seed: int = 0
    """Seeds the conversations' words and the calls' sampling seeds."""
    step_timeout_s: float = attrs.field(default=300.0, validator=_positive)
    """Bound on every wait of the driver (cells up, a switch, sessions served)."""
    engine_kind: str = attrs.field(default="server", validator=attrs.validators.in_(("server", "embedded")))
    """How the cells host their engines: "server" (child processes over HTTP) or "embedded"."""


@attrs.frozen
class SwitchRunFigures:
    """One run: with or without migration."""

    migrate: bool
    rollout_to_train_s: tuple[float, ...]
    train_to_rollout_s: tuple[float, ...]
    prefix_reuse: float
    """Cached / prompt tokens of each moved session's first request on its new cell, over all switches."""
    resumed_prompt_tokens: int
    """Prompt tokens (prompt + partial output) of calls cut by a switch and resubmitted on the new cell."""
    resumed_cached_tokens: int
    next_turn_prompt_tokens: int
    """Prompt tokens of the next turns of sessions that were between turns at a switch."""
    next_turn_cached_tokens: int
    sessions_moved: int
    """Sessions the switched cells held, summed over switches."""
    calls_completed: int
    lost_requests: int
    partial_output_tokens: int
    """Tokens of partial output the migrator moved with in-flight calls (0 without migration)."""
    weight_update_s: float = 0.0
    """Median weight update of the serving satellite on the disk path (memory, embedded) after the load."""
    weight_update_distributed_s: float = 0.0
    """The same on the distributed path (server engines only)."""
    weight_broadcast_fallbacks: int = 0
    """Broadcasts that failed and went by disk."""


@attrs.frozen
class SwitchBenchResult:
    rollout_to_train_s: float
    """Median switch latency rollout -> train, migrated run."""
    train_to_rollout_s: float
    """Median switch latency train -> rollout, migrated run."""
    prefix_reuse_after_switch: float
    prefix_reuse_reprefill: float
    lost_requests: int
    """Over both runs."""
    reprefill_rollout_to_train_s: float
    """Median rollout -> train without migration (nothing to move: the floor of the switch)."""
    reprefill_train_to_rollout_s: float
    repeats: int
    sessions: int
    max_new_tokens: int
    think_s: float
    engine_kind: str
    weight_update_s: float
    """Median weight update of a serving satellite, migrated run (see the module docstring)."""
    weight_update_path: str
    """"disk" (server engines) or "memory" (embedded)."""
    weight_update_distributed_s: float
    """Median weight update by broadcast (server engines; 0 for embedded ones)."""
    weight_broadcast_fallbacks: int
    migrated: SwitchRunFigures
    reprefill: SwitchRunFigures


class _Recorder(Actor):
    """Keeps every role change, and which cell served each of an execution's calls, in completion order."""

    subscriptions = (RoleChanged, ModelCallCompleted)

    async def on_start(self) -> None:
        self.roles: list[RoleChanged] = []
        self.cells: dict[str, list[str]] = {}

    @handler(RoleChanged)
    def on_role(self, msg: RoleChanged) -> None:
        self.roles.append(msg)

    @handler(ModelCallCompleted)
    def on_call(self, msg: ModelCallCompleted) -> None:
        self.cells.setdefault(msg.execution_id, []).append(msg.cell)

    def role_changes(self, cell: str) -> list[RoleChanged]:
        return [m for m in self.roles if m.cell == cell]


def _topology(model_dir: str, migrate: bool, engine_kind: str = "server") -> Topology:
    # 1024 blocks of 16 tokens: room for every session's prefix on one cell (a full pool evicts migrated prefixes).
    engine = EngineConfig(num_blocks=1024, max_context_tokens=1024, max_prefill_tokens=512, num_threads=1)
    cells = dict(model_dir=model_dir, engine=engine, trainer=TrainerConfig(num_threads=1), report_interval_s=0.25,
                 engine_kind=engine_kind)
    topology = Topology("switch-bench", seed=0)
    topology.add("recorder", _Recorder)
    topology.add("proxy", Proxy, ProxyConfig(model_dir=model_dir, http=ProxyHttpConfig(max_context_tokens=1024)))
    if migrate:  # without it, a draining cell's ask fails at once and every moved session re-prefills
        topology.add("kv_migrator", KVMigrator, KVMigratorConfig())
    topology.add("claimer", MicroStepClaimer, ClaimerConfig(groups_per_step=1, group_size=4, retry_after_s=0.1))
    topology.add("weight_broker", WeightBroker)
    topology.add("core", Cell, CellConfig(is_core=True, initial_role=TRAIN, **cells))
    for name in SATELLITES:
        topology.add(name, Cell, CellConfig(initial_role=ROLLOUT, engine_server=EngineServerConfig(
            weight_path=WEIGHT_PATHS[name]), **cells))
    return topology


@attrs.define
class _Call:
    prompt_tokens: int
    cached_tokens: int
    ok: bool


@attrs.define
class _Session:
    name: str
    calls: list[_Call] = attrs.field(factory=list)
    generating: bool = False


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


async def _agent(session: _Session, client: Any, config: SwitchBenchConfig, index: int, stop: asyncio.Event) -> None:
    """One agent: turn after turn until `stop`; every call's outcome is recorded, failures included."""
    import openai

    rng = random.Random(f"{config.seed}:{index}")
    messages = [{"role": "user", "content": _words(rng, config.opening_words)}]
    turn = 0
    while not stop.is_set():
        session.generating = True
        try:
            reply = await client.chat.completions.create(
                model="gyre", messages=list(messages), max_tokens=config.max_new_tokens, temperature=1.0,
                seed=rng.getrandbits(31))
            details = reply.usage.prompt_tokens_details if reply.usage is not None else None
            call = _Call(reply.usage.prompt_tokens if reply.usage is not None else 0,
                         int(details.cached_tokens or 0) if details is not None else 0,
                         reply.choices[0].finish_reason in ("stop", "length"))
            content = reply.choices[0].message.content or ""
        except openai.OpenAIError as error:
            structlog.get_logger(__name__).error("bench call failed", session=session.name, error=str(error))
            call, content = _Call(0, 0, False), ""
        finally:
            session.generating = False
        session.calls.append(call)
        turn += 1
        messages.append({"role": "assistant", "content": content})
        messages.append({"role": "user", "content": _words(rng, 8)})
        if call.prompt_tokens > config.max_prompt_tokens:
            messages = [{"role": "user", "content": _words(rng, config.opening_words)}]
        if config.think_s:
            try:
                await asyncio.wait_for(stop.wait(), config.think_s)
            except asyncio.TimeoutError:
                pass


async def _mid_generation(h: Any, cell: str, sessions: int, timeout_s: float) -> None:
    """Wait (bounded) until at least half of the cell's sessions generate and have produced a few tokens each, so
    that the switch cuts calls mid-generation as a live run would; on timeout, switch anyway."""
    rollout = h.actor(cell).rollout
    wanted = max(1, (sessions + 1) // 2)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    start_generated: int | None = None
    while loop.time() < deadline:
        stats = await rollout.stats()
        if stats is None:
            return
        if stats.running < wanted:
            start_generated = None
        elif start_generated is None:
            start_generated = stats.generated_tokens_total
        elif stats.generated_tokens_total - start_generated >= 8 * stats.running:
            return
        await asyncio.sleep(0.005)


async def _switch(h: Any, recorder: Any, cell: str, role: str, timeout_s: float) -> float:
    """Ask `cell` to switch to `role`, wait for its RoleChanged; the switch's seconds as the cell measured them."""
    changes = len(recorder.role_changes(cell))
    h.tell(cell, SwitchRole(cell, role, "bench"))
    await h.wait_until(lambda: len(recorder.role_changes(cell)) > changes, timeout_s=timeout_s,
                       what=f"{cell} -> {role}")
    change = recorder.role_changes(cell)[-1]
    if change.role != role:
        raise RuntimeError(f"{cell} did not switch to {role}: {change}")
    return change.switch_s


async def _weight_updates_s(h: Any, recorder: Any, model_dir: str) -> dict[str, float]:
    """Median seconds of WEIGHT_UPDATES weight updates (the model directory's weights as the next versions) of each
    serving satellite, through its engine host's own path, by path; and the broadcasts that fell back to disk."""
    from gyre.engines.model_format import load_hf_state_dict

    loop = asyncio.get_running_loop()
    weights = await loop.run_in_executor(None, load_hf_state_dict, model_dir)
    times: dict[str, list[float]] = {}
    fallbacks = 0
    for cell in SATELLITES:
        if not recorder.role_changes(cell) or recorder.role_changes(cell)[-1].role != ROLLOUT:
            continue
        rollout = h.actor(cell).rollout
        for _ in range(WEIGHT_UPDATES):
            started = loop.time()
            await rollout.load_weights(weights, rollout.weight_version + 1)
            times.setdefault(rollout.last_weight_update_path, []).append(loop.time() - started)
        fallbacks += getattr(rollout, "weight_broadcast_fallbacks", 0)
    result = {path: statistics.median(values) for path, values in times.items()}
    result["fallbacks"] = fallbacks
    return result


async def _drive(h: Any, config: SwitchBenchConfig, migrate: bool, model_dir: str = "") -> SwitchRunFigures:
    import openai

    recorder: _Recorder = h.actor("recorder")
    timeout = config.step_timeout_s
    await h.wait_until(lambda: len(recorder.roles) >= 1 + len(SATELLITES), timeout_s=timeout, what="cells up")
    proxy = h.actor("proxy")
    sessions = [_Session(f"bench-{i}") for i in range(config.sessions)]
    clients = []
    for session in sessions:
        key = await h.ask("proxy", IssueKey(session.name, "bench"))
        clients.append(openai.AsyncOpenAI(base_url=key.openai_base_url, api_key=key.api_key, max_retries=0,
                                          timeout=timeout))
    stop = asyncio.Event()
    agents = [asyncio.ensure_future(_agent(s, c, config, i, stop)) for i, (s, c) in enumerate(zip(sessions, clients))]

    def served(session: _Session, count: int) -> bool:
        """The session's first `count` calls are done, and the recorder heard of them."""
        return len(session.calls) >= count and len(recorder.cells.get(session.name, ())) >= count

    to_train: list[float] = []
    to_rollout: list[float] = []
    resumed_prompt = resumed_cached = next_prompt = next_cached = moved = 0
    try:
        await h.wait_until(lambda: all(served(s, 1) for s in sessions), timeout_s=timeout, what="first turns")
        for _ in range(config.repeats):
            holders = {cell: [s for s in sessions if recorder.cells[s.name][-1] == cell] for cell in SATELLITES}
            source = max(SATELLITES, key=lambda cell: (len(holders[cell]), cell))
            await _mid_generation(h, source, len(holders[source]), timeout_s=30.0)
            holders = {cell: [s for s in sessions if recorder.cells[s.name][-1] == cell] for cell in SATELLITES}
            affected = holders[source]
            generating = {s.name for s in affected if s.generating}
            before = {s.name: len(s.calls) for s in affected}
            stats_before = proxy.backend.statistics()
            to_train.append(await _switch(h, recorder, source, TRAIN, timeout))

            def first_on_new_cell_done(session: _Session) -> bool:
                done = before[session.name]
                if session.name in generating:  # its cut call; if it ended on the source anyway, the next one
                    if not served(session, done + 1):
                        return False
                    return recorder.cells[session.name][done] != source or served(session, done + 2)
                return served(session, done + 1)

            await h.wait_until(lambda: all(first_on_new_cell_done(s) for s in affected), timeout_s=timeout,
                               what="every moved session served on its new cell")
            stats_after = proxy.backend.statistics()
            resumed_prompt += stats_after.resumed_prompt_tokens - stats_before.resumed_prompt_tokens
            resumed_cached += stats_after.resumed_cached_tokens - stats_before.resumed_cached_tokens
            for session in affected:
                done = before[session.name]
                if session.name in generating:
                    if recorder.cells[session.name][done] != source:
                        continue  # resubmitted: counted through the proxy's resumption figures
                    done += 1
                call = session.calls[done]
                next_prompt += call.prompt_tokens
                next_cached += call.cached_tokens
            moved += len(affected)

            to_rollout.append(await _switch(h, recorder, source, ROLLOUT, timeout))
            # The load goes on: every agent completes one more turn before the next switch.
            counts = {s.name: len(s.calls) for s in sessions}
            await h.wait_until(lambda: all(served(s, counts[s.name] + 1) for s in sessions), timeout_s=timeout,
                               what="a turn of every session after the switch back")
    finally:
        stop.set()
        await asyncio.gather(*agents, return_exceptions=True)
        for client in clients:
            await client.close()
    status = await h.ask("proxy", StatisticsAsked())
    calls = [call for s in sessions for call in s.calls]
    # Agents see every failure (no SDK retries); the proxy's own count is the check.
    lost = max(sum(1 for call in calls if not call.ok), status.calls_failed + status.calls_rejected)
    partial = h.actor("kv_migrator").partial_output_tokens if migrate else 0
    updates = await _weight_updates_s(h, recorder, model_dir) if model_dir else {}
    prompt, cached = resumed_prompt + next_prompt, resumed_cached + next_cached
    return SwitchRunFigures(
        migrate=migrate, rollout_to_train_s=tuple(to_train), train_to_rollout_s=tuple(to_rollout),
        prefix_reuse=cached / prompt if prompt else 0.0, resumed_prompt_tokens=resumed_prompt,
        resumed_cached_tokens=resumed_cached, next_turn_prompt_tokens=next_prompt,
        next_turn_cached_tokens=next_cached, sessions_moved=moved, calls_completed=sum(1 for c in calls if c.ok),
        lost_requests=lost, partial_output_tokens=partial,
        weight_update_s=updates.get("disk", updates.get("memory", 0.0)),
        weight_update_distributed_s=updates.get("distributed", 0.0),
        weight_broadcast_fallbacks=int(updates.get("fallbacks", 0)),
    )


def _run_once(model_dir: str, config: SwitchBenchConfig, migrate: bool) -> SwitchRunFigures:
    from gyre.runtime.testing import run_actors

    async def driver(h: Any) -> SwitchRunFigures:
        return await _drive(h, config, migrate, model_dir)

    run = run_actors(_topology(model_dir, migrate, config.engine_kind), driver,
                     timeout_s=config.step_timeout_s * (4 + 3 * config.repeats))
    if run.stop_reason is not None:
        raise RuntimeError(f"the bench topology stopped early: {run.stop_reason}")
    return run.value


def run_switch_bench(config: SwitchBenchConfig = SwitchBenchConfig(), model_dir: str | Path | None = None
                     ) -> SwitchBenchResult:
    """Both runs (migrated, then re-prefill) on `model_dir`, or on a fresh tiny model when None."""
    import torch

    torch.set_num_threads(1)
    if model_dir is None:
        from gyre.engines.model_format import init_model_dir

        with tempfile.TemporaryDirectory(prefix="gyre-switch-bench-") as tmp:
            return run_switch_bench(config, init_model_dir(Path(tmp) / "model", preset="tiny", seed=0))
    migrated = _run_once(str(model_dir), config, migrate=True)
    reprefill = _run_once(str(model_dir), config, migrate=False)
    return SwitchBenchResult(
        rollout_to_train_s=statistics.median(migrated.rollout_to_train_s),
        train_to_rollout_s=statistics.median(migrated.train_to_rollout_s),
        prefix_reuse_after_switch=migrated.prefix_reuse,
        prefix_reuse_reprefill=reprefill.prefix_reuse,
        lost_requests=migrated.lost_requests + reprefill.lost_requests,
        reprefill_rollout_to_train_s=statistics.median(reprefill.rollout_to_train_s),
        reprefill_train_to_rollout_s=statistics.median(reprefill.train_to_rollout_s),
        repeats=config.repeats, sessions=config.sessions, max_new_tokens=config.max_new_tokens,
        think_s=config.think_s, engine_kind=config.engine_kind, weight_update_s=migrated.weight_update_s,
        weight_update_path="disk" if config.engine_kind == "server" else "memory",
        weight_update_distributed_s=migrated.weight_update_distributed_s,
        weight_broadcast_fallbacks=migrated.weight_broadcast_fallbacks,
        migrated=migrated, reprefill=reprefill,
    )


def _handle(args: argparse.Namespace) -> int:
    # stdout carries the result; the actors' log lines go to stderr, warnings and worse only.
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(CURRENT_STDERR),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )
    config = SwitchBenchConfig(repeats=args.repeats, sessions=args.sessions, max_new_tokens=args.max_new_tokens,
                               think_s=args.think_s, seed=args.seed, engine_kind=args.engine_kind)
    result = run_switch_bench(config, args.model_dir)
    if args.json:
        print(json.dumps(attrs.asdict(result), indent=2))
    else:
        for name, value in attrs.asdict(result).items():
            if isinstance(value, dict):
                continue
            if isinstance(value, float):
                print(f"{name:30s} {value:.3f}")
            else:
                print(f"{name:30s} {value}")
        for run in (result.migrated, result.reprefill):
            label = "migrated" if run.migrate else "reprefill"
            print(f"{label}: rollout->train s {[round(s, 3) for s in run.rollout_to_train_s]}, "
                  f"train->rollout s {[round(s, 3) for s in run.train_to_rollout_s]}, "
                  f"resumed {run.resumed_cached_tokens}/{run.resumed_prompt_tokens} cached, next turns "
                  f"{run.next_turn_cached_tokens}/{run.next_turn_prompt_tokens}, {run.calls_completed} calls, "
                  f"{run.lost_requests} lost")
    lost = result.lost_requests
    return 0 if lost == 0 else 1


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("switch", help="role switch latency, prefix reuse after migration, lost calls")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--repeats", type=int, default=5, help="round trips per run (default 5)")
    p.add_argument("--sessions", type=int, default=6, help="concurrent agent sessions (default 6)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per turn at most (default 64)")
    p.add_argument("--think-s", type=float, default=0.3, help="pause between an agent's turns (default 0.3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=None, help="model directory (default: a fresh tiny model)")
    p.add_argument("--engine-kind", choices=("server", "embedded"), default="server",
                   help="cells' engines as server child processes over HTTP (default) or in their processes")
    p.set_defaults(func=_handle)


def main(argv: list[str] | None = None) -> int:
    """`gyre bench switch` without the entry point: python -m gyre.benchmarks.switch [--json ...]."""
    parser = argparse.ArgumentParser(prog="gyre bench")
    register(parser.add_subparsers())
    args = parser.parse_args(["switch", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
