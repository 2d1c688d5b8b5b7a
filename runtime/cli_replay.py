"""`gyre replay LOG --actor NAME [--code PATH]...`: re-run one actor on its recorded inbox and compare its outputs.

Exit status: 0 identical, 1 different (the first difference is printed), 2 when the log cannot drive a replay (one
line on stderr: no such actor, an unreadable log, or code replay will not load without `--code`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gyre.runtime.logs import configure_logging
from gyre.runtime.replay import ReplayError, replay_actor


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("replay", help="replay one actor from an event log")
    add_arguments(parser)
    parser.set_defaults(func=replay_command)


def add_arguments(parser: argparse.ArgumentParser, actor_required: bool = True) -> None:
    """The one-actor replay's arguments (gyre.simulate.cli_replay adds --control-plane beside them)."""
    parser.add_argument("log")
    parser.add_argument("--actor", required=actor_required, help="the actor to re-run on its recorded inbox")
    parser.add_argument(
        "--code", action="append", default=[], metavar="PATH",
        help="a file (or folder of files) whose code you trust as it is now: replay may load the classes the log "
             "names from it even if it changed since the run or lies outside the current directory (repeatable)",
    )


def replay_command(args: argparse.Namespace) -> int:
    configure_logging("warning")
    missing = [path for path in args.code if not Path(path).exists()]
    if missing:  # a mistyped --code must not read as "the code is untrusted"
        print(f"gyre replay: --code {missing[0]}: no such file or folder", file=sys.stderr)
        return 2
    try:
        result = replay_actor(args.log, args.actor, code_paths=args.code)
    except ReplayError as error:
        print(f"gyre replay: {error}", file=sys.stderr)
        return 2
    if result.identical:
        note = f" ({result.unverified} later outputs were never delivered in the run)" if result.unverified else ""
        print(f"identical: {result.actor} re-handled {result.inbox_size} messages and sent the same "
              f"{result.compared} messages{note}")
        return 0
    print(f"DIFFERENT at output #{result.position} of {result.actor}:")
    print(f"  expected (log):  {_describe(result.expected)}")
    print(f"  got (replay):    {_describe(result.got)}")
    return 1


def _describe(output) -> str:
    if output is None:
        return "nothing"
    return f"{output.kind} to {output.to}: {output.summary}"
