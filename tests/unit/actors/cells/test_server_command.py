"""The command line a cell launches its engine server with: the cell's Mooncake protocol reaches Gyre's server
(its KV moves over RDMA when the cell's do), never a key; and Gyre's server refuses RDMA on a node without a NIC
before it loads the model, saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.actors.cells.engine_process import EngineServerConfig, server_command
from gyre.actors.serving.proxy import ProxyConfig
from gyre.engines.embedded_engine import EngineConfig
from gyre.runtime.launch import NODE_ADDRESS_ENV


def test_the_cells_protocol_reaches_gyres_server_and_tcp_adds_nothing() -> None:
    engine = EngineConfig(num_threads=1)
    tcp = server_command(EngineServerConfig(), "/m", "10.0.0.5", 30000, engine)
    assert "--transfer-protocol" not in tcp and "--kv-transfer" in tcp and tcp[tcp.index("--host") + 1] == "10.0.0.5"
    rdma = server_command(EngineServerConfig(), "/m", "10.0.0.5", 30000, engine, "rdma", "mlx5_0")
    assert rdma[rdma.index("--transfer-protocol") + 1] == "rdma" and rdma[rdma.index("--rdma-devices") + 1] == "mlx5_0"
    sglang = server_command(EngineServerConfig(preset="sglang"), "/m", "10.0.0.5", 30000, engine, "rdma")
    assert "--transfer-protocol" not in sglang  # SGLang's KV path is its own (HiCache, PD): nothing to pass


def test_gyres_server_refuses_rdma_on_a_node_without_a_nic(tiny_model_dir: Path) -> None:
    if any(Path("/sys/class/infiniband").glob("*")):
        pytest.skip("this node has an RDMA device: the refusal cannot happen here")
    result = subprocess.run(
        [sys.executable, "-m", "gyre.engines.engine_server", "--model-dir", str(tiny_model_dir), "--port", "1",
         "--kv-transfer", "--transfer-protocol", "rdma"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, GYRE_ENGINE_API_KEY="k" * 32))
    assert result.returncode != 0
    assert "no RDMA device" in result.stderr and "Traceback" not in result.stderr


def test_the_proxy_binds_the_nodes_address(monkeypatch) -> None:
    monkeypatch.delenv(NODE_ADDRESS_ENV, raising=False)
    assert ProxyConfig(model_dir="m").host == "127.0.0.1"
    monkeypatch.setenv(NODE_ADDRESS_ENV, "10.0.0.5")  # what a Ray host sets for its node
    assert ProxyConfig(model_dir="m").host == "10.0.0.5"
