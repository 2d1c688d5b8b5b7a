"""Two cells on two Ray nodes, for the Ray launcher's tests: a core and a satellite (tiny model, the cells' default
engine kind), the proxy, the KV migrator, the micro-step claimer and the weight broker, and `load`, an actor in the
proxy's process group that plays agents (the openai SDK through the proxy) and drives the cells.

Each cell reserves 0.75 CPU and the two other groups 0.1: on nodes of 1 CPU the two cells can only be placed on two
different nodes, so every weight pull, KV migration and engine call between them crosses nodes.

`--mode switch`: the core switches to rollout; then each round the agents make one call each (their sessions spread
over both cells) and, while they generate, the cell of the round (the satellite, then the core) is switched to
training, its sessions migrated to the other cell, and back.
`--mode kill`: the core switches to rollout; the agents make one call each and, while the satellite generates, its
process ends (os._exit: its Ray worker dies). Its RestartPolicy (`--satellite-restart`) decides: "restart" starts
the group again (the launcher) while its calls resume on the core; "stop_topology" ends the run with status 1.
Then, with the satellite back, the agents make one more call each.

Either way the run ends with `load`'s verdict: status 0 and a reason that counts the calls when none was lost (each
completed with finish reason "stop" or "length", the proxy failed and refused none), status 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
from typing import Any, Callable

import attrs

from gyre.actors.cells.cell import Cell, CellConfig
from gyre.actors.cells.kv_migrator import KVMigrator, KVMigratorConfig
from gyre.actors.cells.weight_broker import WeightBroker
from gyre.actors.serving.http_app import ProxyHttpConfig
from gyre.actors.serving.proxy import Proxy, ProxyConfig
from gyre.actors.training.microstep_claimer import ClaimerConfig, MicroStepClaimer
from gyre.engines.embedded_engine import EngineConfig
from gyre.engines.trainer import TrainerConfig
from gyre.messages._define import message
from gyre.messages.cells import ROLLOUT, TRAIN, RoleChanged, SessionPlaced, SwitchRole
from gyre.messages.executions import IssueKey
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.runtime_control import StatisticsAsked
from gyre.runtime import Actor, RestartPolicy, Topology, handler

WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud ember field".split()
CELLS = ("core", "sat")
#: Rounds of calls `Load._busy` makes at most to catch a cell generating (all calls can end between two polls).
BUSY_ATTEMPTS = 5


PULLS_BEFORE_DEATH_S = 2.0
"""How long the satellite serves before it is killed: four of the launcher's pull periods (RayLaunchConfig
pull_every_s), so its death report has lines to quote."""


@message("gyre.test.ray_cells.DieNow")
class DieNow:
    """load -> a mortal cell: end your process now, without a goodbye."""

    exit_code: int


class MortalCell(Cell):
    """A cell whose process can be ended from the bus (a real death of its Ray worker)."""

    @handler(DieNow)
    def on_die_now(self, msg: DieNow) -> None:
        self.log.warning("dying_now", exit_code=msg.exit_code)
        os._exit(msg.exit_code)


@attrs.frozen
class LoadConfig:
    """What `load` does."""

    mode: str = "switch"
    agents: int = 4
    max_tokens: int = 96
    rounds: int = 2
    wait_s: float = 240.0
    """Bound on each wait (cells up, a switch, the calls of a round)."""


class Load(Actor):
    """Agents and the switches (module docstring); ends the run with its verdict."""

    config_cls = LoadConfig
    subscriptions = (RoleChanged, SessionPlaced, ModelCallCompleted)

    async def on_start(self) -> None:
        self.changes: list[RoleChanged] = []
        self.completed: list[ModelCallCompleted] = []
        self.after_death = ""
        self.placed = 0
        self.calls = 0
        self.lost: list[str] = []
        self.by_round: list[str] = []
        self.spawn(self._drive(), name="load.drive")

    @handler(RoleChanged)
    def on_role(self, msg: RoleChanged) -> None:
        self.changes.append(msg)

    @handler(ModelCallCompleted)
    def on_call_completed(self, msg: ModelCallCompleted) -> None:
        self.completed.append(msg)

    @handler(SessionPlaced)
    def on_placed(self, msg: SessionPlaced) -> None:
        self.placed += 1

    def role(self, cell: str) -> str:
        changes = [m for m in self.changes if m.cell == cell]
        return changes[-1].role if changes else ""

    async def _until(self, check: Callable[[], bool], what: str) -> None:
        waited = 0.0
        while not check():
            if waited >= self.config.wait_s:
                raise TimeoutError(f"{what}: not within {self.config.wait_s} s")
            await asyncio.sleep(0.05)
            waited += 0.05

    async def _switch(self, cell: str, role: str) -> None:
        before = sum(m.cell == cell for m in self.changes)
        self.tell(cell, SwitchRole(cell, role, "ray test"))
        await self._until(lambda: sum(m.cell == cell for m in self.changes) > before and self.role(cell) == role,
                          f"{cell} to {role}")

    async def _drive(self) -> None:
        try:
            reason, code = await self._run()
        except Exception as error:  # the verdict names what went wrong; the run must end either way
            self.log.exception("load_failed")
            reason, code = f"load failed after {self.calls} calls: {error!r}", 1
        self.stop_topology(reason, code)

    async def _run(self) -> tuple[str, int]:
        import openai

        config = self.config
        await self._until(lambda: self.role("core") == TRAIN and self.role("sat") == ROLLOUT, "cells up")
        await self._switch("core", ROLLOUT)
        clients = []
        for index in range(config.agents):
            key = await self.ask("proxy", IssueKey(f"exec-{index}", "group-0"), timeout_s=30)
            clients.append(openai.AsyncOpenAI(base_url=key.openai_base_url, api_key=key.api_key, max_retries=0,
                                              timeout=config.wait_s))
        rng = random.Random(7)
        conversations = [[{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(30))}]
                         for _ in clients]
        if config.mode == "switch":
            for round_index in range(config.rounds):
                source = CELLS[(round_index + 1) % 2]  # the satellite first, then the core
                other = CELLS[round_index % 2]
                calls = await self._busy(source, clients, conversations)
                await self._switch(source, TRAIN)
                await self._finish(calls, conversations)
                await self._switch(source, ROLLOUT)
                self.by_round.append(f"{source}->{other}")
        else:
            # The launcher pulls each group's last lines every 0.5 s; a satellite that died within a pull period
            # of its first line would leave none to quote. Let a few pulls happen first.
            await asyncio.sleep(PULLS_BEFORE_DEATH_S)
            calls = await self._busy("sat", clients, conversations)
            back = sum(m.cell == "sat" and m.role == ROLLOUT for m in self.changes)
            done_before = len(self.completed)
            self.tell("sat", DieNow(9))
            await self._finish(calls, conversations)
            await self._until(lambda: len(self.completed) >= done_before + len(calls), "the calls' records")
            cells = sorted({m.cell for m in self.completed[done_before:]})
            self.after_death = f"; the calls in flight at the death completed on {','.join(cells)}"
            await self._until(lambda: sum(m.cell == "sat" and m.role == ROLLOUT for m in self.changes) > back,
                              "sat back in rollout")
            await self._finish(self._calls(clients, conversations), conversations)
        stats = await self.ask("proxy", StatisticsAsked(), timeout_s=30)
        lost = len(self.lost) + stats.calls_failed + stats.calls_rejected
        reason = (f"{self.calls - len(self.lost)} of {self.calls} agent calls completed, {lost} lost; "
                  f"switches {','.join(self.by_round) or 'none'}; sessions placed {self.placed}; "
                  f"generations resumed {stats.resumed_generations}{self.after_death}")
        if self.lost:
            reason += f"; lost: {'; '.join(self.lost[:4])}"
        return reason, 0 if lost == 0 else 1

    async def _busy(self, cell: str, clients: list[Any], conversations: list[list[dict]]) -> list[asyncio.Future]:
        """Each agent's next call, once `cell`'s engine generates some of them (a few tokens each: the switch or
        the death comes mid-generation). Calls that all end before that are finished and made again (the turns
        grow), up to `BUSY_ATTEMPTS` times."""
        from gyre.engines.sglang_client import SGLangClient

        url = next(m.engine_url for m in reversed(self.changes) if m.cell == cell and m.role == ROLLOUT)
        async with SGLangClient(url) as engine:
            for _ in range(BUSY_ATTEMPTS):
                before = int((await engine.get_load())["generated_tokens_total"])
                calls = self._calls(clients, conversations)
                while not all(call.done() for call in calls):
                    load = await engine.get_load()
                    running = int(load["running"])
                    if running and int(load["generated_tokens_total"]) - before >= 4 * running:
                        return calls
                    await asyncio.sleep(0.01)
                await self._finish(calls, conversations)
        raise TimeoutError(f"{cell} finished every call before it was seen generating, {BUSY_ATTEMPTS} times")

    def _calls(self, clients: list[Any], conversations: list[list[dict]]) -> list[asyncio.Future]:
        self.calls += len(clients)
        return [asyncio.ensure_future(client.chat.completions.create(
            model="gyre", messages=list(messages), max_tokens=self.config.max_tokens, temperature=1.0, seed=seed))
            for seed, (client, messages) in enumerate(zip(clients, conversations))]

    async def _finish(self, calls: list[asyncio.Future], conversations: list[list[dict]]) -> None:
        replies = await asyncio.gather(*calls, return_exceptions=True)
        for messages, reply in zip(conversations, replies):
            if isinstance(reply, BaseException):
                self.lost.append(repr(reply)[:200])
                continue
            finish = reply.choices[0].finish_reason
            if finish not in ("stop", "length"):
                self.lost.append(f"finish_reason {finish}")
                continue
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            messages.append({"role": "user", "content": "and then"})


def topology(argv: list[str]) -> Topology:
    parser = argparse.ArgumentParser(prog="ray_cells_topology")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--mode", choices=("switch", "kill"), default="switch")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--satellite-restart", choices=("restart", "stop_topology"), default="restart")
    parser.add_argument("--engine-kind", choices=("embedded", "server"),
                        default=attrs.fields(CellConfig).engine_kind.default)
    args = parser.parse_args(argv)
    engine = EngineConfig(num_blocks=256, max_context_tokens=1024, max_prefill_tokens=512, num_threads=1)
    cells = dict(model_dir=args.model_dir, engine=engine, trainer=TrainerConfig(num_threads=1),
                 report_interval_s=0.25, engine_kind=args.engine_kind)
    result = Topology("ray_cells", seed=0)
    result.add("proxy", Proxy, ProxyConfig(model_dir=args.model_dir, http=ProxyHttpConfig(
        max_context_tokens=1024, default_max_tokens=args.max_tokens)), process="front")
    result.add("load", Load, LoadConfig(args.mode, args.agents, args.max_tokens, args.rounds), process="front",
               restart=RestartPolicy("stop_topology"))
    result.add("kv_migrator", KVMigrator, KVMigratorConfig(), process="control")
    result.add("claimer", MicroStepClaimer, ClaimerConfig(groups_per_step=1, group_size=4, retry_after_s=0.1),
               process="control")
    result.add("weight_broker", WeightBroker, process="control")
    result.add("core", Cell, CellConfig(is_core=True, initial_role=TRAIN, **cells))
    result.add("sat", MortalCell, CellConfig(initial_role=ROLLOUT, **cells),
               restart=RestartPolicy(args.satellite_restart, max_restarts=1))
    for cell in CELLS:
        result.resources(cell, CPU=0.75)
    for group in ("front", "control"):
        result.resources(group, CPU=0.1)
    return result
