"""The KV migrator on the bus: a session's prefix moves from a draining cell to another through Mooncake.

Three real engine servers (one process each, tiny model): cell-a and cell-b with --kv-transfer, cell-c without.
A driver actor plays the draining cell (CellDraining, MigrateSessions, RoleChanged) and runs the agent with the
real `openai` SDK through the proxy actor. Measured: how much of a session's prefix the new cell serves from its
cache on the next call after a migration, against a switch without migration (re-prefill).
"""

from __future__ import annotations

import asyncio
import json
import random
import traceback
from typing import Any, Awaitable, Callable

import aiohttp
import attrs
import openai
import pytest

from gyre.actors.cells.kv_migrator import KVMigrator, KVMigratorConfig, assign_sessions, extend_with_in_flight
from gyre.actors.serving.proxy import Proxy, ProxyConfig
from gyre.actors.serving.http_app import ProxyHttpConfig
from gyre.engines.sglang_client import auth_headers
from gyre.messages.cells import ROLLOUT, TRAIN, CellDraining, MigrateSessions, RoleChanged, SessionsMigrated
from gyre.messages.executions import IssueKey
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.runtime_control import StatisticsAsked
from gyre.runtime import Actor, InProcessLauncher, RunOptions, Topology, handler

MAX_CONTEXT_TOKENS = 2048
BLOCK_TOKENS = 16
WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud ember field".split()


def test_assign_sessions_balances_prefix_tokens() -> None:
    lengths = {"s1": 900, "s2": 500, "s3": 450, "s4": 10, "s5": 10}
    placement = assign_sessions(lengths, ("b", "c"))
    load = {"b": 0, "c": 0}
    for session, target in placement.items():
        load[target] += lengths[session]
    assert set(placement) == set(lengths)
    assert abs(load["b"] - load["c"]) <= 900 - 500 + 20  # greedy longest-first: off by less than one prefix
    assert placement == assign_sessions(dict(reversed(list(lengths.items()))), ("c", "b"))  # order-free
    assert assign_sessions(lengths, ()) == {}
    assert assign_sessions({"x": 0, "y": 0}, ("b", "c")) == {"x": "b", "y": "c"}  # empty prefixes still spread


def test_in_flight_sequences_extend_the_sessions_they_continue() -> None:
    prefixes = {"s1": (1, 2, 3), "s2": (1, 2, 9), "s3": (4,), "s4": ()}
    in_flight = ((1, 2, 3, 7, 7), (1, 2, 3, 7), (4, 5), (1, 2), (), (8, 8, 8))
    assert extend_with_in_flight(prefixes, in_flight) == {
        "s1": (1, 2, 3, 7, 7),  # the longest sequence that begins with the session's ids
        "s2": (1, 2, 9),  # nothing continues it
        "s3": (4, 5),
        "s4": (),
    }
    assert extend_with_in_flight(prefixes, ()) == prefixes


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory, engine_servers) -> dict[str, str]:
    flags = ["--max-context", str(MAX_CONTEXT_TOKENS), "--block-size", str(BLOCK_TOKENS)]
    servers = {"cell-a": [*flags, "--kv-transfer"], "cell-b": [*flags, "--kv-transfer"], "cell-c": flags}
    with engine_servers(tiny_model_dir, tmp_path_factory.mktemp("engine-logs"), servers) as urls:
        yield urls


SCENARIOS: dict[str, Callable[["Driver"], Awaitable[Any]]] = {}
RESULTS: dict[str, Any] = {}


@attrs.frozen
class DriverConfig:
    scenario: str
    cells: dict[str, str]


