"""SGLangClient against a stand-in for a real SGLang server (an aiohttp app with SGLang's routes, no /gyre/kv/*).

The stand-in is the outer edge we cannot run here (SGLang needs a GPU); the client under test is real. The client
against Gyre's embedded server is covered in tests/integration/test_kv_migration.py and the engine server's tests.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from gyre.engines.errors import EngineError
from gyre.engines.sglang_client import (
    CapabilityMissing,
    ClientConfig,
    EngineKeyError,
    EngineTimeout,
    EngineUnauthorized,
    EngineUnreachable,
    RequestRejected,
    ServerError,
    SGLangClient,
    SGLangError,
    finish_reason_type,
    read_api_key_file,
)


SEEN = web.AppKey("seen", list)


def sglang_api_key_middleware(api_key: str):
    """SGLang's `add_api_key_middleware` (utils.py) as aiohttp middleware: the same exemptions, the same exact
    header comparison, the same 401 body."""

    @web.middleware
    async def authentication(request: web.Request, handler):
        if request.method == "OPTIONS" or request.path.startswith(("/health", "/metrics")):
            return await handler(request)
        if request.headers.get("Authorization") != "Bearer " + api_key:
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return authentication


def fake_sglang(api_key: str | None = None) -> web.Application:
    """Routes and shapes as in SGLang 0.5's http_server.py; the 'model' echoes the prompt back. With `api_key`,
    the server checks it as SGLang started with --api-key does."""
    seen: list[dict] = []

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        params = body.get("sampling_params", {})
        if params.get("max_new_tokens", 1) < 0:
            return web.json_response({"error": {"message": "max_new_tokens must be at least 0"}}, status=400)
        if params.get("temperature") == 99:
            return web.Response(status=500, text="Internal Server Error")
        if params.get("temperature") == 42:
            await asyncio.sleep(1.0)
        n = params.get("max_new_tokens", 1)
        ids = [(t + 1) % 100 for t in body["input_ids"]][:n]
        meta = {
            "id": body.get("rid", "r"),
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": "default",
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in ids]
        if not body.get("stream"):
            return web.json_response({"text": "", "output_ids": ids, "meta_info": meta})
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(1, len(ids) + 1):
            chunk = {"text": "", "output_ids": ids[:i], "meta_info": meta}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def flush_cache(request: web.Request) -> web.Response:
        return web.Response(status=400, text="Cache not flushed, because there are pending requests.")

    async def update_from_disk(request: web.Request) -> web.Response:
        body = await request.json()
        ok = body["model_path"] == "/good"
        message = "ok" if ok else "no such checkpoint"
        return web.json_response({"success": ok, "message": message, "num_paused_requests": 0})

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "/m", "weight_version": "default", "is_generation": True})

    async def ok(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.Response(status=200)

    app = web.Application(middlewares=[sglang_api_key_middleware(api_key)] if api_key is not None else [])
    app[SEEN] = seen
    app.router.add_post("/generate", generate)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/update_weights_from_disk", update_from_disk)
    app.router.add_get("/health", health)
    app.router.add_get("/model_info", model_info)
    app.router.add_post("/abort_request", ok)
    app.router.add_post("/pause_generation", ok)
    return app


@pytest.fixture
def server():
    """Runs the stand-in on a free port in the test's event loop; yields (base_url, app)."""

    class Server:
        def __init__(self, api_key: str | None = None) -> None:
            self.api_key = api_key

        async def __aenter__(self):
            self.app = fake_sglang(self.api_key)
            self.runner = web.AppRunner(self.app)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            return self

        async def __aexit__(self, *exc):
            await self.runner.cleanup()

    return Server


def run(coro):
    return asyncio.run(coro)


def test_generate_returns_sglang_shape(server):
    async def main():
        async with server() as s, SGLangClient(s.url) as client:
            out = await client.generate([1, 2, 3], {"max_new_tokens": 2}, rid="a")
            assert out["output_ids"] == [2, 3]
            assert out["meta_info"]["output_token_logprobs"] == [[-0.5, 2, None], [-0.5, 3, None]]
            assert finish_reason_type(out["meta_info"]) == "length"
            sent = s.app[SEEN][-1]
            assert sent["rid"] == "a" and sent["return_logprob"] is True and sent["logprob_start_len"] == -1

    run(main())


def test_generate_stream_yields_chunks(server):
    async def main():
        async with server() as s, SGLangClient(s.url) as client:
            chunks = [c async for c in client.generate_stream([5, 6, 7], {"max_new_tokens": 3})]
            assert [c["output_ids"] for c in chunks] == [[6], [6, 7], [6, 7, 8]]

    run(main())


def test_kv_endpoints_missing_on_sglang_raise_capability_missing(server):
    async def main():
        async with server() as s, SGLangClient(s.url) as client:
            with pytest.raises(CapabilityMissing, match="/gyre/kv/export"):
                await client.export_kv([1, 2, 3])
            with pytest.raises(CapabilityMissing):
                await client.import_kv([1, 2, 3], {"handle": "h"})
            with pytest.raises(CapabilityMissing):
                await client.release_kv("h")

    run(main())


