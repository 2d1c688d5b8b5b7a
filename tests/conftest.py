"""Fixtures shared by every test tier.

The tiny model directory is built once per session (tokenizer training and weight init take a few seconds); tests
that change weights must copy it first (`copy_model_dir`).
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete tiny model directory (config, weights, tokenizer, chat template), seed 0. Treat as read-only."""
    from gyre.engines.model_format import init_model_dir

    return init_model_dir(tmp_path_factory.mktemp("tiny-model"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def bare_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with only config.json and model.safetensors: what an ids-only engine must accept."""
    target = tmp_path_factory.mktemp("bare-model")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, target / name)
    return target


@pytest.fixture(scope="session")
def chat_template(tiny_model_dir: Path):
    """`ChatTemplate` of the tiny model."""
    from gyre.engines.chat_template import ChatTemplate

    return ChatTemplate.from_model_dir(tiny_model_dir)


@pytest.fixture
def copy_model_dir(tiny_model_dir: Path, tmp_path: Path):
    """Return a function that copies the tiny model directory into this test's tmp dir (for tests that write)."""

    def copy(name: str = "model") -> Path:
        return Path(shutil.copytree(tiny_model_dir, tmp_path / name))

    return copy


@pytest.fixture
def writable_cgroup_cpu():
    """This machine's cgroup CPU controller (`CgroupCpu`) where this process may make groups in it; skips otherwise
    (a container without cgroup access, a user without root)."""
    import os

    from gyre.runtime.cpu_limits import CpuLimitsUnavailable, find_cgroup_cpu

    try:
        controller = find_cgroup_cpu()
    except CpuLimitsUnavailable as error:
        pytest.skip(f"no cgroup CPU controller here: {error}")
    if not os.access(controller.own_group, os.W_OK):
        pytest.skip(f"{controller.own_group} is not writable here")
    return controller


@pytest.fixture(scope="session")
def kills_its_warm_launcher() -> str:
    """Source of a script that SIGKILLs the warm launcher's server it was forked from (nothing else), then sleeps."""
    return textwrap.dedent("""
        import os, pathlib, signal, time
        parent = pathlib.Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
        if b"warm_launcher_server" in parent:  # never kill anything but the fork server this came from
            os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(600)
    """)