class Driver(Actor):
    """Plays the cells and the executor; runs the agent."""

    config_cls = DriverConfig
    subscriptions = (ModelCallCompleted,)

    async def on_start(self) -> None:
        self.calls: list[ModelCallCompleted] = []
        self.taken = 0
        self.arrived = asyncio.Event()
        self.spawn(self._run())

    async def _run(self) -> None:
        name = self.config.scenario
        try:
            RESULTS[name] = await SCENARIOS[name](self)
        except Exception:
            RESULTS[name] = RuntimeError(traceback.format_exc())
            self.stop_topology(f"{name} failed", 1)
            return
        self.stop_topology(f"{name} done")

    @handler(ModelCallCompleted)
    def on_call(self, msg: ModelCallCompleted) -> None:
        self.calls.append(msg)
        self.arrived.set()

    async def next_call(self) -> ModelCallCompleted:
        """The oldest ModelCallCompleted not taken yet (it may arrive before or after the agent's answer)."""

        async def until() -> None:
            while len(self.calls) <= self.taken:
                self.arrived.clear()
                await self.arrived.wait()

        await asyncio.wait_for(until(), 120)
        self.taken += 1
        return self.calls[self.taken - 1]

    def announce(self, cell: str, role: str = ROLLOUT) -> None:
        url = self.config.cells[cell] if role == ROLLOUT else ""
        self.publish(RoleChanged(cell, role, "", url, 0, 0.0, 0, False))

    async def agent(self, execution_id: str) -> openai.AsyncOpenAI:
        key = await self.ask("proxy", IssueKey(execution_id, "group-0"))
        return openai.AsyncOpenAI(base_url=key.openai_base_url, api_key=key.api_key, max_retries=0, timeout=300)

    async def switch_to_train(self, cell: str, targets: tuple[str, ...], migrate: bool) -> SessionsMigrated | None:
        """What a cell does on SwitchRole(train): drain, (migrate), change role."""
        self.publish(CellDraining(cell))
        migrated = None
        if migrate:
            wanted = {name: self.config.cells[name] for name in targets}
            request = MigrateSessions(cell, self.config.cells[cell], wanted, ())
            migrated = await self.ask("kv_migrator", request, timeout_s=120)
        self.announce(cell, TRAIN)
        return migrated


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def run(name: str, engines: dict[str, str], tiny_model_dir) -> Any:
    topology = Topology("migration-test", seed=0)
    http = ProxyHttpConfig(model_names=("gyre",), max_context_tokens=MAX_CONTEXT_TOKENS)
    topology.add("proxy", Proxy, ProxyConfig(model_dir=str(tiny_model_dir), http=http))
    topology.add("kv_migrator", KVMigrator, KVMigratorConfig())
    topology.add("driver", Driver, DriverConfig(name, dict(engines)))
    result = InProcessLauncher().run(topology, RunOptions(until_s=280))
    outcome = RESULTS.pop(name, None)
    if isinstance(outcome, Exception):
        raise outcome
    assert outcome is not None, f"the scenario did not finish: {result.reason}"
    return outcome


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


async def two_turns(driver: Driver, execution_id: str, rng: random.Random, between: Callable[[], Awaitable[Any]]):
    """An agent's first call, then `between()` (a role switch), then its next call; returns both records."""
    client = await driver.agent(execution_id)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": words(rng, 260)}]
    reply = await client.chat.completions.create(model="gyre", messages=messages, max_tokens=24, temperature=0)
    first = await driver.next_call()
    switched = await between()
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": words(rng, 8)},
    ]
    await client.chat.completions.create(model="gyre", messages=messages, max_tokens=8, temperature=0)
    second = await driver.next_call()
    return first, second, switched


@scenario
async def migration_against_reprefill(driver: Driver) -> dict[str, Any]:
    rng = random.Random(5)
    driver.announce("cell-a")
    driver.announce("cell-b")
    migrated_first, migrated_second, migrated = await two_turns(
        driver, "exec-m", rng, lambda: driver.switch_to_train("cell-a", ("cell-b",), migrate=True)
    )
    driver.announce("cell-a")  # back to rollout; it has no sessions, so the next new session lands there
    plain_first, plain_second, _ = await two_turns(
        driver, "exec-r", rng, lambda: driver.switch_to_train("cell-a", ("cell-b",), migrate=False)
    )
    async with aiohttp.ClientSession(headers=auth_headers()) as http:
        async with http.get(driver.config.cells["cell-a"] + "/get_load") as resp:
            exports_left = (await resp.json())["exports"]
    return {
        "migrator": await driver.ask("kv_migrator", StatisticsAsked()),
        "migrated": migrated,
        "migrated_calls": (migrated_first, migrated_second),
        "plain_calls": (plain_first, plain_second),
        "exports_left": exports_left,
    }


