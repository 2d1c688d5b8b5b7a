"""Replay treats a log as data: it runs code only from gyre, from files named with --code, and from files under
the current directory that still hash as the run recorded; old logs (ActorStarted v1) replay with --code; a log it
cannot use is a one-line error (exit 2)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Callable

import attrs
import msgpack
import pytest
import structlog

from gyre.messages.runtime_control import ActorStarted
from gyre.runtime import Codec, EventLogWriter, GyreError, read_log
from gyre.runtime.errors import ReplayError
from gyre.runtime.replay import replay_actor
from gyre.runtime.testing import gyre_cli

REPO = Path(__file__).resolve().parents[3]
PING_PONG = REPO / "examples" / "ping_pong.py"
CODEC = Codec()


@attrs.frozen(slots=True)
class ActorStartedV1:
    """ActorStarted as gyre wrote it before version 2 (no source hash), to make an old log."""

    actor: str
    class_path: str
    source_path: str
    config_blob: bytes
    seed: int
    index: int
    subscriptions: tuple[str, ...]
    incarnation: int


ActorStartedV1.__gyre_type__ = ActorStarted.__gyre_type__
ActorStartedV1.__gyre_version__ = 1


@pytest.fixture(autouse=True)
def _keep_logging_config():
    """The subcommands configure structlog for a terminal; give the next test the configuration it had."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture
def run(tmp_path, monkeypatch, request):
    """A virtual ping-pong run of a copy of examples/ping_pong.py in tmp_path, the current directory: (log,
    topology file, its module name). The module is dropped afterwards, so replay loads the file as a fresh process
    would."""
    stem = "pp_" + "".join(c if c.isalnum() else "_" for c in request.node.name)[-40:]
    topology = tmp_path / f"{stem}.py"
    topology.write_text(PING_PONG.read_text())
    log = tmp_path / "run.glog"
    monkeypatch.chdir(tmp_path)
    assert gyre_cli(["run", str(topology), "--virtual", "--seed", "2", "--log", str(log)]) == 0
    module_name = f"gyre_topology_{stem}"
    sys.modules.pop(module_name)
    yield log, topology, module_name
    sys.modules.pop(module_name, None)


@pytest.fixture
def marker(tmp_path):
    """A file that only a payload creates: if it exists after a test, code named by a log has run."""
    return tmp_path / "payload-ran"


