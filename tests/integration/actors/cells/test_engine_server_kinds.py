"""A cell hosting its engine as a server child process (engine kind "server") or someone else's (kind "url"):
the child is a real `python -m gyre.engines.engine_server`, driven only over HTTP.

Checked: it serves with the run's key and no key on its command line; it survives a role switch (its memory is
released and resumed, the process stays) and stops with the cell; a weight update goes through a versioned
directory on disk; a server that does not start, dies or holds another model is reported (EngineServerFailed with
its last output lines) and the cell's outcome is its restart policy's: stopped, or restarted with a fresh server.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch

from gyre.actors.cells.cell import Cell, CellConfig
from gyre.actors.cells.engine_process import EngineServerConfig
from gyre.engines.embedded_engine import EngineConfig
from gyre.engines.engine_server import API_KEY_ENV
from gyre.engines.model_format import init_model_dir
from gyre.engines.sglang_client import SGLangClient
from gyre.messages.cells import ROLLOUT, TRAIN, EngineServerFailed, RoleChanged, SwitchRole
from gyre.messages.runtime_control import StatisticsAsked
from gyre.runtime import Actor, RestartPolicy, Topology, handler
from gyre.runtime.errors import GyreError
from gyre.runtime.run_secrets import run_token
from gyre.runtime.testing import run_actors

ENGINE = EngineConfig(num_blocks=64, max_context_tokens=256, max_prefill_tokens=256, num_threads=1)


class Recorder(Actor):
    subscriptions = (RoleChanged, EngineServerFailed)

    async def on_start(self) -> None:
        self.events: list = []

    @handler(RoleChanged, EngineServerFailed)
    def on_event(self, msg) -> None:
        self.events.append(msg)

    def of(self, kind) -> list:
        return [m for m in self.events if isinstance(m, kind)]


def one_cell(model_dir: str, server: EngineServerConfig = EngineServerConfig(), *, kind: str = "server",
             restart: RestartPolicy = RestartPolicy("stop_actor")) -> Topology:
    topology = Topology("server-kind", seed=0)
    topology.add("recorder", Recorder)
    topology.add("cell-a", Cell, CellConfig(model_dir=model_dir, engine=ENGINE, engine_kind=kind,
                                            engine_server=server, report_interval_s=0.25), restart=restart)
    return topology


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_server_cell_serves_switches_and_stops_its_server(tiny_model_dir):
    torch.set_num_threads(1)

    async def driver(h):
        recorder = h.actor("recorder")
        await h.wait_until(lambda: recorder.of(RoleChanged), timeout_s=120, what="cell up")
        up = recorder.of(RoleChanged)[0]
        host = h.actor("cell-a").rollout
        pid = host.process.pid
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            argv = file.read().split(b"\0")
        with open(f"/proc/{pid}/environ", "rb") as file:
            environ = file.read().split(b"\0")
        async with SGLangClient(up.engine_url) as client:
            before = await client.generate([5, 6, 7, 8], {"max_new_tokens": 4, "temperature": 0.0})
            info = await client.model_info()
        h.tell("cell-a", SwitchRole("cell-a", TRAIN, "test", migrate_sessions=False))
        await h.wait_until(lambda: len(recorder.of(RoleChanged)) >= 2, timeout_s=120, what="to train")
        training = await h.ask("cell-a", StatisticsAsked())
        async with SGLangClient(up.engine_url) as client:
            released = (await client.get_load())["memory_released"]
        h.tell("cell-a", SwitchRole("cell-a", ROLLOUT, "test"))
        await h.wait_until(lambda: len(recorder.of(RoleChanged)) >= 3, timeout_s=120, what="back")
        back = recorder.of(RoleChanged)[-1]
        async with SGLangClient(back.engine_url) as client:
            after = await client.generate([5, 6, 7, 8], {"max_new_tokens": 4, "temperature": 0.0})
        same_pid = h.actor("cell-a").rollout.process.pid == pid
        return up, back, argv, environ, before, after, info, training, released, same_pid, pid

    run = run_actors(one_cell(str(tiny_model_dir)), driver, transport="zmq", timeout_s=300)
    assert run.stop_reason is None, run.stop_reason
    up, back, argv, environ, before, after, info, training, released, same_pid, pid = run.value
    key = run_token("engine").encode()
    assert not any(key in part for part in argv)  # never on the command line
    assert f"{API_KEY_ENV}=".encode() + key in environ  # in the child's own environment
    assert b"gyre.engines.engine_server" in argv
    assert info["vocab_size"] == 2048 and info["engine"] == "gyre-embedded"
    assert up.engine_url == back.engine_url and same_pid  # the process outlives the switch
    assert training.engine_kind == "server" and not training.has_engine_memory
    assert sorted(released) == ["kv_cache", "weights"]
    assert before["output_ids"] == after["output_ids"]  # same weights after release and resume
    assert process_gone(pid)  # stopped with the cell


def test_a_server_that_does_not_start_is_reported(tiny_model_dir):
    async def driver(h):
        recorder = h.actor("recorder")
        await h.wait_until(lambda: recorder.of(EngineServerFailed), timeout_s=120, what="failure report")
        for _ in range(100):  # the report comes just before the failure itself reaches the node
            try:
                await h.ask("cell-a", StatisticsAsked(), timeout_s=5)
            except GyreError as error:
                return recorder.of(EngineServerFailed), recorder.of(RoleChanged), error
            await asyncio.sleep(0.1)
        return recorder.of(EngineServerFailed), recorder.of(RoleChanged), None

    server = EngineServerConfig(extra_args=("--no-such-flag",))
    run = run_actors(one_cell(str(tiny_model_dir), server), driver, transport="zmq", timeout_s=200)
    assert run.stop_reason is None, run.stop_reason
    failures, changed, error = run.value
    assert len(failures) == 1 and not changed
    assert "exited with code 2 before it was healthy" in failures[0].reason and failures[0].exit_code == 2
    assert any("unrecognized arguments: --no-such-flag" in line for line in failures[0].last_output)
    assert error is not None  # the cell is dead (restart policy stop_actor): asks fail at once


def test_a_server_that_dies_is_reported_and_the_cell_restarts_with_a_new_one(tiny_model_dir):
    torch.set_num_threads(1)

    async def driver(h):
        recorder = h.actor("recorder")
        await h.wait_until(lambda: recorder.of(RoleChanged), timeout_s=120, what="cell up")
        pid = h.actor("cell-a").rollout.process.pid
        os.kill(pid, signal.SIGKILL)  # the server this test's cell started: its own child
        await h.wait_until(lambda: recorder.of(EngineServerFailed), timeout_s=120, what="failure report")
        await h.wait_until(lambda: len(recorder.of(RoleChanged)) >= 2, timeout_s=240, what="restarted")
        url = recorder.of(RoleChanged)[-1].engine_url
        async with SGLangClient(url) as client:
            out = await client.generate([5, 6, 7], {"max_new_tokens": 2, "temperature": 0.0})
        return recorder.of(EngineServerFailed), pid, h.actor("cell-a").rollout.process.pid, out

    run = run_actors(one_cell(str(tiny_model_dir), restart=RestartPolicy("restart", 1)), driver, transport="zmq",
                     timeout_s=300)
    assert run.stop_reason is None, run.stop_reason
    failures, old_pid, new_pid, out = run.value
    assert len(failures) == 1 and failures[0].exit_code == -signal.SIGKILL
    assert "died" in failures[0].reason and failures[0].last_output  # the server's own lines come with it
    assert new_pid != old_pid and len(out["output_ids"]) == 2


FAIL_FIRST = ("import os, sys\n"
              "marker = sys.argv[1]\n"
              "if not os.path.exists(marker):\n"
              "    open(marker, 'w').close()\n"
              "    print('port taken (the first launch fails, as when another process took the port)', flush=True)\n"
              "    sys.exit(98)\n"
              "os.execv(sys.argv[2], sys.argv[2:])\n")


def test_a_server_that_exits_at_its_first_launch_is_launched_again_on_a_new_port(tiny_model_dir, tmp_path):
    """A port picked free can be taken before the server binds it: the cell launches it again (start_attempts)."""
    server = EngineServerConfig(command=(
        "{python}", "-c", FAIL_FIRST, str(tmp_path / "launched-once"),
        "{python}", "-m", "gyre.engines.engine_server", "--model-dir", "{model_dir}", "--host", "{host}",
        "--port", "{port}", "--num-threads", "1", "--num-blocks", "64", "--max-context", "256",
        "--max-prefill", "256", "--exit-with-parent"))

    async def driver(h):
        recorder = h.actor("recorder")
        await h.wait_until(lambda: recorder.of(RoleChanged), timeout_s=120, what="cell up")
        url = recorder.of(RoleChanged)[-1].engine_url
        async with SGLangClient(url) as client:
            out = await client.generate([5, 6, 7], {"max_new_tokens": 2, "temperature": 0.0})
        return recorder.of(EngineServerFailed), out

    run = run_actors(one_cell(str(tiny_model_dir), server), driver, transport="zmq", timeout_s=200)
    assert run.stop_reason is None, run.stop_reason
    failures, out = run.value
    assert failures == [] and len(out["output_ids"]) == 2  # nothing reported: the second launch served
    assert (tmp_path / "launched-once").is_file()


def test_a_server_of_another_model_is_refused(tiny_model_dir, tmp_path):
    other = init_model_dir(tmp_path / "small", preset="small", seed=0)
    server = EngineServerConfig(command=(
        "{python}", "-m", "gyre.engines.engine_server", "--model-dir", str(other), "--host", "{host}",
        "--port", "{port}", "--num-threads", "1", "--num-blocks", "64", "--max-context", "256",
        "--max-prefill", "256", "--exit-with-parent"))

    async def driver(h):
        recorder = h.actor("recorder")
        await h.wait_until(lambda: recorder.of(EngineServerFailed), timeout_s=120, what="refusal")
        return recorder.of(EngineServerFailed), recorder.of(RoleChanged)

    run = run_actors(one_cell(str(tiny_model_dir), server), driver, transport="zmq", timeout_s=200)
    assert run.stop_reason is None, run.stop_reason
    failures, changed = run.value
    assert not changed
    assert "another model" in failures[0].reason and "hidden_size 256 (model_dir has 128)" in failures[0].reason


def test_kind_url_needs_a_url(tiny_model_dir):
    from gyre.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="engine_server.url"):
        CellConfig(model_dir=str(tiny_model_dir), engine_kind="url")


def test_weights_dir_writes_whole_versions_and_keeps_the_newest(tiny_model_dir, tmp_path):
    from gyre.actors.cells.server_host import WeightsDir
    from gyre.engines.model_format import load_hf_state_dict

    weights = load_hf_state_dict(tiny_model_dir)
    store = WeightsDir(str(tmp_path / "w"), str(tiny_model_dir), keep=2)
    paths = [store.write(weights, version) for version in (1, 2, 3)]
    assert [Path(p).name for p in paths] == ["v1", "v2", "v3"]
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v2", "v3"]  # no tmp dir left, oldest pruned
    assert (Path(paths[-1]) / "config.json").is_file()
    again = load_hf_state_dict(paths[-1])
    assert set(again) == set(weights) and all(torch.equal(again[k], weights[k]) for k in weights)
