"""The runtime's public surface is exactly what `gyre.runtime.__all__` names (trio's test_exports)."""

from __future__ import annotations

import types

import gyre.runtime
import gyre.runtime.testing


def test_all_names_exactly_the_public_names() -> None:
    names = gyre.runtime.__all__
    assert len(names) == len(set(names))
    public = {
        name for name, value in vars(gyre.runtime).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(names)
    for name in names:
        assert getattr(gyre.runtime, name).__module__.startswith("gyre.runtime.")


def test_testing_helpers_are_public_and_documented() -> None:
    for name in gyre.runtime.testing.__all__:
        value = getattr(gyre.runtime.testing, name)
        assert isinstance(value, tuple) or value.__doc__, name
