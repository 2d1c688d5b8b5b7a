"""Conformance: Gyre's SGLang client, and a cell of engine kind "server", against the fake SGLang server
(gyre.engines.testing), which serves only SGLang's own routes and fields on a real embedded engine."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import pytest
import torch
from aiohttp import web

from gyre.actors.cells.cell import Cell, CellConfig
from gyre.actors.cells.engine_process import EngineServerConfig
from gyre.actors.cells.kv_migrator import KVMigrator, KVMigratorConfig
from gyre.engines.async_engine import AsyncEngine
from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig
from gyre.engines.sglang_client import CapabilityMissing, ClientConfig, RequestRejected, SGLangClient
from gyre.engines.testing import build_fake_sglang_app
from gyre.messages.cells import ROLLOUT, TRAIN, EngineServerFailed, MigrateSessions, RoleChanged, SwitchRole
from gyre.messages.proxy import SessionPrefixes, SessionsOnCell
from gyre.messages.runtime_control import StatisticsAsked
from gyre.runtime import Actor, RestartPolicy, Topology, handler
from gyre.runtime.testing import run_actors

ENGINE = EngineConfig(num_blocks=64, max_context_tokens=256, max_prefill_tokens=256, num_threads=1)
KEY = "conformance-key-0123456789"


@contextlib.asynccontextmanager
async def fake_sglang(model_dir, **options):
    """The URL of an in-process fake SGLang server."""
    engine = AsyncEngine(EmbeddedEngine(str(model_dir), ENGINE))
    runner = web.AppRunner(build_fake_sglang_app(engine, str(model_dir), **options))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
        await engine.close()


def test_generate_and_control_over_sglangs_routes_only(tiny_model_dir):
    torch.set_num_threads(1)
    asyncio.run(generate_and_control(tiny_model_dir))


async def generate_and_control(tiny_model_dir):
    async with fake_sglang(tiny_model_dir, api_key=KEY) as url:
        async with SGLangClient(url, api_key=KEY) as client:
            out = await client.generate([5, 6, 7, 8], {"max_new_tokens": 4, "temperature": 0.0, "top_k": -1})
            assert len(out["output_ids"]) == 4 and "output_token_versions" not in out["meta_info"]
            assert out["meta_info"]["weight_version"] == "default"
            assert len(out["meta_info"]["output_token_logprobs"]) == 4
            chunks = [c async for c in client.generate_stream([5, 6, 7, 8], {"max_new_tokens": 4, "temperature": 0.0})]
            assert chunks[-1]["output_ids"] == out["output_ids"]  # cumulative, as SGLang streams by default
            with pytest.raises(RequestRejected, match="unexpected keyword argument 'no_such_param'"):
                await client.generate([5, 6], {"no_such_param": 1})
            with pytest.raises(RequestRejected, match="cannot honour"):
                await client.generate([5, 6], {"frequency_penalty": 0.5})
            with pytest.raises(CapabilityMissing):
                await client.export_kv([5, 6, 7, 8])
            with pytest.raises(CapabilityMissing):
                await client.live_sequences()
            info = await client.model_info()
            assert info["model_path"] == str(tiny_model_dir) and "vocab_size" not in info
            await client.pause("in_place")
            await client.continue_generation()
            assert await client.flush_cache()
            await client.update_weights_from_disk(str(tiny_model_dir), weight_version=7)
            assert (await client.model_info())["weight_version"] == "7"
            await client.release_memory(None)
            with pytest.raises(Exception) as released:
                await client.generate([5, 6], {"max_new_tokens": 1})
            assert "released" in str(released.value)
            await client.resume_memory(None)
            again = await client.generate([5, 6, 7, 8], {"max_new_tokens": 4, "temperature": 0.0})
            assert again["output_ids"] == out["output_ids"]
        async with SGLangClient(url, api_key="wrong-key-0123456789") as client:
            with pytest.raises(RequestRejected):
                await client.model_info()


def test_old_sglang_pause_without_a_body(tiny_model_dir):
    async def main():
        async with fake_sglang(tiny_model_dir, legacy_pause=True) as url:
            async with SGLangClient(url, api_key=KEY, config=ClientConfig(pause_body=False)) as client:
                await client.pause("abort")
                with pytest.raises(CapabilityMissing):
                    await client.pause("in_place")
            async with SGLangClient(url, api_key=KEY) as client:
                with pytest.raises(RequestRejected, match="no body"):
                    await client.pause("abort")

    asyncio.run(main())


class Recorder(Actor):
    subscriptions = (RoleChanged, EngineServerFailed)

    async def on_start(self) -> None:
        self.events: list = []

    @handler(RoleChanged, EngineServerFailed)
    def on_event(self, msg) -> None:
        self.events.append(msg)


def test_a_server_cell_runs_against_the_fake_sglang(tiny_model_dir):
    """The cell launches the fake as its engine server (a command line of its own), checks the model through
    /model_info's model_path, serves, switches (no /gyre/live_sequences: nothing to move, the proxy would
    re-prefill) and comes back with its memory resumed."""
    torch.set_num_threads(1)
    server = EngineServerConfig(command=(sys.executable, "-m", "gyre.engines.testing", "--model-dir", "{model_dir}",
                                         "--host", "{host}", "--port", "{port}", "--num-blocks", "64",
                                         "--max-context", "256", "--num-threads", "1"))
    topology = Topology("fake-sglang", seed=0)
    topology.add("recorder", Recorder)
    topology.add("cell-a", Cell, CellConfig(model_dir=str(tiny_model_dir), engine=ENGINE, engine_kind="server",
                                            engine_server=server, report_interval_s=0.25),
                 restart=RestartPolicy("stop_actor"))

    async def driver(h):
        recorder = h.actor("recorder")
        changed = lambda: [m for m in recorder.events if isinstance(m, RoleChanged)]  # noqa: E731
        await h.wait_until(lambda: changed() or recorder.events, timeout_s=120, what="cell up")
        url = changed()[0].engine_url
        async with SGLangClient(url) as client:
            before = await client.generate([5, 6, 7, 8], {"max_new_tokens": 4, "temperature": 0.0})
        h.tell("cell-a", SwitchRole("cell-a", TRAIN, "test", migrate_sessions=False))
        await h.wait_until(lambda: len(changed()) >= 2, timeout_s=120, what="to train")
        h.tell("cell-a", SwitchRole("cell-a", ROLLOUT, "test"))
        await h.wait_until(lambda: len(changed()) >= 3, timeout_s=120, what="back")
        async with SGLangClient(url) as client:
            after = await client.generate([5, 6, 7, 8], {"max_new_tokens": 4, "temperature": 0.0})
        return before, after, await h.ask("cell-a", StatisticsAsked()), h.actor("cell-a").rollout.model_check

    run = run_actors(topology, driver, transport="zmq", timeout_s=300)
    assert run.stop_reason is None, run.stop_reason
    before, after, stats, model_check = run.value
    assert model_check == "config" and stats.engine_kind == "server" and stats.has_engine_memory
    assert before["output_ids"] == after["output_ids"]


class FakeProxy(Actor):
    """Answers SessionsOnCell with two sessions on the draining cell (the proxy's part in a migration)."""

    @handler(SessionsOnCell)
    def on_sessions(self, msg: SessionsOnCell) -> SessionPrefixes:
        return SessionPrefixes(cell=msg.cell, sessions={"s1/main": (5, 6, 7, 8), "s2/main": (9, 10, 11)})


@pytest.mark.parametrize("backends,expected", [
    (("mooncake", "mooncake"), (2, 0)),  # one shared store: the target finds the prefixes there
    (("", ""), (0, 2)),  # no HiCache: abort and re-prefill
    (("mooncake", ""), (0, 2)),  # only the source writes through: the target cannot read it
])
def test_the_migrator_leaves_sessions_to_a_shared_hicache_and_re_prefills_otherwise(tiny_model_dir, backends,
                                                                                     expected):
    """Between SGLang servers (no /gyre/kv/*) the migrator cannot move blocks; it reads each server's /server_info
    and counts a session as left to HiCache only when both write through to the same storage backend."""
    torch.set_num_threads(1)
    topology = Topology("hicache", seed=0)
    topology.add("proxy", FakeProxy)
    topology.add("kv_migrator", KVMigrator, KVMigratorConfig())

    async def driver(h):
        async with fake_sglang(tiny_model_dir, hicache_storage_backend=backends[0]) as source, \
                fake_sglang(tiny_model_dir, hicache_storage_backend=backends[1]) as target:
            answer = await h.ask("kv_migrator", MigrateSessions("cell-a", source, {"cell-b": target}, ()))
            return answer, await h.ask("kv_migrator", StatisticsAsked())

    run = run_actors(topology, driver, timeout_s=120)
    assert run.stop_reason is None, run.stop_reason
    answer, stats = run.value
    assert answer.placement == {"s1/main": "cell-b", "s2/main": "cell-b"}  # placed either way
    assert (answer.hicache_sessions, answer.reprefill_sessions) == expected
    assert (stats.hicache_sessions, stats.reprefill_sessions) == expected and answer.moved_tokens == 0
