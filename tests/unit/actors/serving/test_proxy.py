"""The proxy actor on the bus: keys, routing over real engine servers, waiting for cells, sessions' prefixes.

The cells are real embedded engine servers (`python -m gyre.engines.engine_server`, one process each, on the tiny
model), announced to the proxy by a driver actor with the messages a cell publishes; the agent is the real
`openai` SDK. Nothing between the SDK and the engines is faked. Each test runs one topology (proxy + driver) with
the in-process launcher; the driver runs the scenario and stores what it saw.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import traceback
from typing import Any, Awaitable, Callable

import aiohttp
import attrs
import openai
import pytest

from gyre.actors.serving.proxy import Proxy, ProxyConfig
from gyre.actors.serving.routing import RoutingConfig
from gyre.actors.serving.http_app import ProxyHttpConfig
from gyre.engines.sglang_client import SGLangClient
from gyre.messages.cells import (
    ROLLOUT, TRAIN, CellDraining, EngineServerFailed, LoadReport, RoleChanged, SessionPlaced,
)
from gyre.messages.executions import IssueKey, KeyIssued, RevokeKey
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.proxy import CallsWaitingForCell, ProxyStatistics, SessionPrefixes, SessionsOnCell
from gyre.messages.runtime_control import StatisticsAsked
from gyre.policies.routing import StickyLeastLoaded
from gyre.policies.trajectory_tree import rebuild_prompts
from gyre.runtime import Actor, Codec, InProcessLauncher, RunOptions, Topology, handler, read_log
from gyre.runtime.config_codec import decode_config
from gyre.runtime.run_secrets import run_token

MAX_CONTEXT_TOKENS = 2048
WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud ember field".split()


def engine_auth() -> dict[str, str]:
    """The header the engine servers of this module check (see `engines`)."""
    return {"Authorization": f"Bearer {run_token('engine')}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory, engine_servers) -> dict[str, str]:
    """Two engine servers (cells "cell-a" and "cell-b"), each in its own process; yields name -> base URL."""
    flags = ["--max-context", str(MAX_CONTEXT_TOKENS)]
    with engine_servers(tiny_model_dir, tmp_path_factory.mktemp("engine-logs"),
                        {"cell-a": flags, "cell-b": flags}) as urls:
        yield urls


# ---- the driver ------------------------------------------------------------------------------------------------

Scenario = Callable[["Driver"], Awaitable[Any]]
SCENARIOS: dict[str, Scenario] = {}
RESULTS: dict[str, Any] = {}


@attrs.frozen
class DriverConfig:
    scenario: str
    cells: dict[str, str]
    stop_token_ids: tuple[int, ...] = ()
    """The chat template's stop tokens, for reference generations straight to an engine."""


class Driver(Actor):
    """Plays the cells' announcements and the executor's key requests, and runs the agent (the openai SDK)."""

    config_cls = DriverConfig
    subscriptions = (ModelCallCompleted, CallsWaitingForCell)

    async def on_start(self) -> None:
        self.calls: list[ModelCallCompleted] = []
        self.waiting_for_cell: list[int] = []
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

    @handler(CallsWaitingForCell)
    def on_waiting(self, msg: CallsWaitingForCell) -> None:
        self.waiting_for_cell.append(msg.calls)

    @handler(ModelCallCompleted)
    def on_call(self, msg: ModelCallCompleted) -> None:
        self.calls.append(msg)
        self.arrived.set()

    async def wait_calls(self, count: int, timeout_s: float = 120.0) -> list[ModelCallCompleted]:
        async def until() -> None:
            while len(self.calls) < count:
                self.arrived.clear()
                await self.arrived.wait()

        await asyncio.wait_for(until(), timeout_s)
        return self.calls

    def announce(self, cell: str, role: str = ROLLOUT) -> None:
        url = self.config.cells[cell] if role == ROLLOUT else ""
        self.publish(RoleChanged(cell, role, "", url, 0, 0.0, 0, False))

    async def agent(self, execution_id: str) -> tuple[KeyIssued, openai.AsyncOpenAI]:
        key = await self.ask("proxy", IssueKey(execution_id, "group-0"))
        client = openai.AsyncOpenAI(base_url=key.openai_base_url, api_key=key.api_key, max_retries=0, timeout=300)
        return key, client

    async def status(self) -> ProxyStatistics:
        return await self.ask("proxy", StatisticsAsked())


