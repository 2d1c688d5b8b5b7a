"""The actors layer's errors: one base, `ActorError`, under the runtime's `GyreError`; every wing's errors derive
from it (the wings share this module and nothing else). Each error also keeps the builtin it always was, so older
`except ValueError` / `except RuntimeError` clauses still catch it."""

from __future__ import annotations

from gyre.runtime.errors import GyreError

__all__ = ["ActorError"]


class ActorError(GyreError):
    """Base of every error the actors raise on purpose."""
