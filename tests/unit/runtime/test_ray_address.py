"""`gyre run --ray HOST:PORT` with nobody at HOST:PORT fails at once with one line (ray.init would retry for
minutes), and addresses Ray resolves itself are left to Ray."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gyre.runtime.ray_launcher import check_ray_address
from gyre.runtime.logs import configure_logging
from gyre.runtime.testing import gyre_cli


@pytest.fixture(autouse=True)
def _logging_back_on_the_real_stderr(capsys):
    """`gyre run` in-process points structlog at the stderr capsys captures, which closes after the test: later
    tests' log lines would then raise. Point it back."""
    yield
    with capsys.disabled():
        configure_logging()


def _closed_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_an_address_nobody_answers_is_a_connection_error_naming_it() -> None:
    closed = _closed_address()
    with pytest.raises(ConnectionError, match=f"no Ray cluster answers at {closed}"):
        check_ray_address(closed)


def test_a_listening_address_and_the_ones_ray_resolves_pass() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        check_ray_address(f"127.0.0.1:{server.getsockname()[1]}")
    check_ray_address("auto")
    check_ray_address("ray://head:10001")


def test_gyre_run_against_nobody_exits_1_with_one_line(capsys) -> None:
    closed = _closed_address()
    code = gyre_cli(["run", str(Path(__file__).resolve().parents[3] / "examples" / "ping_pong.py"), "--ray", closed])
    assert code == 1
    assert f"could not connect to Ray at '{closed}': no Ray cluster answers" in capsys.readouterr().err
