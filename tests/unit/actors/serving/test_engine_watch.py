"""`gyre serve --engine-url`'s health watch: a server that stops answering, or that accepts connections and hangs,
is marked failed in the router's view within one round; one that answers again is used again."""

from __future__ import annotations

import asyncio

from aiohttp import web

from gyre.actors.serving.engine_watch import EngineWatch, EngineWatchConfig
from gyre.actors.serving.routing import RoutedBackend, RoutingConfig
from gyre.engines.model_format import PRESETS, SERVED_LAYOUT_FIELDS
from gyre.engines.sglang_client import SGLangClient


async def health_server(state: dict) -> tuple[web.AppRunner, str]:
    """The outer edge: an engine server's /health, which answers, fails or hangs as `state["mode"]` says."""
    async def health(request: web.Request) -> web.Response:
        if state["mode"] == "hang":
            await asyncio.sleep(3600)
        return web.json_response({}, status=200 if state["mode"] == "ok" else 503)

    async def model_info(request: web.Request) -> web.Response:  # Gyre's server reports its layout
        spec = PRESETS["tiny"]
        return web.json_response({name: getattr(spec, name) for name in SERVED_LAYOUT_FIELDS})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/model_info", model_info)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def scenario() -> list:
    state = {"mode": "ok"}
    runner, url = await health_server(state)
    backend = RoutedBackend(RoutingConfig(), lambda u: SGLangClient(u))
    watch = EngineWatch(backend, [url], PRESETS["tiny"], "tiny", lambda u: SGLangClient(u),
                        EngineWatchConfig(health_timeout_s=0.3))
    await watch.check_all()
    seen = [("start", backend.statistics().failed_cells, watch.healthy, watch.model_checks)]
    for mode in ("ok", "hang", "ok", "fail"):
        state["mode"] = mode
        await watch.check_once()
        seen.append((mode, backend.statistics().failed_cells, watch.healthy, watch.model_checks))
    await watch.close()
    await backend.close()
    await runner.cleanup()
    return seen


def test_a_hanging_or_failing_server_is_marked_failed_and_one_that_answers_again_is_used() -> None:
    assert asyncio.run(scenario()) == [
        ("start", (), (True,), ("layout",)),
        ("ok", (), (True,), ("layout",)),
        ("hang", ("engine-0",), (False,), ("layout",)),  # accepted, never answered: failed within health_timeout_s
        ("ok", (), (True,), ("layout",)),
        ("fail", ("engine-0",), (False,), ("layout",)),
    ]