def scenario(fn: Scenario) -> Scenario:
    SCENARIOS[fn.__name__] = fn
    return fn


def run(scenario_name: str, engines: dict[str, str], tiny_model_dir, log_path: str | None = None, **routing: Any) -> Any:
    from gyre.engines.chat_template import ChatTemplate

    stop_ids = tuple(ChatTemplate.from_model_dir(tiny_model_dir).stop_token_ids)
    topology = Topology("proxy-test", seed=0)
    config = ProxyConfig(
        model_dir=str(tiny_model_dir),
        http=ProxyHttpConfig(model_names=("gyre",), max_context_tokens=MAX_CONTEXT_TOKENS, default_max_tokens=16),
        routing=RoutingConfig(**routing),
    )
    topology.add("proxy", Proxy, config)
    topology.add("driver", Driver, DriverConfig(scenario_name, dict(engines), stop_ids))
    result = InProcessLauncher().run(topology, RunOptions(log_path=log_path, until_s=280))
    outcome = RESULTS.pop(scenario_name, None)
    if isinstance(outcome, Exception):
        raise outcome
    assert outcome is not None, f"the scenario did not finish: {result.reason}"
    return outcome


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def chat(client: openai.AsyncOpenAI, messages: list[dict], max_tokens: int = 8) -> Any:
    return await client.chat.completions.create(
        model="gyre", messages=messages, max_tokens=max_tokens, temperature=0
    )


# ---- scenarios and tests ---------------------------------------------------------------------------------------


@scenario
async def keys_calls_and_revocation(driver: Driver) -> dict[str, Any]:
    driver.announce("cell-a")
    key, client = await driver.agent("exec-1")
    reply = await chat(client, [{"role": "user", "content": "hello there"}])
    [call] = await driver.wait_calls(1)
    try:
        await driver.ask("proxy", IssueKey("exec-1", "group-0"))
        duplicate = "accepted"
    except Exception as error:  # RemoteError carrying the proxy's ValueError
        duplicate = str(error)
    driver.tell("proxy", RevokeKey("exec-1"))
    try:
        await chat(client, [{"role": "user", "content": "hello again"}])
        after_revoke = "answered"
    except openai.AuthenticationError:
        after_revoke = "401"
    return {"key": key, "reply": reply, "call": call, "duplicate": duplicate, "after_revoke": after_revoke,
            "status": await driver.status()}


def test_keys_calls_and_revocation(engines, tiny_model_dir) -> None:
    out = run("keys_calls_and_revocation", engines, tiny_model_dir)
    key: KeyIssued = out["key"]
    assert key.openai_base_url.startswith("http://127.0.0.1:") and key.openai_base_url.endswith("/v1")
    assert key.anthropic_base_url == key.openai_base_url[: -len("/v1")] == out["status"].base_url
    call: ModelCallCompleted = out["call"]
    assert call.execution_id == "exec-1" and call.group_id == "group-0" and call.cell == "cell-a"
    assert len(call.output_ids) == out["reply"].usage.completion_tokens > 0
    assert call.prompt_tokens == out["reply"].usage.prompt_tokens
    # The execution's first call extends none: its record carries the whole prompt.
    assert call.extends_call == -1 and len(call.new_prompt_ids) == call.prompt_tokens
    assert len(call.output_logprobs) == len(call.output_versions) == len(call.output_ids)
    assert "already has a key" in out["duplicate"]
    assert out["after_revoke"] == "401"
    assert out["status"].calls_completed == 1 and out["status"].sessions == 0  # revoked sessions are forgotten


@scenario
async def sessions_stick_and_spread(driver: Driver) -> dict[str, Any]:
    driver.announce("cell-a")
    driver.announce("cell-b")
    rng = random.Random(11)
    agents = [await driver.agent(f"exec-{i}") for i in range(4)]
    firsts = [
        [{"role": "user", "content": text(rng, 60)}] for _ in agents
    ]
    replies = []
    for (_, client), messages in zip(agents, firsts):  # one after another: placement sees each new session
        replies.append(await chat(client, messages))
    seconds = []
    for (_, client), messages, reply in zip(agents, firsts, replies):
        follow = messages + [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": text(rng, 5)},
        ]
        seconds.append(chat(client, follow))
    await asyncio.gather(*seconds)
    calls = await driver.wait_calls(8)
    return {"calls": list(calls), "status": await driver.status()}


