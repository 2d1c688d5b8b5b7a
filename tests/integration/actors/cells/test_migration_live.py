"""A role switch under a live call: the generation on the draining cell is paused, its session migrated, the
generation aborted, and the proxy completes the agent's open HTTP call on the other cell.

Two real engine servers with --kv-transfer (cell-a, cell-b), the proxy and KV migrator actors, and a driver actor
that plays cell-a's switch to training the way the cell does it: pause in place at a token boundary, CellDraining,
MigrateSessions, abort, RoleChanged. The agent is the real `openai` SDK; its call must come back complete, with the
tokens of an unswitched run (greedy decoding), served last by cell-b from the migrated prefix.
"""

from __future__ import annotations

import asyncio
import traceback
from typing import Any, Awaitable, Callable

import aiohttp
import attrs
import openai
import pytest

from gyre.actors.cells.kv_migrator import KVMigrator, KVMigratorConfig
from gyre.actors.serving.proxy import Proxy, ProxyConfig
from gyre.actors.serving.http_app import ProxyHttpConfig
from gyre.engines.sglang_client import SGLangClient, auth_headers
from gyre.messages.cells import ROLLOUT, TRAIN, CellDraining, MigrateSessions, RoleChanged, SessionsMigrated
from gyre.messages.executions import IssueKey
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.proxy import ProxyStatistics
from gyre.messages.runtime_control import StatisticsAsked
from gyre.runtime import Actor, InProcessLauncher, RunOptions, Topology, handler

MAX_CONTEXT_TOKENS = 2048
BLOCK_TOKENS = 16
MAX_TOKENS = 300
PAUSE_AFTER_TOKENS = 40


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory, engine_servers) -> dict[str, str]:
    flags = ["--max-context", str(MAX_CONTEXT_TOKENS), "--block-size", str(BLOCK_TOKENS), "--kv-transfer"]
    with engine_servers(tiny_model_dir, tmp_path_factory.mktemp("engine-logs"),
                        {"cell-a": flags, "cell-b": flags}) as urls:
        yield urls


SCENARIOS: dict[str, Callable[["Driver"], Awaitable[Any]]] = {}
RESULTS: dict[str, Any] = {}


@attrs.frozen
class DriverConfig:
    scenario: str
    cells: dict[str, str]
    stop_token_ids: tuple[int, ...]
    """The chat template's stop tokens, for the reference generation straight to an engine."""


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
    from gyre.engines.chat_template import ChatTemplate

    stop_ids = tuple(ChatTemplate.from_model_dir(tiny_model_dir).stop_token_ids)
    topology = Topology("live-migration-test", seed=0)
    http = ProxyHttpConfig(model_names=("gyre",), max_context_tokens=MAX_CONTEXT_TOKENS)
    topology.add("proxy", Proxy, ProxyConfig(model_dir=str(tiny_model_dir), http=http))
    topology.add("kv_migrator", KVMigrator, KVMigratorConfig())
    topology.add("driver", Driver, DriverConfig(name, dict(engines), stop_ids))
    result = InProcessLauncher().run(topology, RunOptions(until_s=280))
    outcome = RESULTS.pop(name, None)
    if isinstance(outcome, Exception):
        raise outcome
    assert outcome is not None, f"the scenario did not finish: {result.reason}"
    return outcome



@scenario
async def switch_under_a_live_call(driver: Driver) -> dict[str, Any]:
    url_a, url_b = driver.config.cells["cell-a"], driver.config.cells["cell-b"]
    driver.announce("cell-a")
    driver.announce("cell-b")
    client = await driver.agent("exec-live")
    messages = [{"role": "user", "content": "count with me: one two three"}]
    async with aiohttp.ClientSession(headers=auth_headers()) as http:

        async def post(url: str, path: str, body: dict) -> dict:
            async with http.post(url + path, json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        async def load(url: str) -> dict:
            async with http.get(url + "/get_load") as resp:
                return await resp.json()

        before_a = (await load(url_a))["generated_tokens_total"]
        call = asyncio.ensure_future(
            client.chat.completions.create(model="gyre", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        )
        while (await load(url_a))["generated_tokens_total"] < before_a + PAUSE_AFTER_TOKENS and not call.done():
            await asyncio.sleep(0.005)
        # cell-a's switch to training, step by step.
        paused = await post(url_a, "/pause_generation", {"mode": "in_place"})
        driver.publish(CellDraining("cell-a"))
        request = MigrateSessions("cell-a", url_a, {"cell-b": url_b}, ())
        migrated = await driver.ask("kv_migrator", request, timeout_s=120)
        cached_b_before = (await load(url_b))["cached_tokens_total"]
        aborted = await post(url_a, "/abort_request", {"rid": "exec-live/0"})
        driver.announce("cell-a", TRAIN)
        reply = await call
        record = await driver.next_call()
        cached_b_after = (await load(url_b))["cached_tokens_total"]
        await post(url_a, "/continue_generation", {})
    status: ProxyStatistics = await driver.ask("proxy", StatisticsAsked())
    # The unswitched run: the same prompt, greedy, on one engine from start to end.
    async with SGLangClient(url_b) as engine:
        params = {"max_new_tokens": MAX_TOKENS, "temperature": 0.0, "stop_token_ids": list(driver.config.stop_token_ids)}
        assert record.extends_call == -1  # the execution's only call: its record carries the whole prompt
        reference = await engine.generate(record.new_prompt_ids, params, rid="reference")
    return {
        "paused": paused,
        "migrated": migrated,
        "aborted": aborted,
        "reply": reply,
        "record": record,
        "resumed_cached_tokens": cached_b_after - cached_b_before,
        "status": status,
        "reference": reference,
    }


def test_a_live_call_survives_the_switch_with_unchanged_tokens(engines, tiny_model_dir) -> None:
    out = run("switch_under_a_live_call", engines, tiny_model_dir)
    assert out["paused"]["requests"] == 1 and out["aborted"]["aborted"] == 1, "the switch must catch the call mid-way"
    migrated: SessionsMigrated = out["migrated"]
    record: ModelCallCompleted = out["record"]
    assert migrated.placement == {"exec-live/": "cell-b"} and migrated.reprefill_sessions == 0
    # In flight, the proxy knows the session's prompt: its whole blocks moved (A had computed them all).
    prompt_blocks = record.prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS
    assert migrated.moved_tokens == prompt_blocks
    # The resumed generation (prompt + partial output) found the migrated prompt in cell-b's cache.
    assert out["resumed_cached_tokens"] >= prompt_blocks
    assert out["status"].resumed_generations == 1 and out["status"].calls_failed == 0
    assert record.cell == "cell-b"
    reference = out["reference"]
    assert record.output_ids == tuple(reference["output_ids"])
    assert len(record.output_ids) > PAUSE_AFTER_TOKENS
    assert record.finish_reason == reference["meta_info"]["finish_reason"]["type"]
    assert out["reply"].usage.completion_tokens == len(record.output_ids)
    assert len(record.output_logprobs) == len(record.output_versions) == len(record.output_ids)
    reference_logprobs = [entry[0] for entry in reference["meta_info"]["output_token_logprobs"]]
    assert record.output_logprobs == pytest.approx(reference_logprobs, abs=1e-3)
