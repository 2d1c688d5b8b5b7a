"""The run's secret: one random key per run, from which every token that only the run may hold is derived.

Why one secret: an engine server's token, the bus's keys and anything else that must keep processes outside the run
out are all functions of it (HMAC-SHA256 of a purpose string), so a launcher hands its children one value and each
process derives what it needs. The secret lives in process memory only: it is never put in the environment (agents
inherit environments, and /proc/PID/environ is readable by the same uid), on a command line, in a config (configs
are recorded in event logs) or in a log. A launcher that starts children passes it through the start-up channel it
already has (multiprocessing's spawn pipe; Ray's actor arguments) and the child calls `install_run_secret` before it
starts anything.

A process that was handed none (a test, a one-process tool) makes one on first use.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading

__all__ = ["install_run_secret", "run_secret", "run_token"]

SECRET_BYTES = 32

_lock = threading.Lock()
_secret: bytes | None = None


def install_run_secret(secret: bytes) -> None:
    """Make `secret` this process's run secret (a launched child, before it starts its actors)."""
    global _secret
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise ValueError("a run secret is at least 16 random bytes")
    with _lock:
        _secret = secret


def run_secret() -> bytes:
    """This process's run secret, made on first use when no launcher installed one."""
    global _secret
    with _lock:
        if _secret is None:
            _secret = secrets.token_bytes(SECRET_BYTES)
        return _secret


def run_token(purpose: str) -> str:
    """A hex token for `purpose` (e.g. "engine"): the same in every process of the run, unguessable outside it."""
    if not purpose:
        raise ValueError("a token needs a purpose")
    return hmac.new(run_secret(), purpose.encode("utf-8"), hashlib.sha256).hexdigest()