def test_sessions_stick_to_their_cell_and_new_ones_spread(engines, tiny_model_dir) -> None:
    out = run("sessions_stick_and_spread", engines, tiny_model_dir)
    by_execution: dict[str, list[ModelCallCompleted]] = {}
    for call in out["calls"]:
        by_execution.setdefault(call.execution_id, []).append(call)
    cells = {e: [c.cell for c in sorted(calls, key=lambda c: c.call_index)] for e, calls in by_execution.items()}
    assert all(first == second for first, second in cells.values()), cells
    assert sorted(first for first, _ in cells.values()) == ["cell-a", "cell-a", "cell-b", "cell-b"]
    for calls in by_execution.values():
        first, second = sorted(calls, key=lambda c: c.call_index)
        # The second record names the first and carries only what follows its prompt + output.
        assert second.extends_call == first.call_index
        assert second.shared_tokens == first.prompt_tokens + len(first.output_ids)
        first_prompt, second_prompt = rebuild_prompts([first, second])
        assert second_prompt[: len(first_prompt) + len(first.output_ids)] == first_prompt + first.output_ids
        # The second call found the first call's prompt + output cached on the same cell (whole blocks of 16).
        assert second.cached_tokens >= (first.prompt_tokens + len(first.output_ids) - 1) // 16 * 16
    assert out["status"].sessions_by_cell == {"cell-a": 2, "cell-b": 2}


@scenario
async def draining_cell_gets_no_new_calls(driver: Driver) -> dict[str, Any]:
    driver.announce("cell-a")
    driver.announce("cell-b")
    rng = random.Random(12)
    _, first_client = await driver.agent("exec-a")
    messages = [{"role": "user", "content": text(rng, 20)}]
    reply = await chat(first_client, messages)  # a new session on equal cells: cell-a (name breaks the tie)
    driver.publish(CellDraining("cell-a"))
    # A load report that still says "rollout" (the cell drains before its role changes) must not undo draining.
    driver.publish(LoadReport("cell-a", ROLLOUT, driver.config.cells["cell-a"], 1, 0, 0, 400, 512, 64, 0, 0.0))
    follow = messages + [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "and then?"},
    ]
    await chat(first_client, follow)
    _, second_client = await driver.agent("exec-b")
    await chat(second_client, [{"role": "user", "content": text(rng, 10)}])
    calls = await driver.wait_calls(3)
    return {"cells": [(c.execution_id, c.call_index, c.cell) for c in calls]}


def test_a_draining_cell_gets_no_new_calls(engines, tiny_model_dir) -> None:
    out = run("draining_cell_gets_no_new_calls", engines, tiny_model_dir)
    assert sorted(out["cells"]) == [("exec-a", 0, "cell-a"), ("exec-a", 1, "cell-b"), ("exec-b", 0, "cell-b")]


@scenario
async def failed_and_unreachable_engines_get_no_calls(driver: Driver) -> dict[str, Any]:
    # A cell whose engine refuses connections: the call waits (no other cell yet), then goes to the cell announced.
    dead_url = f"http://127.0.0.1:{free_port()}"
    driver.publish(RoleChanged("cell-dead", ROLLOUT, "", dead_url, 0, 0.0, 0, False))
    _, client = await driver.agent("exec-u")
    pending = asyncio.ensure_future(chat(client, [{"role": "user", "content": "anyone alive"}]))
    while (await driver.status()).engines_unreachable < 1:
        await asyncio.sleep(0.01)
    driver.announce("cell-a")
    await pending
    [first] = await driver.wait_calls(1)
    # A cell whose engine server failed (EngineServerFailed): its sessions and new ones go elsewhere.
    driver.announce("cell-b")
    _, client_f = await driver.agent("exec-f")
    messages = [{"role": "user", "content": "first turn"}]
    reply = await chat(client_f, messages)
    calls = await driver.wait_calls(2)
    holder = calls[-1].cell
    driver.publish(EngineServerFailed(holder, driver.config.cells[holder], "the server died", 137, ("killed",)))
    while not (await driver.status()).failed_cells:
        await asyncio.sleep(0.01)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                 {"role": "user", "content": "second turn"}]
    await chat(client_f, messages)
    _, client_n = await driver.agent("exec-n")
    await chat(client_n, [{"role": "user", "content": "a new session"}])
    calls = await driver.wait_calls(4)
    failed_status = await driver.status()
    driver.announce(holder)  # a rollout cell again (restarted): it takes calls again
    while (await driver.status()).failed_cells:
        await asyncio.sleep(0.01)
    return {"first": first, "holder": holder, "after": [c.cell for c in calls[2:4]], "failed": failed_status,
            "recovered": await driver.status()}


