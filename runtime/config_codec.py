"""Encoding of actor configs (attrs instances, policies included) for the event log, so replay can rebuild actors.

Configs are not wire messages: they can hold nested attrs objects of any class. Each attrs instance becomes
`{"__class__": "module:QualName", "__file__": path, "fields": {...}}`; tuples, lists, dicts and scalars pass
through msgpack as they are.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import inspect
import sys
from typing import Any

import attrs
import msgpack

from gyre.runtime.errors import CodecError


def _unstructure(value: Any) -> Any:
    if attrs.has(type(value)):
        cls = type(value)
        return {
            "__class__": f"{cls.__module__}:{cls.__qualname__}",
            "__file__": _source_file(cls),
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


def _source_file(cls: type) -> str:
    try:
        return inspect.getfile(cls)
    except (TypeError, OSError):
        return ""


def load_class(class_path: str, source_file: str = "") -> type:
    """Import "module:QualName"; fall back to loading `source_file` (topology files are loaded by path)."""
    module_name, _, qualname = class_path.partition(":")
    module = sys.modules.get(module_name)
    if module is None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            if not source_file:
                raise
            spec = importlib.util.spec_from_file_location(module_name, source_file)
            if spec is None or spec.loader is None:
                raise CodecError(f"cannot load {class_path} from {source_file}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _structure(value: Any) -> Any:
    if isinstance(value, dict) and "__class__" in value:
        cls = load_class(value["__class__"], value.get("__file__", ""))
        fields = {name: _structure(v) for name, v in value["fields"].items()}
        for field in attrs.fields(cls):  # lists came back from msgpack: tuples where the default says so
            declared = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
            if field.name in fields and isinstance(fields[field.name], list) and str(declared).startswith("tuple"):
                fields[field.name] = tuple(fields[field.name])
        return cls(**fields)
    if isinstance(value, list):
        return [_structure(v) for v in value]
    if isinstance(value, dict):
        return {k: _structure(v) for k, v in value.items()}
    return value


def encode_config(config: Any) -> bytes:
    return msgpack.packb(_unstructure(config), use_bin_type=True)


def decode_config(blob: bytes) -> Any:
    return _structure(msgpack.unpackb(blob, raw=False))
