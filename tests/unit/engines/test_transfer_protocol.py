"""The Mooncake protocol a TransferAgent uses: "tcp" anywhere, "rdma" only where the node has an RDMA device (read
where the kernel lists them, as ibv_devices does), refused with a clear TransferError otherwise; cells choose it in
their config (transfer_protocol, rdma_devices)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre.actors.cells.cell import CellConfig
from gyre.engines.errors import TransferError
from gyre.engines.transfer import TransferAgent, TransferConfig, check_rdma, rdma_devices
from gyre.runtime.errors import ConfigError


def _sysfs(folder: Path, *names: str) -> str:
    root = folder / "infiniband"
    root.mkdir(parents=True)
    for name in names:
        (root / name).mkdir()
    return str(root)


def test_rdma_devices_lists_the_kernels_entries_and_none_without_the_folder(tmp_path: Path) -> None:
    assert rdma_devices(_sysfs(tmp_path, "mlx5_1", "mlx5_0")) == ("mlx5_0", "mlx5_1")
    assert rdma_devices(str(tmp_path / "absent")) == ()


def test_rdma_needs_a_device_and_each_one_named(tmp_path: Path) -> None:
    empty = _sysfs(tmp_path / "empty")
    with pytest.raises(TransferError, match="transfer protocol 'rdma' asked, but this node has no RDMA device"):
        check_rdma(TransferConfig(protocol="rdma"), empty)
    two = _sysfs(tmp_path / "two", "mlx5_0", "mlx5_1")
    check_rdma(TransferConfig(protocol="rdma"), two)
    check_rdma(TransferConfig(protocol="rdma", device_name="mlx5_1"), two)
    with pytest.raises(TransferError, match=r"devices \['mlx5_7'\] not on this node; it has \['mlx5_0', 'mlx5_1'\]"):
        check_rdma(TransferConfig(protocol="rdma", device_name="mlx5_0,mlx5_7"), two)
    check_rdma(TransferConfig(protocol="tcp"), empty)  # TCP needs no device


def test_a_device_filter_is_for_rdma_only() -> None:
    with pytest.raises(ValueError, match="is for protocol 'rdma'"):
        TransferConfig(protocol="tcp", device_name="mlx5_0")
    with pytest.raises(ValueError, match="protocol must be"):
        TransferConfig(protocol="ib")
    with pytest.raises(ConfigError, match="needs transfer_protocol 'rdma'"):
        CellConfig(model_dir="m", rdma_devices="mlx5_0")
    with pytest.raises(ValueError):
        CellConfig(model_dir="m", transfer_protocol="ib")


@pytest.mark.skipif(bool(rdma_devices()), reason="this node has an RDMA device")
def test_an_agent_asked_for_rdma_on_a_node_without_a_device_says_so() -> None:
    with pytest.raises(TransferError, match="no RDMA device"):
        TransferAgent(TransferConfig(protocol="rdma"))
    TransferAgent(TransferConfig(protocol="tcp")).close()  # the same node, over TCP: fine