def test_failed_and_unreachable_engines_get_no_calls(engines, tiny_model_dir) -> None:
    out = run("failed_and_unreachable_engines_get_no_calls", engines, tiny_model_dir, no_cell_wait_s=60.0)
    assert out["first"].cell == "cell-a" and out["first"].finish_reason in ("stop", "length")
    other = "cell-b" if out["holder"] == "cell-a" else "cell-a"
    assert out["after"] == [other, other]  # the failed cell's session and a new one
    assert out["failed"].failed_cells == (out["holder"],) and out["failed"].engines_unreachable >= 1
    assert out["recovered"].failed_cells == () and out["failed"].calls_failed == 0


@scenario
async def calls_wait_for_a_rollout_cell(driver: Driver) -> dict[str, Any]:
    _, client = await driver.agent("exec-w")
    pending = asyncio.ensure_future(chat(client, [{"role": "user", "content": "is anyone there"}]))
    while (await driver.status()).in_flight < 1:  # the call reached the proxy and waits for a cell
        await asyncio.sleep(0.01)
    driver.announce("cell-b", TRAIN)  # a cell in another role does not help
    await asyncio.sleep(0.05)
    waiting = (await driver.status()).in_flight
    announced_while_waiting = list(driver.waiting_for_cell)
    driver.announce("cell-b")
    reply = await pending
    [call] = await driver.wait_calls(1)
    while len(driver.waiting_for_cell) < 3:
        await asyncio.sleep(0.01)
    return {"waiting": waiting, "reply": reply, "call": call, "status": await driver.status(),
            "announced_while_waiting": announced_while_waiting, "announced": list(driver.waiting_for_cell)}


def test_calls_wait_for_a_rollout_cell_instead_of_failing(engines, tiny_model_dir) -> None:
    out = run("calls_wait_for_a_rollout_cell", engines, tiny_model_dir)
    assert out["waiting"] == 1
    assert out["call"].cell == "cell-b"
    assert out["status"].waits_for_cell == 1 and out["status"].calls_failed == 0
    # The proxy told everyone a call waited for a cell (demand no cell could report), and that it stopped waiting.
    # (The first 0 is the proxy's own at start: a restarted proxy holds no call.)
    assert out["announced_while_waiting"] == [0, 1] and out["announced"] == [0, 1, 0]


@scenario
async def no_cell_in_time_is_a_503(driver: Driver) -> dict[str, Any]:
    _, client = await driver.agent("exec-x")
    try:
        await chat(client, [{"role": "user", "content": "hello"}])
        outcome = "answered"
    except openai.APIStatusError as error:
        outcome = error.status_code
    while len(driver.waiting_for_cell) < 3:
        await asyncio.sleep(0.01)
    return {"outcome": outcome, "status": await driver.status(), "announced": list(driver.waiting_for_cell)}


def test_no_cell_within_the_bound_answers_503(engines, tiny_model_dir) -> None:
    out = run("no_cell_in_time_is_a_503", engines, tiny_model_dir, no_cell_wait_s=0.2)
    assert out["outcome"] == 503
    assert out["status"].calls_failed == 1
    assert out["announced"] == [0, 1, 0]  # a call that gave up waiting no longer counts


@scenario
async def sessions_on_cell_and_placement(driver: Driver) -> dict[str, Any]:
    driver.announce("cell-a")
    driver.announce("cell-b")
    rng = random.Random(13)
    _, client = await driver.agent("exec-p")
    messages = [{"role": "user", "content": text(rng, 30)}]
    reply = await chat(client, messages, max_tokens=12)
    [first] = await driver.wait_calls(1)
    prefixes: SessionPrefixes = await driver.ask("proxy", SessionsOnCell(first.cell))
    elsewhere: SessionPrefixes = await driver.ask("proxy", SessionsOnCell("cell-b" if first.cell == "cell-a" else "cell-a"))
    [session] = prefixes.sessions
    other = "cell-b" if first.cell == "cell-a" else "cell-a"
    driver.publish(SessionPlaced(session, other))
    follow = messages + [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "more"},
    ]
    await chat(client, follow)
    calls = await driver.wait_calls(2)
    return {"first": first, "prefixes": prefixes, "elsewhere": elsewhere, "second": calls[1], "other": other}


