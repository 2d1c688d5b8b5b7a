"""`gyre sft`: fine-tune a model directory on demonstrations (JSONL of {"messages": [...], "tools": [...]})."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gyre.engines.sft import SFTConfig, demonstrations_digest, run_sft
from gyre.runtime.logs import configure_logging


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("sft", help="supervised warm start on demonstrations")
    parser.add_argument("base", help="model directory to start from")
    parser.add_argument("--demos", required=True, help="JSONL file, one conversation per line")
    parser.add_argument("--out", required=True, help="directory for the fine-tuned model")
    parser.add_argument("--epochs", type=int, default=SFTConfig().epochs)
    parser.add_argument("--lr", type=float, default=SFTConfig().lr)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--force", action="store_true", help="train even if --out holds a result for these inputs")
    parser.set_defaults(func=sft_command)


def sft_command(args: argparse.Namespace) -> int:
    configure_logging()
    lines = [line for line in Path(args.demos).read_text(encoding="utf-8").splitlines() if line.strip()]
    config = SFTConfig(epochs=args.epochs, lr=args.lr, num_threads=args.threads)
    key = demonstrations_digest(lines, args.base, config)
    marker = Path(args.out) / "sft_key.txt"
    if not args.force and marker.is_file() and marker.read_text().strip() == key:
        print(f"gyre sft: {args.out} already holds this fine-tune (key {key}); use --force to redo it")
        return 0
    pairs = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            pairs.append((record["messages"], record.get("tools")))
        except (ValueError, KeyError, TypeError) as error:
            print(f"gyre sft: line {number} of {args.demos} is not a demonstration: {error}", file=sys.stderr)
            return 2

    def progress(step: int, total: int, loss: float) -> None:
        if step % 10 == 0 or step == total:
            print(f"step {step}/{total} loss {loss:.4f}", file=sys.stderr)

    result = run_sft(args.base, pairs, args.out, config, progress)
    marker.write_text(key + "\n")
    print(json.dumps({"out": result.out_dir, "steps": result.steps, "first_loss": result.first_loss,
                      "last_loss": result.last_loss, "seconds": round(result.seconds, 1)}))
    return 0
