"""`gyre run --bus tcp`: the local processes talk over loopback TCP with CURVE, the run and its merged log as over
ipc; a bus the launcher does not know is refused by the parser."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre.runtime import Codec, cli_run, read_log
from gyre.runtime.launch import LocalProcessLauncher
from gyre.runtime.logs import configure_logging
from gyre.runtime.testing import gyre_cli

pytestmark = pytest.mark.timeout(120)

PING_PONG = Path(__file__).resolve().parents[3] / "examples" / "ping_pong.py"


@pytest.fixture(autouse=True)
def _logging_back_on_the_real_stderr(capsys):
    """`gyre run` in-process points structlog at the stderr capsys captures, which closes after the test: later
    tests' log lines would then raise. Point it back."""
    yield
    with capsys.disabled():
        configure_logging()


def test_gyre_run_over_tcp_completes_and_merges_its_log(tmp_path: Path, capsys, monkeypatch) -> None:
    built: list[LocalProcessLauncher] = []

    def launcher(*args, **kwargs) -> LocalProcessLauncher:  # the real launcher, kept to see which bus it got
        built.append(LocalProcessLauncher(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(cli_run, "LocalProcessLauncher", launcher)
    log_path = tmp_path / "tcp.glog"
    assert gyre_cli(["run", str(PING_PONG), "--bus", "tcp", "--log", str(log_path), "--", "--rounds", "6"]) == 0
    assert "rally over: pong returned 6 of 6 (exit 0)" in capsys.readouterr().err
    assert [one.bus for one in built] == ["tcp"]
    receivers = [record.envelope.receiver for record in read_log(log_path, Codec())
                 if record.type_name == "gyre.ping_pong.Ball"]
    assert sorted(receivers) == ["ping"] * 6 + ["pong"] * 6


def test_an_unknown_bus_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gyre_cli(["run", str(PING_PONG), "--bus", "udp"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'udp'" in capsys.readouterr().err
