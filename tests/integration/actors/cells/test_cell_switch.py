"""Role switches of a cell with a live engine, under agent calls, with the real proxy and KV migrator.

Two satellites serve rollouts, a core trains (no samples come, so it only waits), the proxy fronts four agent
sessions (the openai SDK) and the KV migrator moves sessions between the cells. Each round, the agents make one
more call each (their sessions stick to a cell), and while those calls generate the cell holding the sessions is
switched to training and back. Checked:
- every agent call completes (none lost, none failed) and its tokens equal an unswitched call's, with sampling on
  (temperature 1.0, a seed per agent): the switch comes once the calls have generated a few blocks, the migrator
  moves prompt + partial output, and the proxy resumes each cut call on the new cell from its partial output;
- the switch announces itself in order: CellDraining, SessionPlaced for the moved sessions, RoleChanged(train),
  then RoleChanged(rollout) with a working server;
- the switched cell holds no engine memory while it trains and no trainer once it is back.
The switch latencies each way are printed (run with -s) and their medians checked to be finite and positive.

And the colocate baseline's switch, with no other rollout cell: the only rollout cell trains without migrating, the
agents' calls wait at the proxy, and they complete (with an unswitched run's tokens) once the cell rolls out again.
"""

from __future__ import annotations

import asyncio
import random
import statistics

import openai
import pytest
import torch

from gyre.actors.cells.cell import Cell, CellConfig
from gyre.actors.cells.kv_migrator import KVMigrator, KVMigratorConfig
from gyre.actors.training.microstep_claimer import ClaimerConfig, MicroStepClaimer
from gyre.actors.serving.proxy import Proxy, ProxyConfig
from gyre.actors.serving.http_app import ProxyHttpConfig
from gyre.actors.cells.weight_broker import WeightBroker
from gyre.engines.chat_template import ChatTemplate
from gyre.engines.embedded_engine import EngineConfig
from gyre.engines.sglang_client import SGLangClient
from gyre.engines.trainer import TrainerConfig
from gyre.messages.cells import ROLLOUT, TRAIN, CellDraining, LoadReport, RoleChanged, SessionPlaced, SwitchRole
from gyre.messages.executions import ExecutionEnded, IssueKey
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.runtime_control import StatisticsAsked
from gyre.runtime import Actor, Topology, handler
from gyre.runtime.testing import run_actors

ROUNDS = 3
AGENTS = 4
MAX_TOKENS = 96
TEMPERATURE = 1.0
SEEDS = tuple(1000 + 7 * i for i in range(AGENTS))
WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud ember field".split()


class Recorder(Actor):
    """Keeps (time, message) of every announcement it hears."""

    subscriptions = (RoleChanged, CellDraining, SessionPlaced, ModelCallCompleted, LoadReport)

    async def on_start(self) -> None:
        self.events: list = []
        self.loads: dict[str, LoadReport] = {}

    @handler(LoadReport)
    def on_load(self, msg: LoadReport) -> None:
        self.loads[msg.cell] = msg

    @handler(RoleChanged, CellDraining, SessionPlaced, ModelCallCompleted)
    def on_event(self, msg) -> None:
        self.events.append((self.clock.now(), msg))

    def of(self, kind, **fields) -> list:
        return [m for _, m in self.events if isinstance(m, kind)
                and all(getattr(m, k) == v for k, v in fields.items())]


def whole_prompts(calls) -> dict:
    """(execution, call index) -> whole prompt of the proxy's records (which carry only the ids after the earlier
    call they extend)."""
    from gyre.policies.trajectory_tree import rebuild_prompts

    return {(c.execution_id, c.call_index): p for c, p in zip(calls, rebuild_prompts(calls))}

