"""The engines layer's errors: one base, `EngineError`, under the runtime's `GyreError`.

Each error also keeps the builtin it always was (`ValueError` for bad input, `RuntimeError` for a failure outside
the caller's control), so an `except ValueError` written before this family existed still catches it.
"""

from __future__ import annotations

from gyre.runtime.errors import GyreError

__all__ = ["EngineError"]


class EngineError(GyreError):
    """Base of every error the engines layer raises on purpose."""
