"""The config codec: configs round-trip, and decoding loads code only from gyre, from files the caller names, or
from files under the current directory whose content hash the log recorded; it instantiates only attrs classes."""

from __future__ import annotations

import hashlib
import sys

import attrs
import msgpack
import pytest

from gyre.policies.scheduling import AsyncPolicy, ElasticPolicy
from gyre.runtime import CodecError
from gyre.runtime.config_codec import (
    CodeTrust,
    UntrustedCode,
    class_source,
    decode_config,
    encode_config,
    is_gyre_module,
    load_class,
)
from gyre.runtime import NoConfig

HELPER = '''
import attrs

@attrs.frozen
class Knobs:
    depth: int = 1
    names: tuple[str, ...] = ()

@attrs.frozen
class Outer:
    knobs: Knobs = Knobs()
    label: str = "x"
'''


@pytest.fixture
def marker(tmp_path):
    """A file that only a payload creates: if it exists after a test, code named by a log has run."""
    return tmp_path / "payload-ran"


def _blob(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def test_gyre_configs_round_trip_with_nested_policies_and_tuples() -> None:
    for config in (ElasticPolicy(min_dwell_s=5.0, dry_grace_s=5.0), AsyncPolicy(train_cells=("core", "s1")), NoConfig()):
        assert decode_config(encode_config(config)) == config
    assert class_source(ElasticPolicy) == ("", "")  # gyre's own classes load by name: no file, no hash


def test_a_helper_file_under_the_current_directory_loads_while_its_content_is_what_the_run_saw(
    tmp_path, monkeypatch
) -> None:
    helper = tmp_path / "cfg_helper_a.py"
    helper.write_text(HELPER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__("cfg_helper_a")
    try:
        config = module.Outer(module.Knobs(3, ("a", "b")), "y")
        blob = encode_config(config)
        assert class_source(module.Outer) == (str(helper), hashlib.sha256(helper.read_bytes()).hexdigest())
        sys.modules.pop("cfg_helper_a")  # as in a fresh `gyre replay` process: the file is loaded by the decoder
        decoded = decode_config(blob)
        assert attrs.asdict(decoded) == attrs.asdict(config) and type(decoded).__module__ == "cfg_helper_a"

        sys.modules.pop("cfg_helper_a")
        helper.write_text(HELPER.replace('label: str = "x"', 'label: str = "changed"'))
        with pytest.raises(UntrustedCode, match=f"changed since the run.*--code {helper}"):
            decode_config(blob)
        assert "cfg_helper_a" not in sys.modules
        for named in ((helper,), (tmp_path,)):  # a file, or a folder of files, the caller vouches for
            assert decode_config(blob, CodeTrust(named)).label == "y"
            sys.modules.pop("cfg_helper_a")
    finally:
        sys.modules.pop("cfg_helper_a", None)


def test_a_file_outside_the_current_directory_is_refused_even_with_the_right_hash(tmp_path, monkeypatch, marker):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    payload = elsewhere / "cfg_payload_b.py"
    payload.write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n" + HELPER)
    here = tmp_path / "work"
    here.mkdir()
    monkeypatch.chdir(here)
    blob = _blob({
        "__class__": "cfg_payload_b:Knobs", "__file__": str(payload),
        "__sha256__": hashlib.sha256(payload.read_bytes()).hexdigest(), "fields": {},
    })
    with pytest.raises(UntrustedCode, match=f"outside the current directory {here}.*pass --code {payload}"):
        decode_config(blob)
    assert not marker.exists() and "cfg_payload_b" not in sys.modules


def test_a_module_the_log_names_is_not_imported_unless_it_is_gyres(tmp_path, monkeypatch, marker) -> None:
    """Finding 4: decoding imported any module a log named (and so ran it)."""
    (tmp_path / "cfg_payload_c.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n")
    namespace = tmp_path / "ns" / "gyre"  # `gyre` is a namespace package: any folder of that name could join it
    namespace.mkdir(parents=True)
    (namespace / "payload.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path / "ns"))
    for name in ("cfg_payload_c:Anything", "gyre.payload:Anything"):
        with pytest.raises(UntrustedCode, match="not part of gyre and the log names no file"):
            decode_config(_blob({"__class__": name, "fields": {}}))
        with pytest.raises(UntrustedCode):
            load_class(name)
    assert not marker.exists()
    assert not is_gyre_module("gyre.payload") and not is_gyre_module("gyre_topology_x") and is_gyre_module("gyre.runtime.node")


@pytest.mark.parametrize("name, wanted", [
    ("os:system", "not part of gyre"),
    ("subprocess:Popen", "not part of gyre"),
    ("gyre.runtime.config_codec:importlib.import_module", "does not name a class defined in"),
    ("gyre.runtime.config_codec:msgpack.ExtType", "does not name a class defined in"),
    ("gyre.runtime.node:Node", "not an attrs class"),
    ("gyre.runtime.config_codec:CodeTrust.__init__", "does not name a class defined in"),
    ("gyre.runtime.node:<locals>", "is not a class path"),
    ("../../etc/passwd:X", "is not a class path"),
])
def test_only_attrs_classes_defined_where_they_are_named_are_built(name, wanted, marker) -> None:
    blob = _blob({"__class__": name, "fields": {"command": f"touch {marker}", "name": "cfg_payload_c"}})
    with pytest.raises(CodecError, match=wanted):
        decode_config(blob)
    assert not marker.exists()


@pytest.mark.parametrize("blob", [
    b"\xc1garbage",
    _blob({"__class__": 5, "fields": {}}),
    _blob({"__class__": "gyre.policies.scheduling:AsyncPolicy"}),
    _blob({"__class__": "gyre.policies.scheduling:AsyncPolicy", "fields": {"no_such_field": 1}}),
    _blob({"__class__": "gyre.policies.scheduling:AsyncPolicy", "fields": [1, 2]}),
    _blob({"__class__": "gyre.runtime.actor:NoConfig", "__file__": 7, "fields": {}}),
    _blob({"__class__": "nowhere.at.all:Thing", "__file__": "/nonexistent/file.py", "fields": {}}),
])
def test_a_malformed_config_is_a_codec_error(blob) -> None:
    with pytest.raises(CodecError):
        decode_config(blob)


@pytest.mark.parametrize("depth", [900, 5000])  # past Python's recursion limit; past msgpack's own stack
def test_a_config_nested_too_deep_is_a_codec_error(depth) -> None:
    inner = _blob({"__class__": "gyre.runtime.actor:NoConfig", "fields": {}})
    with pytest.raises(CodecError):
        decode_config(b"\x91" * depth + inner)  # a one-element array around the last, `depth` times
