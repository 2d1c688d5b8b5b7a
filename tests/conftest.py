"""Fixtures shared by every test tier.

The tiny model directory is built once per session (tokenizer training and weight init take a few seconds); tests
that change weights must copy it first (`copy_model_dir`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import pytest
import structlog


@pytest.fixture(autouse=True)
def _structlog_config_restored() -> Iterator[None]:
    """Every test leaves structlog as it found it. Tests run in xdist workers, each a string of modules; one that
    configured logging (a CLI run in-process sets the level) once filtered the info lines a later module's
    capture_logs expected."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _engine_servers(model_dir: Path, logs: Path, servers: Mapping[str, Sequence[str]]) -> Iterator[dict[str, str]]:
    """Start one `python -m gyre.engines.engine_server` process per name (its extra flags beside it), wait until all
    answer /health, yield name -> base URL, and stop them. The servers check this process's engine token, which the
    proxy, the migrator and the clients run in this process send by default, as a cell's in-run server would."""
    from gyre.engines.sglang_client import SGLangClient
    from gyre.runtime.run_secrets import run_token

    procs, urls = [], {}
    env = dict(os.environ, GYRE_ENGINE_API_KEY=run_token("engine"))
    try:
        for name, extra in servers.items():
            port = _free_port()
            argv = [sys.executable, "-m", "gyre.engines.engine_server", "--model-dir", str(model_dir),
                    "--port", str(port), "--num-threads", "1", "--num-blocks", "512", *extra]
            with open(logs / f"{name}.log", "w") as out:
                procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env))
            urls[name] = f"http://127.0.0.1:{port}"

        async def wait() -> None:
            for url in urls.values():
                async with SGLangClient(url) as client:
                    await client.wait_healthy(timeout_s=180)

        asyncio.run(wait())
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="session")
def engine_servers():
    """`with engine_servers(model_dir, logs_dir, {name: extra_flags}) as urls:` engine servers in processes of
    their own (see `_engine_servers`)."""
    return _engine_servers
