"""Gyre's engines: the model format and the code that runs a model, for inference and for training.

An engine is plain Python with no actor in it: the cells, the proxy and the weight broker in `gyre.actors` host
these objects and drive them by calls. The layer imports `gyre.runtime` (validators, errors, run secrets, logs) and
`gyre.messages` never; nothing in `gyre.runtime` or `gyre.policies` imports it.

- The model directory: `model_format` (a Qwen3 model in Hugging Face format, built from a seed; `ModelSpec`),
  `tokenizer` (its byte-level BPE), `chat_template` and `tool_calls` (how conversations and tool calls become
  text), `weight_convert` (Hugging Face <-> megatron-core state dicts).
- Inference: `embedded_engine` (continuous batching over `kv_pool` and a `radix_cache` prefix cache, running
  `qwen3_paged`; tokens chosen by `sampling` at the `temperature` rule), `async_engine` (its asyncio face),
  `engine_server` (its HTTP face, the SGLang API subset) and `sglang_client` (the client for either server).
- Training: `trainer` (megatron-core, on the CPU through `megatron_cpu`), `sft` and `pretrain` (warm starts).
- Bulk bytes between processes: `transfer` (Mooncake).
- Command lines: `model_cli` (`gyre model`) and `sft_cli` (`gyre sft`).

The modules are imported as `gyre.engines.<module>`; this package re-exports nothing from them, since most pull in
torch, megatron-core or aiohttp, seconds of start-up that a caller needing one piece should not pay. Its one public
name is the layer's error base, `EngineError`; every engine error, each also the builtin it always was, lives in
`gyre.engines.errors`.
"""

from gyre.engines.errors import EngineError

__all__ = ["EngineError"]
