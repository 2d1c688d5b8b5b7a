"""The policies layer's errors: one base, `PolicyError`, under the runtime's `GyreError`.

Policies import only messages and plain data, and this module: `gyre.runtime.errors` depends on nothing. Each
error also keeps the builtin it always was (mostly `ValueError`), so older `except ValueError` clauses still work.
"""

from __future__ import annotations

from gyre.runtime.errors import GyreError

__all__ = ["PolicyError"]


class PolicyError(GyreError):
    """Base of every error the policies layer raises on purpose (a bad input, a policy breaking its contract)."""
