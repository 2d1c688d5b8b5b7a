"""A session's KV cache moves between two embedded engine servers (two processes) through Mooncake.

Server A generates on a prefix, exports the cached blocks; server B imports them (reading A's memory directly) and
serves its first request on that prefix from its cache, with the same log-probs A gives.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys

import pytest

from gyre.engines.sglang_client import KVTransferFailed, SGLangClient, finish_reason_type
from gyre.runtime.run_secrets import run_token


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gyre.engines.model_format import init_model_dir

    return init_model_dir(tmp_path_factory.mktemp("model"), preset="tiny", seed=0)


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """Two engine servers with --kv-transfer, each in its own process; yields their base URLs."""
    procs, urls = [], []
    logs = tmp_path_factory.mktemp("logs")
    for name in ("a", "b"):
        port = free_port()
        log = open(logs / f"{name}.log", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "gyre.engines.engine_server", "--model-dir", str(model_dir),
                 "--port", str(port), "--kv-transfer", "--num-threads", "1", "--num-blocks", "256",
                 "--max-context", "2048"],
                stdout=log,
                stderr=subprocess.STDOUT,
                # The servers check this process's engine token, which the clients here send by default.
                env=dict(os.environ, GYRE_ENGINE_API_KEY=run_token("engine")),
            )
        )
        urls.append(f"http://127.0.0.1:{port}")

    async def wait() -> None:
        for url, proc in zip(urls, procs):
            async with SGLangClient(url) as client:
                try:
                    await client.wait_healthy(timeout_s=120)
                except Exception:
                    proc.poll()
                    raise RuntimeError(f"{url} did not start (exit {proc.returncode}); see {logs}") from None

    try:
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


def test_prefix_moves_from_a_to_b(servers):
    url_a, url_b = servers
    rng = random.Random(7)
    prompt = [rng.randrange(1, 1900) for _ in range(150)]
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}

    async def main():
        async with SGLangClient(url_a) as a, SGLangClient(url_b) as b:
            first = await a.generate(prompt, greedy, rid="turn-1")
            history = prompt + first["output_ids"]  # A cached the computed part: 157 tokens, 9 full blocks
            export = await a.export_kv(history)
            assert export["num_tokens"] == 144
            assert export["transfer_peer"] and len(export["block_ids"]) == 9
            try:
                imported = await b.import_kv(history, export)
            finally:
                await a.release_kv(export["handle"])
            layout = export["layout"]
            assert imported["imported_tokens"] == 144
            assert imported["bytes"] == layout["num_layers"] * 2 * 9 * layout["block_nbytes"]
            # A has a staged copy of the nine blocks: B read them as one range, not one per (layer, K/V, block).
            assert export["staging_addr"] and export["staging_nbytes"] == imported["bytes"]

            # The next turn of the session, on B first (its first request on this prefix), then on A.
            turn = history + [rng.randrange(1, 1900) for _ in range(20)]
            on_b = await b.generate(turn, greedy, rid="turn-2-b")
            on_a = await a.generate(turn, greedy, rid="turn-2-a")
            assert on_b["meta_info"]["cached_tokens"] == 144
            assert on_a["meta_info"]["cached_tokens"] == 144
            assert finish_reason_type(on_b["meta_info"]) == "length"
            assert on_b["output_ids"] == on_a["output_ids"]
            # Same bytes of KV, same computation after them: the same tokens, and log-probs equal to float32 rounding.
            # (Bit-identical on the sessions 1-9 VM; on session 10's AMD EPYC VM two engine processes differ in the last
            # bits, ~5e-7, deterministically. A wrong or missing block moves a log-prob by far more than 1e-5.)
            lp_b, lp_a = on_b["meta_info"]["output_token_logprobs"], on_a["meta_info"]["output_token_logprobs"]
            assert [row[1:] for row in lp_b] == [row[1:] for row in lp_a]
            assert max(abs(b[0] - a[0]) for b, a in zip(lp_b, lp_a, strict=True)) < 1e-5

            # Importing again is a no-op: B already holds the prefix.
            export = await a.export_kv(history)
            try:
                assert (await b.import_kv(history, export))["imported_tokens"] == 0
            finally:
                await a.release_kv(export["handle"])

    asyncio.run(main())


def test_import_from_a_vanished_peer_fails_cleanly(servers):
    url_a, url_b = servers
    prompt = list(range(100, 180))

    async def main():
        async with SGLangClient(url_a) as a, SGLangClient(url_b) as b:
            await a.generate(prompt, {"max_new_tokens": 1, "temperature": 0.0})
            export = await a.export_kv(prompt)
            await a.release_kv(export["handle"])
            bogus = dict(export, transfer_peer=f"127.0.0.1:{free_port()}")  # nobody listens there
            with pytest.raises(KVTransferFailed, match="127.0.0.1"):
                await b.import_kv(prompt, bogus)
            # B freed the blocks it had allocated and still serves, without the prefix cached.
            out = await b.generate(prompt, {"max_new_tokens": 2, "temperature": 0.0})
            assert out["meta_info"]["cached_tokens"] == 0
            stats_ok = await b.health()
            assert stats_ok

    asyncio.run(main())