def test_sessions_on_cell_reports_latest_ids_and_placement_reroutes(engines, tiny_model_dir, tmp_path) -> None:
    log_path = tmp_path / "run.glog"
    out = run("sessions_on_cell_and_placement", engines, tiny_model_dir, log_path=str(log_path))
    first: ModelCallCompleted = out["first"]
    assert out["prefixes"].cell == first.cell
    assert first.extends_call == -1
    assert out["prefixes"].sessions == {"exec-p/": first.new_prompt_ids + first.output_ids}
    assert out["elsewhere"].sessions == {}
    assert out["second"].cell == out["other"]
    # The run is recorded: the proxy's config (policy included), the asks and their replies, and every
    # ModelCallCompleted the proxy published decode from the log.
    codec = Codec()
    records = [(record.envelope, record.decode(codec)) for record in read_log(log_path, codec)]
    replies = [msg for _, msg in records if isinstance(msg, SessionPrefixes)]
    assert replies[0] == out["prefixes"]
    published = [msg for envelope, msg in records if isinstance(msg, ModelCallCompleted) and envelope.receiver == "driver"]
    assert [m.call_index for m in published] == [0, 1]
    started = [msg for _, msg in records if type(msg).__name__ == "ActorStarted" and msg.actor == "proxy"]
    config = decode_config(started[0].config_blob)
    assert isinstance(config.routing.policy, StickyLeastLoaded)


@scenario
async def abort_on_a_live_cell_resumes_there(driver: Driver) -> dict[str, Any]:
    """An abort that is not a drain (a weight update in abort mode): the call resumes, on the same cell."""
    url = driver.config.cells["cell-a"]
    driver.announce("cell-a")
    _, client = await driver.agent("exec-r")
    messages = [{"role": "user", "content": "count with me: one two three"}]
    async with aiohttp.ClientSession(headers=engine_auth()) as http:

        async def generated() -> int:
            async with http.get(url + "/get_load") as resp:
                return (await resp.json())["generated_tokens_total"]

        before = await generated()
        pending = asyncio.ensure_future(chat(client, messages, max_tokens=400))
        while await generated() < before + 20 and not pending.done():
            await asyncio.sleep(0.005)
        async with http.post(url + "/pause_generation", json={"mode": "abort"}) as resp:
            paused = await resp.json()
        async with http.post(url + "/continue_generation", json={}) as resp:
            assert resp.status == 200
        reply = await pending
    [call] = await driver.wait_calls(1)
    # The unswitched reference: the same prompt straight to the engine, greedy.
    async with SGLangClient(url) as engine:
        assert call.extends_call == -1  # the only call: its record carries the whole prompt
        reference = await engine.generate(
            call.new_prompt_ids, {"max_new_tokens": 400, "temperature": 0.0, "stop_token_ids": list(driver.config.stop_token_ids)}
        )
    return {"paused": paused, "reply": reply, "call": call, "reference": reference, "status": await driver.status()}


def test_an_aborted_generation_resumes_and_completes_the_call(engines, tiny_model_dir) -> None:
    out = run("abort_on_a_live_cell_resumes_there", engines, tiny_model_dir, resume_grace_s=0.1)
    call: ModelCallCompleted = out["call"]
    assert out["paused"]["requests"] == 1, "the pause must have caught the generation mid-way"
    assert out["status"].resumed_generations == 1
    assert call.cell == "cell-a" and call.finish_reason in ("stop", "length")
    reference_ids = tuple(out["reference"]["output_ids"])
    assert call.output_ids == reference_ids  # greedy: resuming from prompt + partial output changes nothing
    assert len(call.output_logprobs) == len(call.output_versions) == len(call.output_ids)
    reference_logprobs = [entry[0] for entry in out["reference"]["meta_info"]["output_token_logprobs"]]
    assert call.output_logprobs == pytest.approx(reference_logprobs, abs=1e-3)


