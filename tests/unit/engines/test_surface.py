"""The engines package's public surface is exactly `__all__` (the error base), and importing it costs no torch."""

from __future__ import annotations

import subprocess
import sys
import types

import gyre.engines
import gyre.engines.errors


def test_all_names_exactly_the_public_names() -> None:
    public = {
        name for name, value in vars(gyre.engines).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(gyre.engines.__all__) == {"EngineError"}
    assert gyre.engines.EngineError is gyre.engines.errors.EngineError


def test_every_name_of_the_error_module_is_an_engine_error() -> None:
    for name in gyre.engines.errors.__all__:
        assert issubclass(getattr(gyre.engines.errors, name), gyre.engines.EngineError), name


def test_importing_the_package_or_its_errors_imports_no_torch() -> None:
    # A caller that only catches engine errors (an actor, a CLI) must not pay torch's start-up for it.
    code = "import sys, gyre.engines, gyre.engines.errors; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
