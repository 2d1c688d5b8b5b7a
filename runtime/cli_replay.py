"""`gyre replay LOG --actor NAME`: re-run one actor on its recorded inbox and compare its outputs."""

from __future__ import annotations

import argparse

from gyre.runtime.logs import configure_logging
from gyre.runtime.replay import ReplayError, replay_actor


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("replay", help="replay one actor from an event log")
    parser.add_argument("log")
    parser.add_argument("--actor", required=True)
    parser.set_defaults(func=replay_command)


def replay_command(args: argparse.Namespace) -> int:
    configure_logging("warning")
    try:
        result = replay_actor(args.log, args.actor)
    except ReplayError as error:
        print(f"gyre replay: {error}")
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
