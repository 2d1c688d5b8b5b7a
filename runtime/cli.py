"""The `gyre` command line.

Subcommands live beside the code they drive and are found through the `gyre.cli` entry-point group declared in
pyproject.toml, so that `gyre.runtime` never imports the layers above it. A subcommand whose module cannot be
imported is reported when it is asked for, not when another one runs. Only the chosen subcommand's module is
imported (the others pull in torch and megatron-core, seconds of start-up); `gyre --help` imports them all.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from gyre.runtime.errors import GyreError


def chosen_command(argv: list[str]) -> str | None:
    """The entry-point name the words of `argv` ask for ("run", "bench.engine"), or None if they name none yet."""
    words = [word for word in argv if not word.startswith("-")]
    if not words:
        return None
    if words[0] == "bench":
        return f"bench.{words[1]}" if len(words) > 1 else None
    return words[0]


def build_parser(wanted: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """The parser with every subcommand; only `wanted`'s module is imported when it names a known subcommand."""
    parser = argparse.ArgumentParser(prog="gyre", description="Train long-horizon LLM agents with RL.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench = commands.add_parser("bench", help="reproducible benchmarks").add_subparsers(
        dest="bench", metavar="BENCH", required=True
    )
    broken: dict[str, str] = {}
    points = sorted(entry_points(group="gyre.cli"), key=lambda p: p.name)
    if wanted not in {point.name for point in points}:
        wanted = None  # unknown or no command: load everything so that argparse can list the choices
    for point in points:
        target = bench if point.name.startswith("bench.") else commands
        if wanted is not None and point.name != wanted:
            target.add_parser(point.name.removeprefix("bench."))
            continue
        try:
            register = point.load()
        except Exception as error:  # a broken plug-in must not take the other commands down
            name = point.name.removeprefix("bench.")
            broken[point.name] = f"{type(error).__name__}: {error}"
            target.add_parser(name, help=f"(unavailable: {error})")
            continue
        register(target)
    return parser, broken


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after a bare "--" belongs to the command's target (e.g. a topology file's own flags).
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser, broken = build_parser(chosen_command(argv))
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # A command that accepts extra arguments (gyre run) hands them on: its target defines their meaning.
    args.passthrough = extra + passthrough
    chosen = args.command if args.command != "bench" else f"bench.{args.bench}"
    if chosen in broken:
        print(f"gyre: the command {chosen!r} could not be loaded: {broken[chosen]}", file=sys.stderr)
        return 2
    try:
        result = args.func(args)
    except (FileNotFoundError, GyreError) as error:
        print(f"gyre: {error}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
