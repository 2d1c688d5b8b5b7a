"""The serving wing: the proxy actor and its HTTP face.

Files: `proxy.py` (the actor: hosts the application on its event loop, feeds the router's view from the cells'
messages, publishes each ModelCallCompleted from its own inbox), `http_app.py` (HTTP), `openai_api.py` and
`anthropic_api.py` (the two APIs; `_api_common.py` holds the helpers they share), `sessions.py` (the neutral call
form, per-execution state and `CallRunner`, the call itself), `streaming.py` (deltas that never need taking back),
`routing.py` (`RoutedBackend`: the view of the cells, waits, resumes), `backends.py` (the backend protocol, its
errors, the engine backends and `engine_generate`), `cli.py` (`gyre serve`).

The path of a model call, file by file. Each file is entered once on the way in and left once on the way out; a file
calls only the files below it:
1. `http_app.py` (`ProxyService._model_call`): the API key (a lookup in `sessions.ProxySessions`, which returns at
   once), the X-Gyre-* labels, the bound on calls in flight, the body read within its size and time bounds and
   decoded within the JSON bounds (`json_bodies.BodyCache`: after what it repeats of the session's earlier bodies,
   else `_api_common.loads_bounded`; every bound is a ProxyHttpConfig field); then
   `api.answer(body, context, runner, limits)`.
2. `openai_api.py` or `anthropic_api.py` (`answer`): parse the body into a `ChatRequest`, `runner.complete(...)`,
   shape the `ChatOutcome` into the API's JSON (`completion_body`, `message_body`); a refusal (`ApiError`) or an
   unexpected error becomes an `Answer` in the API's error shape here.
3. `sessions.py` (`CallRunner.complete`): the model check, the prompt's characters against their bound, the
   prompt ids (`ExecutionSession.render`, reusing the ids of generated turns; on a worker thread for a large
   prompt, under the session's lock), the context check, the sampling parameters; `backend.generate(BackendRequest)`; the
   decoded text cut at a stop string and split into tool calls; the turn recorded for id reuse; the
   `ModelCallCompleted` handed to `on_call_completed` (in the actor, `Proxy._call_completed`, which sends it to the
   proxy's own inbox and returns); the `ChatOutcome`.
4. `routing.py` (`RoutedBackend.generate`): the session's cell from the routing policy (waiting, bounded, while no
   cell accepts it), then `backends.engine_generate` on that cell's client; an abort or a lost engine resubmits
   prompt + partial output from here (each attempt one more call down, and back).
5. `backends.py` (`engine_generate`): `SGLangClient.generate`, and the engine's answer as a `BackendResult`.
6. `engines/sglang_client.py`: the HTTP request to the engine server.
The answer climbs back the same way: `BackendResult` -> `BackendResult` -> `ChatOutcome` -> `Answer` -> the HTTP
response. Leaf helpers (they return without calling any of the above) are not stages: `_api_common.py`'s field
validators, the chat template, the tool-call parser, the routing policy. `gyre serve` and the tests put an
`EmbeddedBackend` or `SGLangBackend` (backends.py) where steps 4-6 are.

A streamed call (`stream: true`) goes down the same files once; what differs is how output comes up. In step 3,
`CallRunner.stream` starts the generation (steps 4-6) as its own task and yields a `StreamStart`, then the deltas of
each output chunk, then a `StreamEnd`; the API module's event generator turns them into server-sent-event bytes and
http_app writes them. Output ids come up through a bounded channel (`sessions._OutputChannel`): the generation's
`on_output` is the channel's `put`, the one piece of code above it the generation side runs (once per chunk): it
appends the chunk, waiting while the channel is full, or raises ClientGone once the reader has left, and calls
nothing. Everything else runs on the reader's side: per chunk, http_app resumes the API module's generator, which
resumes the session's, which takes the chunk and asks `streaming.TurnStreamer` (a leaf) for its deltas. Nothing
calls up into http_app or the API modules.
"""

from gyre.runtime.exports import lazy_exports

__all__ = ["Proxy", "ProxyConfig", "ProxyHttpConfig", "ProxySessionsConfig", "RoutingConfig"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "Proxy": "proxy",
    "ProxyConfig": "proxy",
    "ProxyHttpConfig": "http_app",
    "ProxySessionsConfig": "sessions",
    "RoutingConfig": "routing",
})