def topology(model_dir: str, rollout_cells: tuple[str, ...] = ("cell-a", "cell-b"),
             engine_kind: str = "embedded") -> Topology:
    engine = EngineConfig(num_blocks=256, max_context_tokens=1024, max_prefill_tokens=512, num_threads=1)
    cells = dict(model_dir=model_dir, engine=engine, trainer=TrainerConfig(num_threads=1), report_interval_s=0.25,
                 engine_kind=engine_kind)
    result = Topology("switch", seed=0)
    result.add("recorder", Recorder)
    result.add("proxy", Proxy, ProxyConfig(model_dir=model_dir, http=ProxyHttpConfig(
        max_context_tokens=1024, default_max_tokens=MAX_TOKENS)))
    result.add("kv_migrator", KVMigrator, KVMigratorConfig())
    result.add("claimer", MicroStepClaimer, ClaimerConfig(groups_per_step=1, group_size=4, retry_after_s=0.1))
    result.add("weight_broker", WeightBroker)
    result.add("core", Cell, CellConfig(is_core=True, initial_role=TRAIN, **cells))
    # cell-a prepares its training runtime in the background as it starts; its switches must work all the same.
    if "cell-a" in rollout_cells:
        result.add("cell-a", Cell, CellConfig(initial_role=ROLLOUT, prepare_trainer_at_start=True, **cells))
    if "cell-b" in rollout_cells:
        result.add("cell-b", Cell, CellConfig(initial_role=ROLLOUT, **cells))
    return result


async def engine_load(url: str) -> tuple[int, int]:
    """(running + waiting requests, tokens generated so far) from the engine server's statistics record."""
    async with SGLangClient(url) as client:
        load = await client._get("/get_load")
    return int(load["running"]) + int(load["waiting"]), int(load["generated_tokens_total"])


