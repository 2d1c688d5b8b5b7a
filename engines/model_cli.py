"""`gyre model ...`: create a model directory, inspect it, and score token ids with any of the three engines.

    gyre model init DIR --preset tiny|small|tiny-tied|tiny-moe [--seed N]
    gyre model info DIR
    gyre model logprobs DIR --backend embedded|megatron|transformers --tokens FILE   (FILE: JSON list of ids, or -)

`logprobs` prints a JSON list of n-1 floats, log p(t_i | t_<i) for i = 1..n-1: the three backends must agree (the
parity test checks it to 1e-4), so this is also a quick way to compare them on a given model by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

__all__ = ["register"]

BACKENDS = ("embedded", "megatron", "transformers")


def _read_tokens(source: str) -> list[int]:
    text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    ids = json.loads(text)
    integers = isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    if not integers or len(ids) < 2:
        raise ValueError("the tokens file must hold a JSON list of at least two integer token ids")
    return ids


def transformers_logprobs(model_dir: str | Path, ids: list[int]) -> list[float]:
    """Reference log-probs from transformers' Qwen3ForCausalLM in fp32."""
    import torch
    from transformers import Qwen3ForCausalLM

    from gyre.engines.trainer import token_logprobs

    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        logits = model(batch).logits
    return token_logprobs(logits, batch, torch.tensor([len(ids)]))[0, 1:].tolist()


def megatron_logprobs(model_dir: str | Path, ids: list[int]) -> list[float]:
    import torch

    from gyre.engines.trainer import MegatronTrainer

    trainer = MegatronTrainer(model_dir)
    batch = torch.tensor([ids], dtype=torch.long)
    return trainer.logprobs(batch, torch.tensor([len(ids)]))[0, 1:].tolist()


def embedded_logprobs(model_dir: str | Path, ids: list[int]) -> list[float]:
    # Imported here: the embedded engine is a sibling module that this command must not need for the others.
    from gyre.engines.embedded_engine import EmbeddedEngine

    return list(EmbeddedEngine(model_dir).prompt_logprobs(ids))


def _init(args: argparse.Namespace) -> int:
    from gyre.engines.errors import ModelFormatError
    from gyre.engines.model_format import ModelSpec, init_model_dir

    try:
        path = init_model_dir(args.dir, preset=args.preset, seed=args.seed)
    except ModelFormatError as error:
        print(f"gyre model init: {error}", file=sys.stderr)
        return 2
    spec = ModelSpec.from_model_dir(path)
    print(json.dumps({"model_dir": str(path), "preset": args.preset, "seed": args.seed, "params": spec.num_params}))
    return 0


def _info(args: argparse.Namespace) -> int:
    import attrs

    from gyre.engines.errors import ModelFormatError
    from gyre.engines.model_format import ModelSpec

    try:
        spec = ModelSpec.from_model_dir(args.dir)
    except ModelFormatError as error:
        print(f"gyre model info: {error}", file=sys.stderr)
        return 2
    print(json.dumps({**attrs.asdict(spec), "params": spec.num_params}))
    return 0


def _logprobs(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError

    try:
        ids = _read_tokens(args.tokens)
    except (OSError, ValueError) as error:
        print(f"gyre model logprobs: {error}", file=sys.stderr)
        return 2
    score = {"embedded": embedded_logprobs, "megatron": megatron_logprobs,
             "transformers": transformers_logprobs}[args.backend]
    try:
        # stdout carries only the JSON answer: whatever the engines print or log meanwhile goes to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            values = score(args.dir, ids)
    # Every engine's bad-input error is a ValueError (a bad model directory: ModelFormatError, wrapped by the
    # embedded engine in its RequestError); transformers, the reference, reports a missing file as OSError and a
    # corrupt weights file as safetensors' own error.
    except (OSError, ValueError, SafetensorError) as error:
        print(f"gyre model logprobs: {error}", file=sys.stderr)
        return 2
    print(json.dumps(values))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="create, inspect and score Gyre model directories")
    commands = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)

    init = commands.add_parser("init", help="write a freshly initialised model directory")
    init.add_argument("dir", help="directory to create (existing files of the model format are overwritten)")
    init.add_argument("--preset", default="tiny",
                      help="model preset: tiny, small, tiny-tied (tied embeddings, as Qwen3-0.6B) or tiny-moe "
                           "(qwen3_moe, 8 experts top 2) (default tiny)")
    init.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    init.set_defaults(func=_init)

    info = commands.add_parser("info", help="print a model directory's shape and parameter count as JSON")
    info.add_argument("dir")
    info.set_defaults(func=_info)

    logprobs = commands.add_parser("logprobs", help="print log p(t_i | t_<i) for i=1..n-1 as a JSON list")
    logprobs.add_argument("dir")
    logprobs.add_argument("--backend", choices=BACKENDS, default="transformers")
    logprobs.add_argument("--tokens", required=True, help="file with a JSON list of token ids, or - for stdin")
    logprobs.set_defaults(func=_logprobs)
