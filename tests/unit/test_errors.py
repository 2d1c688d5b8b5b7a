"""One error model: every exception class Gyre defines derives from its layer's base, and so from `GyreError`.

Each module under gyre.runtime, gyre.engines, gyre.policies and gyre.actors is imported and searched for the
exception classes it defines itself (re-exports are skipped, so a class is judged once, where it lives). A class
that must stay outside the family goes in `ALLOWED` with its reason; nothing else may.
"""

from __future__ import annotations

import collections
import importlib
import inspect
import pkgutil

import pytest

from gyre.actors.errors import ActorError
from gyre.engines.errors import EngineError
from gyre.policies.errors import PolicyError
from gyre.runtime.errors import GyreError

LAYER_BASES: dict[str, type[BaseException]] = {
    "gyre.runtime": GyreError,
    "gyre.engines": EngineError,
    "gyre.policies": PolicyError,
    "gyre.actors": ActorError,
}

ALLOWED: dict[str, str] = {
    "gyre.actors.executions.warm_launcher_server._ClientGone": (
        "private control flow inside the warm launcher's server: raised when its reply pipe closes and caught in "
        "the same module to shut the server down; no caller ever sees it"
    ),
}


def defined_exceptions(package: str) -> tuple[list[tuple[str, type[BaseException]]], list[str]]:
    """(qualified name, class) of every exception class defined in a module of `package`, and the modules that
    could not be imported (whose classes could therefore not be checked)."""
    found: list[tuple[str, type[BaseException]]] = []
    unimportable: list[str] = []
    root = importlib.import_module(package)
    modules = [package] + [info.name for info in pkgutil.walk_packages(root.__path__, package + ".")]
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception as error:  # reported as an offender: an unimportable module hides its errors
            unimportable.append(f"{name} (import failed: {type(error).__name__}: {error})")
            continue
        for attribute, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == name:
                found.append((f"{name}.{attribute}", value))
    return found, unimportable


def offenders(package: str) -> list[str]:
    found, unimportable = defined_exceptions(package)
    base = LAYER_BASES[package]
    wrong = [
        f"{name} (bases: {', '.join(b.__name__ for b in cls.__bases__)}; expected a subclass of {base.__name__})"
        for name, cls in found
        if not issubclass(cls, base) and name not in ALLOWED
    ]
    return sorted(wrong) + unimportable


def check_layer(package: str) -> None:
    bad = offenders(package)
    assert not bad, f"{len(bad)} exception classes of {package} are outside its family:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("package", ["gyre.runtime", "gyre.engines", "gyre.policies"])
def test_every_error_derives_from_its_layer_base(package: str) -> None:
    check_layer(package)


def test_every_actor_error_derives_from_actor_error() -> None:
    check_layer("gyre.actors")


def test_every_layer_base_is_a_gyre_error() -> None:
    for package, base in LAYER_BASES.items():
        assert issubclass(base, GyreError), package


@pytest.mark.parametrize("package", sorted(LAYER_BASES))
def test_no_two_errors_of_a_layer_share_a_name(package: str) -> None:
    # Two classes of one name in one layer (there were two ModelFormatError) let a caller catch the wrong one.
    found, _ = defined_exceptions(package)
    where = collections.defaultdict(list)
    for name, _cls in found:
        where[name.rsplit(".", 1)[1]].append(name)
    duplicates = {short: names for short, names in where.items() if len(names) > 1}
    assert not duplicates, duplicates


def test_the_allow_list_names_only_live_outsiders() -> None:
    # An entry whose class is gone or has joined the family must leave the list, so the list cannot hide anything.
    for qualified, reason in ALLOWED.items():
        module_name, attribute = qualified.rsplit(".", 1)
        cls = getattr(importlib.import_module(module_name), attribute)
        assert isinstance(cls, type) and issubclass(cls, BaseException), qualified
        assert not issubclass(cls, GyreError), f"{qualified} is a GyreError now: drop it from ALLOWED"
        assert attribute.startswith("_"), f"{qualified}: only private classes may stay outside the family"
        assert reason, qualified


def test_the_walk_finds_errors_where_they_live() -> None:
    # The search itself must see the classes it judges, or every check above would pass on an empty list.
    found = dict(defined_exceptions("gyre.engines")[0])
    assert "gyre.engines.errors.ModelFormatError" in found
    assert "gyre.engines.model_format.ModelFormatError" not in found  # a re-export, judged where it is defined
    assert "gyre.runtime.errors.Quiescent" in dict(defined_exceptions("gyre.runtime")[0])