@pytest.fixture(scope="module", params=["embedded", "server"])
def switched(request, tiny_model_dir):
    """The switch rounds, with engines in the cells' processes and as engine server child processes (driven only
    over HTTP)."""
    torch.set_num_threads(1)
    rng = random.Random(3)
    stop_ids = ChatTemplate.from_model_dir(tiny_model_dir).stop_token_ids

    async def driver(h):
        recorder = h.actor("recorder")
        await h.wait_until(lambda: len(recorder.of(RoleChanged)) >= 3, timeout_s=180, what="cells up")
        clients = []
        for i in range(AGENTS):
            key = await h.ask("proxy", IssueKey(f"exec-{i}", "group-0"))
            clients.append(openai.AsyncOpenAI(base_url=key.openai_base_url, api_key=key.api_key, max_retries=0,
                                              timeout=300))
        conversations = [[{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(40))}]
                         for _ in range(AGENTS)]
        rounds = []
        for round_index in range(ROUNDS):
            urls = {m.cell: m.engine_url for m in recorder.of(RoleChanged) if m.role == ROLLOUT}
            latest = {c: recorder.of(RoleChanged, cell=c)[-1] for c in ("cell-a", "cell-b")}
            serving = [c for c in sorted(latest) if latest[c].role == ROLLOUT]
            generated_before = {c: (await engine_load(urls[c]))[1] for c in serving}
            calls = [asyncio.ensure_future(client.chat.completions.create(
                model="gyre", messages=list(messages), max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=seed))
                for client, messages, seed in zip(clients, conversations, SEEDS)]
            # The cell to switch: the one whose engine is busy with the sessions' calls, once they have generated
            # a KV block each (so that partial output really moves), early enough that they are still generating
            # when a server cell, which drains over HTTP, pauses them.
            source = None
            for _ in range(2000):
                loads = {c: await engine_load(urls[c]) for c in serving}
                busy = [c for c, (n, generated) in sorted(loads.items())
                        if n > 0 and generated - generated_before[c] >= 20 * n]
                if busy:
                    source = max(busy, key=lambda c: loads[c][0])
                    break
                await asyncio.sleep(0.01)
            assert source is not None, "no cell got busy"
            mark = len(recorder.events)
            partial_before = h.actor("kv_migrator").partial_output_tokens
            resumed_before = (await h.ask("proxy", StatisticsAsked())).resumed_generations
            before = len(recorder.of(RoleChanged, cell=source))
            h.tell(source, SwitchRole(source, TRAIN, "test"))
            await h.wait_until(lambda: len(recorder.of(RoleChanged, cell=source)) > before,
                               timeout_s=120, what="switch to train")
            training = await h.ask(source, StatisticsAsked())
            replies = await asyncio.gather(*calls)
            h.tell(source, SwitchRole(source, ROLLOUT, "test"))
            await h.wait_until(lambda: len(recorder.of(RoleChanged, cell=source)) > before + 1,
                               timeout_s=120, what="switch back")
            back = await h.ask(source, StatisticsAsked())
            async with SGLangClient(back.engine_url) as client:
                served = await client.generate([5, 6, 7], {"max_new_tokens": 2, "temperature": 0.0})
            for messages, reply in zip(conversations, replies):
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(8))})
            partial = h.actor("kv_migrator").partial_output_tokens - partial_before
            cut = (await h.ask("proxy", StatisticsAsked())).resumed_generations - resumed_before
            rounds.append({"source": source, "events": [m for _, m in recorder.events[mark:]], "partial": partial,
                           "cut": cut,
                           "training": training, "back": back, "served": served, "replies": replies})
        last = rounds[-1]["source"]
        other = "cell-a" if last == "cell-b" else "cell-b"
        # Reports come every 0.25 s and a round can take less: one from before the last switch back (or from while
        # the migrator was still placing sessions) would count the wrong cells. And a report from while the test's
        # own 2-token request ran on `last` would count that request as live. So wait for reports made after the
        # switch back, of idle engines: their live_sessions are the sessions each cell holds.
        back_at = max(t for t, m in recorder.events if isinstance(m, RoleChanged) and m.cell == last)

        def settled(cell: str) -> bool:
            load = recorder.loads[cell]
            return load.time_s > back_at and load.running_requests == load.waiting_requests == 0

        await h.wait_until(lambda: recorder.loads[last].role == ROLLOUT and settled(last) and settled(other),
                           timeout_s=30, what="load reports after the last switch")
        live = {cell: recorder.loads[cell].live_sessions for cell in (last, other)}
        # The agents are done: once the executor says so, no cell counts their sessions as live (the TTL is long).
        for index in range(AGENTS):
            h.publish(ExecutionEnded(f"exec-{index}", "test"))
        await h.wait_until(lambda: recorder.loads[other].live_sessions == 0, timeout_s=30,
                           what="live sessions after ExecutionEnded")
        switched_calls = [m for m in recorder.of(ModelCallCompleted) if m.execution_id.startswith("exec-")]
        proxy_status = await h.ask("proxy", StatisticsAsked())
        # The unswitched run: every call's exact prompt ids and seed again, straight to an engine nothing disturbs.
        url = (await h.ask("cell-a", StatisticsAsked())).engine_url
        references = {}
        prompts = whole_prompts(switched_calls)
        async with SGLangClient(url) as client:
            for call in switched_calls:
                seed = SEEDS[int(call.execution_id.removeprefix("exec-"))]
                prompt = prompts[(call.execution_id, call.call_index)]
                out = await client.generate(prompt, {
                    "max_new_tokens": MAX_TOKENS, "temperature": TEMPERATURE, "sampling_seed": seed,
                    "stop_token_ids": list(stop_ids)}, return_logprob=True)
                references[prompt] = (tuple(out["output_ids"]),
                                      tuple(e[0] for e in out["meta_info"]["output_token_logprobs"]))
        return {"rounds": rounds, "switched_calls": switched_calls, "references": references, "prompts": prompts,
                "proxy": proxy_status, "live": live, "last": last, "other": other}

    run = run_actors(topology(str(tiny_model_dir), engine_kind=request.param), driver, transport="zmq",
                     timeout_s=500)
    assert run.stop_reason is None, run.stop_reason
    return run.value