@scenario
async def streamed_abort_resumes_without_resending(driver: Driver) -> dict[str, Any]:
    """A streamed call aborted mid-way (as a switching cell does) resumes; the agent gets each piece once."""
    url = driver.config.cells["cell-a"]
    driver.announce("cell-a")
    _, client = await driver.agent("exec-s")
    messages = [{"role": "user", "content": "count with me: one two three"}]
    pieces: list[str] = []

    async def consume() -> None:
        stream = await client.chat.completions.create(
            model="gyre", messages=messages, max_tokens=400, temperature=0, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)

    async with aiohttp.ClientSession(headers=engine_auth()) as http:
        pending = asyncio.ensure_future(consume())
        while len(pieces) < 5 and not pending.done():
            await asyncio.sleep(0.005)
        before_abort = len(pieces)
        async with http.post(url + "/pause_generation", json={"mode": "abort"}) as resp:
            paused = await resp.json()
        async with http.post(url + "/continue_generation", json={}) as resp:
            assert resp.status == 200
        await pending
    [call] = await driver.wait_calls(1)
    async with SGLangClient(url) as engine:
        assert call.extends_call == -1  # the only call: its record carries the whole prompt
        reference = await engine.generate(
            call.new_prompt_ids,
            {"max_new_tokens": 400, "temperature": 0.0, "stop_token_ids": list(driver.config.stop_token_ids)},
        )
    return {"paused": paused, "pieces": pieces, "before_abort": before_abort, "call": call, "reference": reference,
            "status": await driver.status()}


def test_a_streamed_call_resumes_after_an_abort_without_resending_text(engines, tiny_model_dir) -> None:
    from gyre.engines.chat_template import ChatTemplate

    out = run("streamed_abort_resumes_without_resending", engines, tiny_model_dir, resume_grace_s=0.1)
    call: ModelCallCompleted = out["call"]
    assert out["paused"]["requests"] == 1, "the pause must have caught the generation mid-way"
    assert out["status"].resumed_generations == 1 and out["before_abort"] >= 5
    assert call.output_ids == tuple(out["reference"]["output_ids"])  # greedy: the same turn as unswitched
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    ids = list(call.output_ids)
    if ids and ids[-1] in template.stop_token_ids:
        ids.pop()
    assert "".join(out["pieces"]) == template.decode(ids)  # nothing sent twice, nothing missing



def call_in_thread(base_url: str, api_key: str, outcome: dict[str, Any]) -> threading.Thread:
    """A call through the synchronous SDK on its own thread, so that it outlives the topology it calls into."""

    def call() -> None:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
        try:
            client.chat.completions.create(model="gyre", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            outcome["result"] = "answered"
        except openai.APIStatusError as error:
            outcome["result"] = (error.status_code, str(error))
        except openai.APIError as error:
            outcome["result"] = type(error).__name__

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


async def call_then_stop(driver: Driver, cell: str | None) -> dict[str, Any]:
    """Start a call (on `cell` if given, else with no rollout cell at all) and return, which stops the topology
    while the call waits for a cell or retries an engine that is gone."""
    if cell is not None:
        driver.announce(cell)
    key, _ = await driver.agent("exec-stop")
    outcome: dict[str, Any] = {}
    thread = call_in_thread(key.openai_base_url, key.api_key, outcome)
    # Counted in flight is not enough: its body may still be on the way, and aiohttp drops what arrives once the
    # server shuts down (that call ends with a closed connection, which the SDKs retry; see proxy.py's doc).
    if cell is None:
        while not driver.waiting_for_cell or driver.waiting_for_cell[-1] < 1:
            await asyncio.sleep(0.01)
    else:
        while (await driver.status()).resumed_generations < 1:  # the engine is unreachable: the call retries
            await asyncio.sleep(0.01)
    return {"thread": thread, "outcome": outcome}


@scenario
async def stopping_with_a_call_waiting_for_a_cell(driver: Driver) -> dict[str, Any]:
    return await call_then_stop(driver, None)


@scenario
async def stopping_with_a_call_retrying_a_gone_engine(driver: Driver) -> dict[str, Any]:
    return await call_then_stop(driver, "cell-gone")


@pytest.mark.parametrize(
    "scenario_name", ["stopping_with_a_call_waiting_for_a_cell", "stopping_with_a_call_retrying_a_gone_engine"]
)
def test_stopping_answers_calls_that_wait_or_retry_with_503(engines, tiny_model_dir, scenario_name) -> None:
    """At the end of a run the engines stop with the proxy; a call that waits for a cell or retries a gone engine
    must get a 503 at once rather than hold the proxy's server open until the launcher kills the process."""
    cells = {**engines, "cell-gone": f"http://127.0.0.1:{free_port()}"}  # nothing listens there
    out = run(scenario_name, cells, tiny_model_dir, no_cell_wait_s=250, resume_grace_s=0.05, max_resumes=10_000)
    out["thread"].join(timeout=120)
    result = out["outcome"].get("result")
    assert isinstance(result, tuple) and result[0] == 503, result
    assert "the proxy is stopping" in result[1], result
