"""Encoding of actor configs (attrs instances, policies included) for the event log, and the one gate through which
replay turns names found in a log back into classes.

Configs are not wire messages: they can hold nested attrs objects of any class. Each attrs instance becomes
`{"__class__": "module:QualName", "__file__": path, "__sha256__": hex, "fields": {...}}` (the file and its hash only
for classes outside gyre); tuples, lists, dicts and scalars pass through msgpack as they are.

A log is data, and whoever can write one must not be able to run code through replay. So `load_class` loads code
only from gyre itself (by module name; `gyre` is a namespace package, so only its own subpackages count, never
another folder named `gyre` on the path), from files the user names (`CodeTrust.named`, `gyre replay --code PATH`:
taken as they are now, so a changed handler can be replayed on purpose), and from files under the current directory
whose content has the SHA-256 that the log recorded when the run started. Anything else is refused with
`UntrustedCode`, whose message says how to trust the file. What it returns is a class defined in the module it names
(no reaching through attributes to a function), and config decoding instantiates only attrs classes.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

import attrs
import msgpack

from gyre.runtime.errors import CodecError

#: The subpackages that make up gyre (pyproject.toml's package-dir): the only modules loaded by name alone.
GYRE_PACKAGES = ("messages", "runtime", "engines", "policies", "actors", "benchmarks")


class UntrustedCode(CodecError):
    """A log names code that replay may not load: not gyre's, not named by the user, not under the current
    directory with the content hash the log recorded."""


@attrs.frozen
class CodeTrust:
    """Where, besides gyre itself, classes named in a log may be loaded from."""

    named: tuple[Path, ...] = attrs.field(default=(), converter=lambda paths: tuple(Path(p).resolve() for p in paths))
    """Files or folders the user vouches for (`--code`); loaded as they are, whatever their content now."""
    root: Path = attrs.field(factory=Path.cwd, converter=lambda path: Path(path).resolve())
    """A file under this folder loads if its content has the SHA-256 the log recorded for it."""

    def vouches_for(self, path: Path) -> bool:
        return any(path == named or path.is_relative_to(named) for named in self.named)


def is_gyre_module(module_name: str) -> bool:
    head, _, rest = module_name.partition(".")
    return head == "gyre" and rest.partition(".")[0] in GYRE_PACKAGES


def class_source(cls: type) -> tuple[str, str]:
    """(file, SHA-256 of its content) of the file that defines `cls`, for the log; ("", "") for gyre's own classes
    (replay imports those by name) and for classes with no file."""
    if is_gyre_module(cls.__module__):
        return "", ""
    path = _source_file(cls)
    return path, file_sha256(path) if path else ""


@functools.lru_cache(maxsize=256)  # a run's topology and helper files are few; an actor restart reads nothing again
def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file's content as this process first saw it ("" if it cannot be read)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ""


def _source_file(cls: type) -> str:
    try:
        return inspect.getfile(cls)
    except (TypeError, OSError):
        return ""


def _unstructure(value: Any) -> Any:
    if attrs.has(type(value)):
        cls = type(value)
        source_file, sha256 = class_source(cls)
        return {
            "__class__": f"{cls.__module__}:{cls.__qualname__}",
            "__file__": source_file,
            "__sha256__": sha256,
            "fields": {f.name: _unstructure(getattr(value, f.name)) for f in attrs.fields(cls) if f.init},
        }
    if isinstance(value, enum.Enum):
        return _unstructure(value.value)
    if isinstance(value, (list, tuple)):
        return [_unstructure(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _unstructure(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    raise CodecError(f"a config cannot hold a {type(value).__qualname__}: use attrs classes and plain data")


def load_class(class_path: str, source_file: str = "", source_sha256: str = "", trust: CodeTrust | None = None) -> type:
    """The class a log names as "module:QualName", loaded only as the module docstring allows (`UntrustedCode`
    otherwise); `source_file` and `source_sha256` are what the log recorded for a class outside gyre."""
    trust = trust if trust is not None else CodeTrust()
    if not isinstance(class_path, str) or not isinstance(source_file, str) or not isinstance(source_sha256, str):
        raise CodecError("a class is named by strings: module:QualName, its file and the file's hash")
    module_name, _, qualname = class_path.partition(":")
    if not _dotted(module_name) or not _dotted(qualname):
        raise CodecError(f"{class_path!r} is not a class path of the form module:QualName")
    if is_gyre_module(module_name):
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise CodecError(f"cannot import {module_name}: {error}") from error
    else:
        module = _load_trusted_file(class_path, module_name, source_file, source_sha256, trust)
    target: Any = module
    for part in qualname.split("."):  # through __dict__, not getattr: a name in a log runs no descriptor
        target = vars(target).get(part) if hasattr(target, "__dict__") else None
    if not isinstance(target, type) or target.__module__ != module_name or target.__qualname__ != qualname:
        raise UntrustedCode(f"{class_path} does not name a class defined in {module_name}")
    return target


def _dotted(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def _load_trusted_file(class_path: str, module_name: str, source_file: str, sha256: str, trust: CodeTrust) -> Any:
    refusal = f"refusing to load {class_path}"
    how = ("replay runs code only from gyre itself, from files under the current directory whose content matches "
           "the hash the log recorded, and from files named with --code")
    if not source_file:
        raise UntrustedCode(f"{refusal}: it is not part of gyre and the log names no file for it; {how}")
    path = Path(source_file).resolve()
    trust_it = f"if you trust it, pass --code {path}"
    if not trust.vouches_for(path):
        if not path.is_relative_to(trust.root):
            raise UntrustedCode(f"{refusal} from {path}: the file is outside the current directory {trust.root}; "
                                f"{how}: {trust_it}")
        if not sha256:
            raise UntrustedCode(f"{refusal} from {path}: the log records no hash of the file (a log written before "
                                f"gyre recorded them); {trust_it}")
    try:
        source = path.read_bytes()  # the bytes checked are the bytes run: the file may change between the two
    except OSError as error:
        raise CodecError(f"cannot read {path}, which defines {class_path}: {error.strerror or error}") from error
    if not trust.vouches_for(path) and hashlib.sha256(source).hexdigest() != sha256:
        raise UntrustedCode(f"{refusal} from {path}: the file changed since the run (its SHA-256 is not the one "
                            f"the log recorded); to replay it as it is now, {trust_it}")
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        loaded_file = getattr(loaded, "__file__", None)
        if loaded_file and Path(loaded_file).resolve() == path:
            return loaded
        raise UntrustedCode(f"{refusal} from {path}: another module named {module_name} is already loaded here")
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None:
        raise CodecError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.parent)
    if folder not in sys.path:  # as when `gyre run` loaded the topology file: its own imports find its neighbours
        sys.path.insert(0, folder)
    sys.modules[module_name] = module
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - trusted as the docstring says
    except BaseException as error:
        sys.modules.pop(module_name, None)  # a half-run module must not be found by the next lookup
        if not isinstance(error, Exception):
            raise
        raise CodecError(f"{path}, which defines {class_path}, raised on loading: "
                         f"{type(error).__name__}: {error}") from error
    return module


def _structure(value: Any, trust: CodeTrust) -> Any:
    if isinstance(value, dict) and "__class__" in value:
        cls = load_class(value["__class__"], value.get("__file__", ""), value.get("__sha256__", ""), trust)
        if not attrs.has(cls):
            raise UntrustedCode(f"{value['__class__']} is not an attrs class: a config holds only attrs instances")
        raw_fields = value.get("fields")
        if not isinstance(raw_fields, dict):
            raise CodecError(f"the {value['__class__']} in the config has no field map")
        fields = {name: _structure(v, trust) for name, v in raw_fields.items()}
        for field in attrs.fields(cls):  # lists came back from msgpack: tuples where the default says so
            declared = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
            if field.name in fields and isinstance(fields[field.name], list) and str(declared).startswith("tuple"):
                fields[field.name] = tuple(fields[field.name])
        try:
            return cls(**fields)
        except Exception as error:  # a renamed field, a validator that refuses: the config no longer fits
            raise CodecError(f"cannot build {value['__class__']} from the log's fields: "
                             f"{type(error).__name__}: {error}") from error
    if isinstance(value, list):
        return [_structure(v, trust) for v in value]
    if isinstance(value, dict):
        return {k: _structure(v, trust) for k, v in value.items()}
    return value


def encode_config(config: Any) -> bytes:
    return msgpack.packb(_unstructure(config), use_bin_type=True)


def decode_config(blob: bytes, trust: CodeTrust | None = None) -> Any:
    """The config `encode_config` wrote, its classes loaded through `load_class` under `trust`."""
    trust = trust if trust is not None else CodeTrust()
    try:
        value = msgpack.unpackb(blob, raw=False)
    except Exception as error:  # msgpack raises several unrelated types for garbage
        raise CodecError(f"the config is not valid msgpack: {type(error).__name__}: {error}") from error
    try:
        return _structure(value, trust)
    except RecursionError as error:
        raise CodecError("the config nests deeper than Python can follow") from error