def test_no_call_lost_and_tokens_match_an_unswitched_run(switched):
    rounds = switched["rounds"]
    for r in rounds:
        assert all(reply.choices[0].finish_reason in ("stop", "length") for reply in r["replies"])
    assert switched["proxy"].calls_failed == 0 and switched["proxy"].calls_rejected == 0
    assert switched["proxy"].resumed_generations >= 1  # calls really were cut and continued elsewhere
    done = switched["switched_calls"]
    assert len(done) == ROUNDS * AGENTS
    for call in done:
        reference_ids, reference_logprobs = switched["references"][switched["prompts"][(call.execution_id,
                                                                                        call.call_index)]]
        assert call.output_ids == reference_ids
        assert call.output_logprobs == pytest.approx(reference_logprobs, abs=1e-3)


def test_partial_output_moves_with_the_session(switched):
    # A switch that cut calls while they generated (they were resumed on the other cell) moved their partial
    # output's KV with the sessions. The test switches while the calls generate, but a call may end before the
    # cell pauses it (a server cell drains over HTTP): such a round cuts nothing and has nothing to move.
    rounds = switched["rounds"]
    assert any(r["cut"] > 0 for r in rounds), [(r["cut"], r["partial"]) for r in rounds]
    assert all(r["partial"] > 0 for r in rounds if r["cut"] > 0), [(r["cut"], r["partial"]) for r in rounds]


def test_switch_announcements_in_order(switched):
    for r in switched["rounds"]:
        source, events = r["source"], r["events"]
        kinds = [(type(m).__name__, getattr(m, "cell", None), getattr(m, "role", None)) for m in events
                 if not isinstance(m, ModelCallCompleted)]
        draining = kinds.index(("CellDraining", source, None))
        to_train = kinds.index(("RoleChanged", source, TRAIN))
        to_rollout = kinds.index(("RoleChanged", source, ROLLOUT))
        placed = [i for i, k in enumerate(kinds) if k[0] == "SessionPlaced"]
        assert placed, "the migrator placed no session"
        assert draining < min(placed) and max(placed) < to_train < to_rollout
        assert all(m.cell != source for m in events if isinstance(m, SessionPlaced))
        changed = [m for m in events if isinstance(m, RoleChanged) and m.cell == source]
        assert changed[0].sessions_migrated >= 1 and changed[0].previous_role == ROLLOUT
        assert changed[1].engine_url and changed[1].previous_role == TRAIN


def test_memory_follows_the_role(switched):
    for r in switched["rounds"]:
        training, back = r["training"], r["back"]
        assert training.role == TRAIN and training.has_trainer and not training.has_engine_memory
        assert back.role == ROLLOUT and not back.has_trainer and back.has_engine_memory
        assert back.switches == training.switches + 1
        assert len(r["served"]["output_ids"]) == 2


def test_load_reports_count_the_sessions_a_cell_holds(switched):
    # The last switch moved every session to the other cell, whose engine then finished their calls.
    assert switched["live"] == {switched["other"]: AGENTS, switched["last"]: 0}


def test_switch_latencies(switched):
    to_train = [m.switch_s for r in switched["rounds"] for m in r["events"]
                if isinstance(m, RoleChanged) and m.cell == r["source"] and m.role == TRAIN]
    to_rollout = [m.switch_s for r in switched["rounds"] for m in r["events"]
                  if isinstance(m, RoleChanged) and m.cell == r["source"] and m.role == ROLLOUT]
    assert len(to_train) == len(to_rollout) == ROUNDS
    print(f"\nrollout->train s: {[round(s, 3) for s in to_train]} median {statistics.median(to_train):.3f}")
    print(f"train->rollout s: {[round(s, 3) for s in to_rollout]} median {statistics.median(to_rollout):.3f}")
    assert 0 < statistics.median(to_train) < 60 and 0 < statistics.median(to_rollout) < 60