def _reuse(first: ModelCallCompleted, second: ModelCallCompleted) -> tuple[float, float]:
    """(cached / previous prompt + output, cached / next prompt)."""
    prefix = first.prompt_tokens + len(first.output_ids)
    return second.cached_tokens / prefix, second.cached_tokens / second.prompt_tokens


def test_migrated_session_finds_its_prefix_cached_on_the_new_cell(engines, tiny_model_dir) -> None:
    out = run("migration_against_reprefill", engines, tiny_model_dir)
    first, second = out["migrated_calls"]
    migrated: SessionsMigrated = out["migrated"]
    assert first.cell == "cell-a" and second.cell == "cell-b"
    assert migrated.source == "cell-a" and migrated.placement == {"exec-m/": "cell-b"}
    assert migrated.reprefill_sessions == 0
    prefix = first.prompt_tokens + len(first.output_ids)
    # The second call extends the first's whole prompt + output (its record carries only what follows).
    assert (second.extends_call, second.shared_tokens) == (first.call_index, prefix)
    # The source cached everything it computed (all but the last output token) in whole blocks; all of it moved.
    assert migrated.moved_tokens == (prefix - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert second.cached_tokens >= 0.9 * prefix
    assert out["exports_left"] == 0  # every export was released
    totals = out["migrator"]  # one migration asked (the second switch re-prefills): its figures are the totals
    assert (totals.migrations, totals.sessions_placed, totals.reprefill_sessions) == (1, 1, 0)
    assert totals.moved_tokens == migrated.moved_tokens and totals.partial_output_tokens == 0  # nothing in flight

    plain_first, plain_second = out["plain_calls"]
    assert plain_first.cell == "cell-a" and plain_second.cell == "cell-b"
    assert plain_second.cached_tokens < 0.1 * (plain_first.prompt_tokens + len(plain_first.output_ids))

    migrated_reuse, migrated_prompt_reuse = _reuse(first, second)
    plain_reuse, plain_prompt_reuse = _reuse(plain_first, plain_second)
    print(
        "\nMIGRATION "
        + json.dumps(
            {
                "prefix_tokens": prefix,
                "moved_tokens": migrated.moved_tokens,
                "migration_s": round(migrated.seconds, 4),
                "prefix_reuse_after_migration": round(migrated_reuse, 4),
                "prompt_reuse_after_migration": round(migrated_prompt_reuse, 4),
                "prefix_reuse_reprefill": round(plain_reuse, 4),
                "prompt_reuse_reprefill": round(plain_prompt_reuse, 4),
            }
        )
    )


@scenario
async def fallback_to_reprefill(driver: Driver) -> dict[str, Any]:
    """cell-c runs without --kv-transfer: its blocks cannot move, so the session is re-placed and re-prefilled."""
    rng = random.Random(6)
    driver.announce("cell-c")
    first, second, migrated = await two_turns(
        driver, "exec-f", rng, lambda: driver_switch_with_b(driver)
    )
    async with aiohttp.ClientSession(headers=auth_headers()) as http:
        async with http.get(driver.config.cells["cell-c"] + "/get_load") as resp:
            exports_left = (await resp.json())["exports"]
    return {"first": first, "second": second, "migrated": migrated, "exports_left": exports_left}


async def driver_switch_with_b(driver: Driver) -> SessionsMigrated | None:
    driver.announce("cell-b")
    return await driver.switch_to_train("cell-c", ("cell-b",), migrate=True)


def test_without_kv_transfer_the_session_is_placed_and_reprefilled(engines, tiny_model_dir) -> None:
    out = run("fallback_to_reprefill", engines, tiny_model_dir)
    migrated: SessionsMigrated = out["migrated"]
    assert out["first"].cell == "cell-c" and out["second"].cell == "cell-b"
    assert migrated.placement == {"exec-f/": "cell-b"}
    assert migrated.reprefill_sessions == 1 and migrated.moved_tokens == 0
    assert out["exports_left"] == 0  # the export that could not be read was released
    assert out["second"].cached_tokens < 0.1 * out["second"].prompt_tokens