def test_errors_are_typed_and_carry_the_server_message(server):
    async def main():
        async with server() as s, SGLangClient(s.url) as client:
            with pytest.raises(RequestRejected, match="max_new_tokens must be at least 0") as info:
                await client.generate([1], {"max_new_tokens": -1})
            assert info.value.status == 400 and info.value.endpoint == "/generate"
            with pytest.raises(ServerError) as info:
                await client.generate([1], {"temperature": 99})
            assert info.value.status == 500
            with pytest.raises(RequestRejected, match="no such checkpoint"):
                await client.update_weights_from_disk("/bad", weight_version=3)
            assert (await client.update_weights_from_disk("/good"))["success"] is True
            assert await client.flush_cache() is False  # SGLang's 400 while requests are pending
            with pytest.raises(ValueError):
                await client.generate([], {})
            with pytest.raises(ValueError):
                await client.pause("sideways")

    run(main())


def test_control_calls_send_sglang_bodies(server):
    async def main():
        async with server() as s, SGLangClient(s.url) as client:
            await client.abort("r1")
            await client.abort()
            await client.pause("in_place")
            assert s.app[SEEN][-3:] == [{"rid": "r1"}, {"rid": "", "abort_all": True}, {"mode": "in_place"}]
            assert await client.health() is True
            assert (await client.model_info())["model_path"] == "/m"
            await client.wait_healthy(timeout_s=1.0)

    run(main())


def test_timeout_and_unreachable(server):
    async def main():
        async with server() as s:
            async with SGLangClient(s.url, config=ClientConfig(generate_timeout_s=0.2)) as client:
                with pytest.raises(EngineTimeout):
                    await client.generate([1], {"temperature": 42})
            url = s.url
        # The server is gone now: its port refuses connections.
        async with SGLangClient(url) as client:
            with pytest.raises(EngineUnreachable):
                await client.generate([1], {})
            assert await client.health() is False
            with pytest.raises(EngineTimeout):
                await client.wait_healthy(timeout_s=0.3, poll_interval_s=0.05)

    run(main())


def test_base_url_validation():
    with pytest.raises(ValueError):
        SGLangClient("127.0.0.1:30000")


def test_the_client_talks_to_an_sglang_server_started_with_a_key(server, tmp_path):
    key = "sk-real-sglang-key"
    key_file = tmp_path / "sglang.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)

    async def main():
        async with server(api_key=key) as s:
            async with SGLangClient(s.url, api_key=key) as client:
                assert (await client.generate([1, 2], {"max_new_tokens": 1}))["output_ids"] == [2]
                chunks = [c async for c in client.generate_stream([1, 2], {"max_new_tokens": 2})]
                assert chunks[-1]["output_ids"] == [2, 3]
            async with SGLangClient(s.url, config=ClientConfig(api_key_file=str(key_file))) as client:
                await client.pause("in_place")
            # Without the server's key the client holds the run's token, which this server does not know.
            async with SGLangClient(s.url) as client:
                assert await client.health() is True  # SGLang leaves /health open
                with pytest.raises(EngineUnauthorized, match="Unauthorized") as info:
                    await client.generate([1], {})
                assert info.value.status == 401 and isinstance(info.value, RequestRejected)
                with pytest.raises(EngineUnauthorized):
                    async for _ in client.generate_stream([1], {}):
                        pass
                with pytest.raises(EngineUnauthorized):
                    await client.model_info()
            async with SGLangClient(s.url, api_key="sk-other") as client:
                with pytest.raises(EngineUnauthorized):
                    await client.abort()

    run(main())


def test_a_bad_key_or_key_file_is_refused_without_quoting_it(tmp_path):
    with pytest.raises(EngineKeyError, match="cannot read"):
        SGLangClient("http://127.0.0.1:1", config=ClientConfig(api_key_file=str(tmp_path / "missing")))
    for content in (b"", b"  \n", "kéy".encode(), b"two words", b"x" * 5000):
        path = tmp_path / "key"
        path.write_bytes(content)
        with pytest.raises(EngineKeyError) as info:
            read_api_key_file(path)
        if content.strip():
            assert content.decode("utf-8", "replace")[:20] not in str(info.value)
    with pytest.raises(EngineKeyError, match="without spaces") as info:
        SGLangClient("http://127.0.0.1:1", api_key="two words")
    assert "two words" not in str(info.value)
    # The layer's base, and the builtins existing except clauses catch.
    assert issubclass(EngineKeyError, EngineError) and issubclass(EngineKeyError, ValueError)
    assert issubclass(SGLangError, EngineError) and issubclass(SGLangError, RuntimeError)
    assert issubclass(EngineTimeout, TimeoutError)


# ---- against Gyre's embedded engine server (in this process, same event loop) --------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gyre.engines.model_format import init_model_dir

    return init_model_dir(tmp_path_factory.mktemp("model"), preset="tiny", seed=0)