def test_a_colocated_switch_holds_the_calls_until_a_cell_rolls_out_again(tiny_model_dir):
    torch.set_num_threads(1)
    rng = random.Random(5)
    stop_ids = ChatTemplate.from_model_dir(tiny_model_dir).stop_token_ids

    async def driver(h):
        recorder = h.actor("recorder")
        await h.wait_until(lambda: len(recorder.of(RoleChanged)) >= 2, timeout_s=180, what="cells up")
        url = recorder.of(RoleChanged, cell="cell-a")[-1].engine_url
        clients, prompts = [], []
        for i in range(2):
            key = await h.ask("proxy", IssueKey(f"exec-{i}", "group-0"))
            clients.append(openai.AsyncOpenAI(base_url=key.openai_base_url, api_key=key.api_key, max_retries=0,
                                              timeout=300))
            prompts.append([{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(40))}])
        generated_before = (await engine_load(url))[1]
        calls = [asyncio.ensure_future(client.chat.completions.create(
            model="gyre", messages=messages, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=seed))
            for client, messages, seed in zip(clients, prompts, SEEDS)]
        for _ in range(2000):
            running, generated = await engine_load(url)
            if running and generated - generated_before >= 20 * running:
                break
            await asyncio.sleep(0.01)
        h.tell("cell-a", SwitchRole("cell-a", TRAIN, "test: colocate", migrate_sessions=False))
        await h.wait_until(lambda: recorder.of(RoleChanged, cell="cell-a")[-1].role == TRAIN, timeout_s=120,
                           what="switch to train")
        await asyncio.sleep(0.5)
        pending_while_training = sum(not call.done() for call in calls)
        h.tell("cell-a", SwitchRole("cell-a", ROLLOUT, "test: the step is applied"))
        replies = await asyncio.gather(*calls)
        changed = [m for m in recorder.of(RoleChanged, cell="cell-a") if m.previous_role]

        def completed() -> list[ModelCallCompleted]:
            return [m for m in recorder.of(ModelCallCompleted) if m.execution_id.startswith("exec-")]

        # The proxy answers a call before its ModelCallCompleted (published through its own inbox) reaches the
        # recorder: wait for the announcements rather than read them the moment the replies are in.
        await h.wait_until(lambda: len(completed()) >= len(calls), timeout_s=30, what="ModelCallCompleted of both")
        done = completed()
        proxy_status = await h.ask("proxy", StatisticsAsked())
        back_url = changed[-1].engine_url
        references = {}
        prompts = whole_prompts(done)
        async with SGLangClient(back_url) as client:
            for call in done:
                out = await client.generate(prompts[(call.execution_id, call.call_index)], {
                    "max_new_tokens": MAX_TOKENS, "temperature": TEMPERATURE,
                    "sampling_seed": SEEDS[int(call.execution_id.removeprefix("exec-"))],
                    "stop_token_ids": list(stop_ids)})
                references[(call.execution_id, call.call_index)] = tuple(out["output_ids"])
        return pending_while_training, replies, changed, done, proxy_status, references

    run = run_actors(topology(str(tiny_model_dir), rollout_cells=("cell-a",)), driver, transport="zmq",
                     timeout_s=400)
    assert run.stop_reason is None, run.stop_reason
    pending_while_training, replies, changed, done, proxy_status, references = run.value
    assert [r.choices[0].finish_reason for r in replies] == ["length", "length"]  # long enough to be cut
    assert pending_while_training == 2  # nothing served them while no cell rolled out
    assert [(m.role, m.sessions_migrated) for m in changed] == [(TRAIN, 0), (ROLLOUT, 0)]
    assert all(reply.choices[0].finish_reason in ("stop", "length") for reply in replies)
    assert proxy_status.calls_failed == 0 and proxy_status.resumed_generations >= 1
    assert len(done) == 2
    for call in done:
        assert call.output_ids == references[(call.execution_id, call.call_index)]
