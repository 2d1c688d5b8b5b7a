"""The policies package's public surface is exactly `__all__` (the error base), and importing it costs no torch."""

from __future__ import annotations

import subprocess
import sys
import types

import gyre.policies
import gyre.policies.errors


def test_all_names_exactly_the_public_names() -> None:
    public = {
        name for name, value in vars(gyre.policies).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(gyre.policies.__all__) == {"PolicyError"}
    assert gyre.policies.PolicyError is gyre.policies.errors.PolicyError


def test_every_name_of_the_error_module_is_a_policy_error() -> None:
    for name in gyre.policies.errors.__all__:
        assert issubclass(getattr(gyre.policies.errors, name), gyre.policies.PolicyError), name


def test_importing_the_package_or_its_errors_imports_no_torch() -> None:
    # loss.py needs torch; the package and its errors must not, so an actor can catch a PolicyError cheaply.
    code = "import sys, gyre.policies, gyre.policies.errors; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