class Embedded:
    """An embedded engine server without a transfer agent on a free port."""

    def __init__(self, model_dir) -> None:
        self.model_dir = model_dir

    async def __aenter__(self):
        from gyre.engines.async_engine import AsyncEngine
        from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig
        from gyre.engines.engine_server import build_engine_app

        config = EngineConfig(num_blocks=128, max_context_tokens=1024, num_threads=1)
        self.engine = AsyncEngine(EmbeddedEngine(self.model_dir, config))
        self.runner = web.AppRunner(build_engine_app(self.engine, None))
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()
        await self.engine.close()


PROMPT = list(range(10, 60))  # 50 ordinary ids of the tiny vocabulary


def test_embedded_generate_and_prefix_cache(model_dir):
    async def main():
        async with Embedded(model_dir) as s, SGLangClient(s.url) as client:
            params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
            first = await client.generate(PROMPT, params, rid="one")
            assert len(first["output_ids"]) == 6
            meta = first["meta_info"]
            assert meta["id"] == "one" and finish_reason_type(meta) == "length"
            assert [pair[1] for pair in meta["output_token_logprobs"]] == first["output_ids"]
            assert all(pair[0] <= 0.0 for pair in meta["output_token_logprobs"])
            assert meta["cached_tokens"] == 0
            again = await client.generate(PROMPT, params)
            assert again["output_ids"] == first["output_ids"]  # greedy
            assert again["meta_info"]["cached_tokens"] == 48  # the prompt's 3 full blocks of 16
            chunks = [c async for c in client.generate_stream(PROMPT, params)]
            assert chunks[-1]["output_ids"] == first["output_ids"]
            assert finish_reason_type(chunks[-1]["meta_info"]) == "length"

    run(main())


def test_embedded_errors_and_control(model_dir):
    async def main():
        async with Embedded(model_dir) as s, SGLangClient(s.url) as client:
            with pytest.raises(RequestRejected, match="unknown sampling_params") as info:
                await client.generate(PROMPT, {"bogus": 1})
            assert info.value.status == 400
            with pytest.raises(RequestRejected, match="token id"):
                await client.generate([10**9], {"max_new_tokens": 1})
            with pytest.raises(RequestRejected, match="unknown export handle"):
                await client.release_kv("export-nope")
            assert await client.flush_cache() is True
            await client.pause("in_place")
            await client.continue_generation()
            await client.abort("no-such-request")
            await client.abort()
            result = await client.update_weights_from_disk(str(model_dir), weight_version=7)
            assert result["success"] is True
            assert (await client.model_info())["weight_version"] == 7
            out = await client.generate(PROMPT, {"max_new_tokens": 2, "temperature": 0.0})
            assert out["meta_info"]["weight_version"] == 7
            await client.release_memory(["kv_cache"])
            await client.resume_memory(["kv_cache"])
            assert await client.health() is True

    run(main())


def test_embedded_server_without_transfer_agent_lacks_kv_import(model_dir):
    async def main():
        async with Embedded(model_dir) as s, SGLangClient(s.url) as client:
            await client.generate(PROMPT, {"max_new_tokens": 1, "temperature": 0.0})
            export = await client.export_kv(PROMPT)
            assert export["num_tokens"] == 48 and export["transfer_peer"] is None
            # The client knows from the export that no blocks can move ...
            with pytest.raises(CapabilityMissing, match="no transfer agent"):
                await client.import_kv(PROMPT, export)
            # ... and the server says so too when asked anyway.
            with pytest.raises(CapabilityMissing, match="kv-transfer"):
                await client.import_kv(PROMPT, dict(export, transfer_peer="127.0.0.1:1"))
            await client.release_kv(export["handle"])

    run(main())


def test_version_differences_of_sglang_are_named():
    """SGLang <= 0.5.5: /pause_generation takes no body (and only aborts); some versions serve /get_model_info
    instead of /model_info."""
    bodies: list[bytes] = []

    async def pause(request: web.Request) -> web.Response:
        bodies.append(await request.read())
        return web.json_response({"message": "paused"})

    async def get_model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "/old", "is_generation": True})

    async def main():
        app = web.Application()
        app.router.add_post("/pause_generation", pause)
        app.router.add_get("/get_model_info", get_model_info)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with SGLangClient(url, config=ClientConfig(pause_body=False)) as client:
                await client.pause("abort")
                assert bodies == [b""]  # no body at all, not even {}
                with pytest.raises(CapabilityMissing, match="aborting only"):
                    await client.pause("in_place")
                assert len(bodies) == 1  # refused before anything was sent
                assert (await client.model_info())["model_path"] == "/old"  # /model_info 404 -> /get_model_info
            async with SGLangClient(url) as client:
                await client.pause("retract")
                assert json.loads(bodies[-1]) == {"mode": "retract"}
                with pytest.raises(CapabilityMissing):
                    await client.live_sequences()  # a Gyre extension SGLang lacks
        finally:
            await runner.cleanup()

    run(main())
