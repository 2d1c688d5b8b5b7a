"""The run secret: tokens derived from it are per purpose, the same in every process of a run, and a launched
child gets its parent's secret through the spawn pipe, not the environment."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from gyre.runtime import run_secrets


def _child_token(secret: bytes, queue) -> None:
    run_secrets.install_run_secret(secret)
    queue.put((run_secrets.run_token("engine"), {k for k in os.environ if "GYRE" in k and "SECRET" in k}))


def test_tokens_differ_by_purpose_and_are_stable() -> None:
    first = run_secrets.run_token("engine")
    assert first == run_secrets.run_token("engine")
    assert first != run_secrets.run_token("bus")
    assert len(first) == 64 and int(first, 16) >= 0


def test_a_spawned_child_derives_the_same_token_without_the_environment() -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_child_token, args=(run_secrets.run_secret(), queue))
    child.start()
    token, secret_vars = queue.get(timeout=60)
    child.join(timeout=60)
    assert token == run_secrets.run_token("engine")
    assert secret_vars == set()


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        run_secrets.install_run_secret(b"short")
    with pytest.raises(ValueError):
        run_secrets.run_token("")
