"""A run's ipc:// socket folder always leaves room for its socket names (a deep $TMPDIR, as pytest-xdist's tmp_path
gives, once made every bind fail with "longer than 107 characters")."""

from __future__ import annotations

import shutil
import stat
import tempfile

import pytest
import zmq

from gyre.runtime.errors import ConfigError
from gyre.runtime.zmq_transport import IPC_PATH_MAX_CHARS, ipc_socket_folder


def test_a_short_temp_folder_is_used_and_the_folder_is_owner_only(monkeypatch) -> None:
    short = tempfile.mkdtemp(prefix="s-", dir="/tmp")  # not tmp_path: under xdist it is itself too deep
    try:
        monkeypatch.setattr(tempfile, "tempdir", short)
        folder = ipc_socket_folder("gyre-run-")
        assert str(folder.parent) == short
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    finally:
        shutil.rmtree(short)


def test_a_temp_folder_too_deep_for_sockets_falls_back_to_tmp_and_a_socket_binds(tmp_path, monkeypatch) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    folder = ipc_socket_folder("gyre-run-")
    try:
        assert str(folder).startswith("/tmp/gyre-run-")
        endpoint = f"ipc://{folder}/launcher.sock"
        assert len(endpoint) - len("ipc://") <= IPC_PATH_MAX_CHARS
        context = zmq.Context()
        try:
            socket = context.socket(zmq.PULL)
            socket.bind(endpoint)  # would raise ZMQError under `deep`
            socket.close(linger=0)
        finally:
            context.term()
    finally:
        shutil.rmtree(folder)


def test_no_folder_that_fits_is_a_config_error_naming_the_way_out(tmp_path, monkeypatch) -> None:
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    monkeypatch.setattr("gyre.runtime.zmq_transport._SHORT_TEMP_ROOT", str(deep))
    with pytest.raises(ConfigError, match="--bus tcp"):
        ipc_socket_folder("gyre-run-")
