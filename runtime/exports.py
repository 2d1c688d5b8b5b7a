"""Lazy package exports: a package names what it offers in `__all__` without importing its modules up front.

A wing of `gyre.actors` exports its actors and configs, but importing one module of a wing (an agent's warm-up, a
CLI) must not import the others: the cells pull in torch and megatron-core, seconds of start-up. PEP 562's module
`__getattr__` imports a name's module the first time the name is read, and caches the value in the package.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, names: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose public name N lives in its submodule `names[N]`."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        globals_of_package = importlib.import_module(package).__dict__
        globals_of_package[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(names) | set(importlib.import_module(package).__dict__))

    return __getattr__, __dir__
