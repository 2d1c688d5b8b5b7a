"""The embedded engine's HTTP server on 127.0.0.1: SGLang-shaped happy paths, control calls, 4xx answers, a KV
prefix moved between two servers through Mooncake, and its access rules (key, JSON bodies, no browsers)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import aiohttp
import pytest
import torch
from aiohttp import web

from gyre.engines.async_engine import AsyncEngine
from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig
from gyre.engines.engine_server import API_KEY_ENV, OPEN_PATHS, ROUTES, build_engine_app, main
from gyre.engines.errors import EngineKeyError
from gyre.engines.sglang_client import SGLangClient, auth_headers

transformers = pytest.importorskip("transformers")

VOCAB = 256
CONFIG = EngineConfig(block_size_tokens=4, num_blocks=256, max_context_tokens=256, max_prefill_tokens=64)


def build_model_dir(path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
        initializer_range=0.1,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("server_model") / "model", seed=0)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("server_model_b") / "model", seed=1)


def authed_session() -> aiohttp.ClientSession:
    """A session that sends the run's engine token, as the run's own clients do."""
    return aiohttp.ClientSession(headers=auth_headers())


@contextlib.asynccontextmanager
async def serve(model_dir: Path, agent: Any = None, **app_options: Any) -> AsyncIterator[str]:
    engine = AsyncEngine(EmbeddedEngine(model_dir, CONFIG))
    runner = web.AppRunner(build_engine_app(engine, agent, **app_options))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await engine.close()


async def post(session: aiohttp.ClientSession, url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else json.dumps(body if body is not None else {}).encode()
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        text = await resp.text()
        return resp.status, json.loads(text) if text else None


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        return resp.status, await resp.json()


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = {"max_new_tokens": 8, "temperature": 0}


def test_generate_returns_sglang_shape_and_reuses_the_cache(model_dir: Path) -> None:
    async def main() -> None:
        async with serve(model_dir) as base, authed_session() as s:
            prompt = ids(1, 30)
            status, first = await post(s, base + "/generate", {
                "input_ids": prompt, "sampling_params": GREEDY, "rid": "one", "return_logprob": True,
            })
            assert status == 200, first
            meta = first["meta_info"]
            assert meta["id"] == "one"
            assert meta["finish_reason"] == {"type": "length", "length": 8}
            assert meta["prompt_tokens"] == 30 and meta["completion_tokens"] == 8 and meta["cached_tokens"] == 0
            assert meta["weight_version"] == 0 and meta["output_token_versions"] == [0] * 8
            assert len(first["output_ids"]) == 8 and first["text"] == ""
            logprobs = meta["output_token_logprobs"]
            assert [t for _, t, _ in logprobs] == first["output_ids"]
            assert all(lp <= 0 and text is None for lp, _, text in logprobs)
            assert meta["e2e_latency"] >= 0

            status, again = await post(s, base + "/generate", {"input_ids": prompt, "sampling_params": GREEDY})
            assert status == 200
            assert again["output_ids"] == first["output_ids"]
            assert again["meta_info"]["cached_tokens"] == 28  # whole blocks of the 29 computed prompt tokens
            assert "output_token_logprobs" not in again["meta_info"]  # return_logprob defaults to false

            # Prompt log-probs (SGLang's input_token_logprobs) from logprob_start_len on; the first has none.
            _, scored = await post(s, base + "/generate", {"input_ids": prompt, "sampling_params": GREEDY,
                                                           "return_logprob": True, "logprob_start_len": 0})
            inputs = scored["meta_info"]["input_token_logprobs"]
            assert len(inputs) == 30 and inputs[0] == [None, prompt[0], None]
            assert [t for _, t, _ in inputs] == prompt and all(lp <= 0 for lp, _, _ in inputs[1:])
            assert [t for _, t, _ in scored["meta_info"]["output_token_logprobs"]] == first["output_ids"]
            for (a, _, _), (b, _, _) in zip(scored["meta_info"]["output_token_logprobs"], logprobs):
                assert abs(a - b) < 1e-4  # a cache hit changes the summation order, not the result

            status, load = await get(s, base + "/get_load")
            assert status == 200 and load["prompt_tokens_total"] == 90 and load["cached_tokens_total"] == 56
            status, info = await get(s, base + "/model_info")
            assert info["weight_version"] == 0 and info["is_generation"] and info["model_path"] == str(model_dir)
            status, health = await get(s, base + "/health")
            assert status == 200

    asyncio.run(main())


def test_stop_token_and_streaming(model_dir: Path) -> None:
    async def main() -> None:
        async with serve(model_dir) as base, authed_session() as s:
            prompt = ids(2, 12)
            sampling = {"max_new_tokens": 10, "temperature": 1.0, "seed": 9}
            _, plain = await post(s, base + "/generate", {"input_ids": prompt, "sampling_params": sampling,
                                                          "return_logprob": True})
            out = plain["output_ids"]
            stop_at = next(j for j in range(1, 10) if out[j] not in out[:j])
            _, stopped = await post(s, base + "/generate", {
                "input_ids": prompt, "sampling_params": {**sampling, "stop_token_ids": [out[stop_at]]},
            })
            assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": out[stop_at]}
            assert stopped["output_ids"] == out[: stop_at + 1]

            chunks = []
            async with s.post(base + "/generate", json={"input_ids": prompt, "sampling_params": sampling,
                                                        "return_logprob": True, "stream": True}) as resp:
                assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if line.startswith("data:"):
                        chunks.append(line[5:].strip())
            assert chunks[-1] == "[DONE]"
            events = [json.loads(c) for c in chunks[:-1]]
            assert len(events) == 10
            assert [len(e["output_ids"]) for e in events] == list(range(1, 11))  # cumulative
            assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
            assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
            assert events[-1]["output_ids"] == out
            assert events[-1]["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"]

    asyncio.run(main())


def test_pause_continue_abort_and_flush(model_dir: Path) -> None:
    async def main() -> None:
        async with serve(model_dir) as base, authed_session() as s:
            long = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}
            status, paused = await post(s, base + "/pause_generation", {"mode": "in_place"})
            assert status == 200
            task = asyncio.ensure_future(post(s, base + "/generate", {"input_ids": ids(3, 10),
                                                                      "sampling_params": GREEDY}))
            for _ in range(200):
                _, load = await get(s, base + "/get_load")
                if load["waiting"] == 1:
                    break
                await asyncio.sleep(0.01)
            assert load["waiting"] == 1 and load["paused"] and not task.done()
            status, _ = await post(s, base + "/flush_cache")
            assert status == 200  # allowed while paused
            status, _ = await post(s, base + "/continue_generation")
            assert status == 200
            status, result = await task
            assert status == 200 and result["meta_info"]["finish_reason"]["type"] == "length"

            task = asyncio.ensure_future(post(s, base + "/generate", {"input_ids": ids(4, 10), "rid": "victim",
                                                                      "sampling_params": long}))
            for _ in range(200):
                _, load = await get(s, base + "/get_load")
                if load["running"] == 1:
                    break
                await asyncio.sleep(0.01)
            status, body = await post(s, base + "/flush_cache")
            assert status == 400 and "in flight" in body["error"]["message"]
            status, _ = await post(s, base + "/abort_request", {"rid": "victim"})
            assert status == 200
            status, result = await task
            assert status == 200 and result["meta_info"]["finish_reason"]["type"] == "abort"

            task = asyncio.ensure_future(post(s, base + "/generate", {"input_ids": ids(5, 10),
                                                                      "sampling_params": long}))
            await asyncio.sleep(0.05)
            status, _ = await post(s, base + "/abort_request", {"rid": "", "abort_all": True})
            assert status == 200
            assert (await task)[1]["meta_info"]["finish_reason"]["type"] == "abort"
            status, _ = await post(s, base + "/flush_cache")
            assert status == 200

    asyncio.run(main())


def test_weight_updates_and_memory(model_dir: Path, other_model_dir: Path) -> None:
    from safetensors.torch import load_file, save

    async def main() -> None:
        async with serve(model_dir) as base, authed_session() as s:
            prompt = ids(6, 16)
            _, before = await post(s, base + "/generate", {"input_ids": prompt, "sampling_params": GREEDY})
            payload = base64.b64encode(save(load_file(str(other_model_dir / "model.safetensors")))).decode()
            status, body = await post(s, base + "/update_weights_from_tensor", {
                "serialized_named_tensors": [payload], "load_format": None, "flush_cache": True,
                "weight_version": "7",
            })
            assert status == 200 and body["success"] and body["weight_version"] == 7
            _, after = await post(s, base + "/generate", {"input_ids": prompt, "sampling_params": GREEDY})
            assert after["meta_info"]["weight_version"] == 7 and after["meta_info"]["cached_tokens"] == 0
            assert after["output_ids"] != before["output_ids"]

            status, body = await post(s, base + "/update_weights_from_disk",
                                      {"model_path": str(model_dir), "weight_version": "8"})
            assert status == 200 and body["success"]
            _, again = await post(s, base + "/generate", {"input_ids": prompt, "sampling_params": GREEDY})
            assert again["output_ids"] == before["output_ids"] and again["meta_info"]["weight_version"] == 8
            assert (await get(s, base + "/model_info"))[1]["weight_version"] == 8

            status, _ = await post(s, base + "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
            assert status == 200
            status, body = await post(s, base + "/generate", {"input_ids": prompt, "sampling_params": GREEDY})
            # 503, not 400: the call is fine, this engine cannot take it now (its cell trains), so the proxy retries
            # it on another cell instead of failing it.
            assert status == 503 and "released" in body["error"]["message"]
            assert body["error"]["type"] == "engine_released"
            status, _ = await post(s, base + "/resume_memory_occupation", {"tags": None})
            assert status == 200
            _, resumed = await post(s, base + "/generate", {"input_ids": prompt, "sampling_params": GREEDY})
            assert resumed["output_ids"] == before["output_ids"]

    asyncio.run(main())


BAD_REQUESTS = [
    ("/generate", b"{not json"),
    ("/generate", b"[1, 2, 3]"),
    ("/generate", {"input_ids": [1, 2], "bogus": 1}),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"min_p": 0.1}}),
    ("/generate", {"input_ids": []}),
    ("/generate", {"sampling_params": GREEDY}),
    ("/generate", {"input_ids": [[1, 2], [3]]}),
    ("/generate", {"input_ids": [1] * 300}),
    ("/generate", {"input_ids": [1, VOCAB]}),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": -1}}),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"top_p": 0}}),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "many"}}),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop": ["END"]}}),  # no tokenizer.json
    ("/generate", {"input_ids": [1, 2], "rid": 5}),
    ("/generate", {"input_ids": [1, 2], "return_logprob": "yes"}),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 5}),
    ("/generate", {"input_ids": [1, 2], "stream": True, "sampling_params": {"top_k": -5}}),
    ("/pause_generation", {"mode": "sideways"}),
    ("/abort_request", {}),
    ("/update_weights_from_disk", {}),
    ("/update_weights_from_disk", {"model_path": "/nonexistent/model"}),
    ("/update_weights_from_disk", {"model_path": "/x", "weight_version": "v2"}),
    ("/update_weights_from_tensor", {"serialized_named_tensors": "not base64!"}),
    ("/update_weights_from_tensor", {"serialized_named_tensors": base64.b64encode(b"garbage").decode()}),
    ("/release_memory_occupation", {"tags": ["gpu"]}),
    ("/gyre/kv/export", {"input_ids": "abc"}),
    ("/gyre/kv/import", {"input_ids": [1, 2], "export": {}}),  # this server has no transfer agent
    ("/gyre/kv/release", {"handle": "export-99"}),
]


def test_bad_requests_get_400_and_the_server_survives(model_dir: Path) -> None:
    async def main() -> None:
        async with serve(model_dir) as base, authed_session() as s:
            for path, body in BAD_REQUESTS:
                if isinstance(body, bytes):
                    status, answer = await post(s, base + path, raw=body)
                else:
                    status, answer = await post(s, base + path, body)
                assert status == 400, (path, body, answer)
                assert set(answer) == {"error"} and answer["error"]["message"], (path, answer)
                assert answer["error"]["type"]
            async with s.get(base + "/generate") as resp:
                assert resp.status == 405
            status, _ = await get(s, base + "/health")
            assert status == 200
            status, ok = await post(s, base + "/generate", {"input_ids": [1, 2, 3], "sampling_params": GREEDY})
            assert status == 200 and len(ok["output_ids"]) == 8

    asyncio.run(main())


def test_kv_prefix_moves_between_two_servers_through_mooncake(model_dir: Path) -> None:
    pytest.importorskip("mooncake.engine")
    from gyre.engines.transfer import TransferAgent

    async def main() -> None:
        with TransferAgent() as source_agent, TransferAgent() as target_agent:
            async with serve(model_dir, source_agent) as src, serve(model_dir, target_agent) as dst, \
                    authed_session() as s:
                # Fill a few blocks on the target first so the two pools' block ids differ.
                await post(s, dst + "/generate", {"input_ids": ids(7, 40), "sampling_params": GREEDY})
                prompt = ids(8, 45)
                _, turn = await post(s, src + "/generate", {"input_ids": prompt, "sampling_params": GREEDY})
                session = prompt + turn["output_ids"]
                status, export = await post(s, src + "/gyre/kv/export", {"input_ids": session})
                assert status == 200, export
                assert export["num_tokens"] == 52 and export["transfer_peer"] == source_agent.peer
                assert export["layout"]["block_size_tokens"] == 4

                for bad in (dict(export, staging_addr=-1), dict(export, staging_nbytes="8")):
                    status, answer = await post(s, dst + "/gyre/kv/import", {"input_ids": session, "export": bad})
                    assert status == 400 and "staging" in answer["error"]["message"], answer
                status, answer = await post(s, dst + "/gyre/kv/import",
                                            {"input_ids": session, "export": dict(export, staging_nbytes=8)})
                assert status == 400 and "stages 8 bytes" in answer["error"]["message"], answer
                status, imported = await post(s, dst + "/gyre/kv/import", {"input_ids": session, "export": export})
                assert status == 200, imported
                assert imported["imported_tokens"] == 52
                assert imported["bytes"] == 13 * export["layout"]["block_nbytes"] * 2 * 2  # blocks x (k, v) x layers
                assert export["staging_nbytes"] == imported["bytes"]  # moved as one staged range
                status, _ = await post(s, src + "/gyre/kv/release", {"handle": export["handle"]})
                assert status == 200

                follow = session + ids(9, 7)
                _, on_target = await post(s, dst + "/generate", {"input_ids": follow, "sampling_params": GREEDY,
                                                                 "return_logprob": True})
                _, on_source = await post(s, src + "/generate", {"input_ids": follow, "sampling_params": GREEDY,
                                                                 "return_logprob": True})
                assert on_target["meta_info"]["cached_tokens"] == 52
                assert on_target["output_ids"] == on_source["output_ids"]
                for (a, _, _), (b, _, _) in zip(on_target["meta_info"]["output_token_logprobs"],
                                                on_source["meta_info"]["output_token_logprobs"]):
                    assert abs(a - b) < 1e-4

    asyncio.run(main())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- access: key, JSON bodies, no browsers --------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(model_dir: Path) -> Iterator[str]:
    """One server (in-run key, one allowed origin) on its own event loop thread, shared by the refusal tests:
    a refused request never reaches the engine, so they cannot disturb one another."""
    loop = asyncio.new_event_loop()
    started: dict[str, Any] = {}

    async def start() -> None:
        engine = AsyncEngine(EmbeddedEngine(model_dir, CONFIG))
        runner = web.AppRunner(build_engine_app(engine, allowed_origins=["http://127.0.0.1:8265"]))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        started.update(engine=engine, runner=runner, url=f"http://127.0.0.1:{runner.addresses[0][1]}")

    async def stop() -> None:
        await started["runner"].cleanup()
        await started["engine"].close()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=120)
    try:
        yield started["url"]
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


async def call(url: str, method: str, headers: dict[str, str], data: bytes | None = None) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url, headers=headers, data=data) as resp:
            text = await resp.text()
            return resp.status, json.loads(text) if text else None, resp.headers


JSON = {"Content-Type": "application/json"}
GUARDED_ROUTES = [(method, path) for method, path, _ in ROUTES if path not in OPEN_PATHS]


def test_the_app_serves_exactly_the_route_table(model_dir: Path) -> None:
    async def main() -> None:
        engine = AsyncEngine(EmbeddedEngine(model_dir, CONFIG))
        try:
            app = build_engine_app(engine)
            served = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
            assert served == {(method, path) for method, path, _ in ROUTES}
        finally:
            await engine.close()

    asyncio.run(main())
    assert OPEN_PATHS == {"/health"} and len(GUARDED_ROUTES) == len(ROUTES) - 1


@pytest.mark.parametrize("key", [None, "wrong-key-of-sixteen-or-more", "bearer-without-prefix"])
@pytest.mark.parametrize(("method", "path"), GUARDED_ROUTES)
def test_every_route_but_health_refuses_a_missing_or_wrong_key(guarded: str, method: str, path: str,
                                                              key: str | None) -> None:
    headers = dict(JSON)
    if key == "bearer-without-prefix":
        headers["Authorization"] = auth_headers()["Authorization"].removeprefix("Bearer ")
    elif key is not None:
        headers.update(auth_headers(key))
    body = b"{}" if method == "POST" else None
    status, answer, response_headers = asyncio.run(call(guarded + path, method, headers, body))
    assert status == 401, (path, answer)
    assert answer["error"]["type"] == "authentication_error" and answer["error"]["message"]
    assert response_headers["WWW-Authenticate"] == "Bearer"
    assert key is None or key not in json.dumps(answer)


def test_health_is_open_and_the_right_key_gets_through(guarded: str) -> None:
    async def main() -> None:
        assert (await call(guarded + "/health", "GET", {}))[0] == 200
        status, info, _ = await call(guarded + "/model_info", "GET", auth_headers())
        assert status == 200 and info["is_generation"]
        # A POST without a body needs no content type (curl -X POST); the in-run client reaches the server.
        assert (await call(guarded + "/continue_generation", "POST", auth_headers()))[0] == 200
        async with SGLangClient(guarded) as client:
            assert (await client.model_info())["is_generation"]

    asyncio.run(main())


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]
)
def test_a_post_body_that_is_not_json_is_refused(guarded: str, content_type: str | None) -> None:
    headers = auth_headers()
    if content_type is not None:
        headers["Content-Type"] = content_type
    body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": GREEDY}).encode()  # JSON, but not labelled so
    status, answer, _ = asyncio.run(call(guarded + "/generate", "POST", headers, body))
    assert status == 415, answer
    assert answer["error"]["type"] == "unsupported_media_type"


@pytest.mark.parametrize("path", ["/generate", "/health", "/model_info"])
def test_a_request_from_a_web_page_is_refused(guarded: str, path: str) -> None:
    async def main() -> None:
        method, body = ("POST", b"{}") if path == "/generate" else ("GET", None)
        for origin in ("http://evil.example", "null", "http://127.0.0.1:30000"):
            status, answer, _ = await call(guarded + path, method, {**auth_headers(), **JSON, "Origin": origin}, body)
            assert status == 403 and answer["error"]["type"] == "forbidden_origin", (origin, answer)
        # The one origin this server allows gets the usual answer.
        status, _, _ = await call(guarded + path, method, {**auth_headers(), **JSON,
                                                           "Origin": "http://127.0.0.1:8265"}, body)
        assert status == (400 if path == "/generate" else 200)

    asyncio.run(main())


def test_an_explicit_key_replaces_the_run_token(model_dir: Path) -> None:
    key = "k" * 40

    async def main() -> None:
        async with serve(model_dir, api_key=key) as base:
            assert (await call(base + "/get_load", "GET", auth_headers()))[0] == 401
            assert (await call(base + "/get_load", "GET", auth_headers(key)))[0] == 200
            async with SGLangClient(base, api_key=key) as client:
                assert "running" in await client._get("/get_load")

    asyncio.run(main())
    with pytest.raises(EngineKeyError, match="16 characters"):
        asyncio.run(serve(model_dir, api_key="short").__aenter__())


@pytest.mark.parametrize(
    ("argv", "env_key", "message"),
    [
        (["--api-key-file", "/nonexistent/key"], None, "cannot read the engine API key file"),
        (["--api-key", "too-short"], None, "at least 16 characters"),
        (["--api-key", "has a space in the middle"], None, "without spaces"),
        ([], "env-key-short", "at least 16 characters"),
        (["--api-key", "x" * 20, "--api-key-file", "/k"], None, "not allowed with"),
    ],
)
def test_the_command_line_refuses_a_bad_key_without_echoing_it(
    argv: list[str], env_key: str | None, message: str, capsys: pytest.CaptureFixture, monkeypatch
) -> None:
    if env_key is None:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(API_KEY_ENV, env_key)
    with pytest.raises(SystemExit) as exit_info:
        main(["--model-dir", "/nonexistent/model"] + argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    keys = [env_key] if env_key else [a for a in argv if not a.startswith("-") and "/" not in a]
    for key in keys:
        assert key not in err


def start_server(model_dir: Path, log_path: Path, argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gyre.engines.engine_server", "--model-dir", str(model_dir), "--host", "127.0.0.1",
         "--port", str(port), "--num-blocks", "64", "--max-context", "128", "--num-threads", "1", *argv],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    log.close()
    return proc, f"http://127.0.0.1:{port}"


async def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path) -> None:
    async with SGLangClient(url) as client:
        for _ in range(600):
            if await client.health():
                return
            if proc.poll() is not None:
                raise AssertionError(log_path.read_text())
            await asyncio.sleep(0.1)
    raise AssertionError(f"{url} not healthy; log: {log_path.read_text()}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def test_command_line_server_starts_and_answers_with_a_key_file(model_dir: Path, tmp_path: Path) -> None:
    key = "0123456789abcdef" * 4
    key_file = tmp_path / "engine.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    proc, url = start_server(model_dir, tmp_path / "server.log", ["--api-key-file", str(key_file)], env)

    async def main() -> None:
        await wait_healthy(url, proc, tmp_path / "server.log")
        async with aiohttp.ClientSession(headers=auth_headers(key)) as s:
            status, out = await post(s, url + "/generate", {"input_ids": [1, 2, 3], "sampling_params": GREEDY})
            assert status == 200 and len(out["output_ids"]) == 8
        # The test's run token is not this server's key.
        assert (await call(url + "/get_load", "GET", auth_headers()))[0] == 401

    try:
        asyncio.run(main())
    finally:
        stop_server(proc)
    assert key not in (tmp_path / "server.log").read_text()


def test_command_line_server_without_a_key_writes_one_to_a_private_file(model_dir: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)  # where the key's directory goes: inside this test's folder
    log_path = tmp_path / "server.log"
    proc, url = start_server(model_dir, log_path, [], env)
    try:
        asyncio.run(wait_healthy(url, proc, log_path))
        found = re.search(r"engine_api_key_file_written\s+path=(\S+)", log_path.read_text())
        assert found, log_path.read_text()
        key_path = Path(found.group(1))
        assert key_path.parent.parent == tmp_path
        assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(key_path.parent.stat().st_mode) == 0o700
        key = key_path.read_text().strip()
        assert len(key) == 64

        async def main() -> None:
            assert (await call(url + "/get_load", "GET", {}))[0] == 401
            status, load, _ = await call(url + "/get_load", "GET", auth_headers(key))
            assert status == 200 and load["running"] == 0
            async with SGLangClient(url, api_key=key) as client:
                out = await client.generate([1, 2, 3], GREEDY)
                assert len(out["output_ids"]) == 8

        asyncio.run(main())
    finally:
        stop_server(proc)
    output = log_path.read_text()
    assert key not in output and "engine_server_starting" in output
    assert not key_path.parent.exists()  # the key went with the server