def _payload(path: Path, marker: Path) -> Path:
    """An actor module whose import leaves `marker`: what a crafted log would make replay run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from gyre.runtime import Actor\nclass Evil(Actor):\n    pass\n"
    )
    return path


def _rewrite_starts(log: Path, into: Path, change: Callable[[ActorStarted], object]) -> Path:
    """A copy of `log` whose ActorStarted records are `change(record)` (a new message, or (header, body))."""
    writer = EventLogWriter(into)
    for record in read_log(log, CODEC):
        header, body = record.header, record.body
        if record.type_name == ActorStarted.__gyre_type__:
            changed = change(record.decode(CODEC))
            header, body = changed if isinstance(changed, tuple) else CODEC.encode(record.envelope, changed)
        writer.append(record.handled_s, header, body)
    writer.close()
    return into


def _as_pong(started: ActorStarted, **changes) -> ActorStarted:
    return attrs.evolve(started, **changes) if started.actor == "pong" else started


def test_replay_error_is_a_gyre_error() -> None:
    assert issubclass(ReplayError, GyreError)


def test_a_start_record_naming_a_file_outside_the_current_directory_is_refused(run, tmp_path, marker) -> None:
    """Finding 4: replay exec'd whatever file an ActorStarted record named. The hash is right (whoever crafts a log
    can compute it); the file is simply not one the user trusts."""
    log, _, _ = run
    payload = _payload(tmp_path.parent / f"{tmp_path.name}-elsewhere" / "payload_outside.py", marker)
    digest = hashlib.sha256(payload.read_bytes()).hexdigest()
    crafted = _rewrite_starts(log, tmp_path / "crafted.glog", lambda s: _as_pong(
        s, class_path="gyre_payload_outside:Evil", source_path=str(payload), source_sha256=digest))
    with pytest.raises(ReplayError, match=f"outside the current directory.*pass --code {payload}"):
        replay_actor(crafted, "pong")
    assert not marker.exists() and "gyre_payload_outside" not in sys.modules


def test_a_start_record_naming_an_importable_module_is_refused(run, tmp_path, monkeypatch, marker) -> None:
    log, _, _ = run
    _payload(tmp_path / "lib" / "gyre_payload_importable.py", marker)
    _payload(tmp_path / "lib" / "gyre" / "payload.py", marker)  # `gyre` is a namespace any folder can join
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    for class_path in ("gyre_payload_importable:Evil", "gyre.payload:Evil"):
        crafted = _rewrite_starts(log, tmp_path / "crafted.glog", lambda s: _as_pong(
            s, class_path=class_path, source_path="", source_sha256=""))
        with pytest.raises(ReplayError, match="not part of gyre"):
            replay_actor(crafted, "pong")
    assert not marker.exists()


def test_a_start_record_naming_something_other_than_an_actor_is_refused(run, tmp_path) -> None:
    log, _, _ = run
    for class_path, wanted in (
        ("gyre.runtime.config_codec:importlib.import_module", "does not name a class defined in"),
        ("gyre.runtime.node:Node", "is not an actor class"),
    ):
        crafted = _rewrite_starts(log, tmp_path / "crafted.glog", lambda s: _as_pong(s, class_path=class_path))
        with pytest.raises(ReplayError, match=wanted):
            replay_actor(crafted, "pong")
    crafted = _rewrite_starts(log, tmp_path / "crafted.glog", lambda s: _as_pong(
        s, config_blob=msgpack.packb({"__class__": "os:system", "fields": {"command": "true"}})))
    with pytest.raises(ReplayError, match="os:system.*not part of gyre"):
        replay_actor(crafted, "pong")


def test_a_topology_file_loads_while_it_is_unchanged_and_otherwise_only_with_code(run, tmp_path, capsys) -> None:
    log, topology, module_name = run
    assert replay_actor(log, "pong").identical
    sys.modules.pop(module_name)
    topology.write_text(topology.read_text() + "\n# edited after the run\n")
    with pytest.raises(ReplayError, match=f"changed since the run.*pass --code {topology}"):
        replay_actor(log, "pong")
    assert module_name not in sys.modules
    assert replay_actor(log, "pong", code_paths=[topology]).identical
    sys.modules.pop(module_name)
    assert replay_actor(log, "ping", code_paths=[tmp_path]).identical  # a folder vouches for the files in it

    sys.modules.pop(module_name)
    capsys.readouterr()  # what the replays above logged: the assertion below is about the CLI's own output
    assert gyre_cli(["replay", str(log), "--actor", "pong"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("gyre replay: cannot rebuild pong: ") and err.count("\n") == 1
    assert gyre_cli(["replay", str(log), "--actor", "pong", "--code", str(topology)]) == 0
    assert capsys.readouterr().out.startswith("identical: pong")
    assert gyre_cli(["replay", str(log), "--actor", "pong", "--code", str(tmp_path / "typo.py")]) == 2
    assert capsys.readouterr().err == f"gyre replay: --code {tmp_path / 'typo.py'}: no such file or folder\n"


def test_a_log_from_before_start_records_carried_hashes_replays_with_code(run, tmp_path) -> None:
    """ActorStarted v1 records are refused by the codec; replay reads them from their fields, with no hash, so the
    gyre actor replays as it did and the topology's actors need --code."""
    log, topology, module_name = run
    old_codec = Codec([ActorStartedV1])

    def to_v1(started: ActorStarted):
        for record in read_log(log, CODEC):
            if record.type_name == ActorStarted.__gyre_type__ and record.decode(CODEC) == started:
                fields = attrs.asdict(started, recurse=False)
                del fields["source_sha256"]
                return old_codec.encode(record.envelope, ActorStartedV1(**fields))
        raise AssertionError("the start record is not in the log")

    old = _rewrite_starts(log, tmp_path / "old.glog", to_v1)
    versions = {r.version for r in read_log(old) if r.type_name == ActorStarted.__gyre_type__}
    assert versions == {1}
    assert replay_actor(old, "supervisor").identical
    with pytest.raises(ReplayError, match=f"records no hash.*pass --code {topology}"):
        replay_actor(old, "pong")
    assert replay_actor(old, "pong", code_paths=[topology]).identical
    sys.modules.pop(module_name)
    assert replay_actor(old, "ping", code_paths=[topology]).identical


def test_a_log_replay_cannot_read_is_a_one_line_error(run, tmp_path, capsys) -> None:
    log, _, _ = run
    data = bytearray(log.read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "bad.glog").write_bytes(bytes(data))
    crafted = _rewrite_starts(log, tmp_path / "odd.glog", lambda s: _as_pong(s, config_blob=b""))
    for path, wanted in ((tmp_path / "bad.glog", "cannot read the log"), (tmp_path / "missing.glog", "no event log"),
                         (crafted, "cannot rebuild pong")):
        assert gyre_cli(["replay", str(path), "--actor", "pong"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("gyre replay: ") and wanted in err and err.count("\n") == 1, err
