"""`gyre run FILE [--virtual --seed N | --ray ADDRESS | --bus ipc|tcp] [--log PATH] [ARGS]`: start a topology file;
options gyre run does not know, and anything after `--`, go to the file's topology(argv)."""

from __future__ import annotations

import argparse
import sys

from gyre.runtime.launch import LocalProcessLauncher, RunOptions, VirtualLauncher
from gyre.runtime.logs import configure_logging
from gyre.runtime.topology import build_topology, load_topology_module


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="run a topology file")
    parser.add_argument("file", help="a Python file defining topology(argv) -> Topology")
    parser.add_argument("--virtual", action="store_true", help="deterministic runner: one process, virtual time")
    parser.add_argument("--ray", dest="ray_address", default=None, metavar="ADDRESS",
                        help="run each process group as a Ray actor on the cluster at ADDRESS ('auto' finds a running "
                             "one; 'local' starts one on this machine on 127.0.0.1)")
    parser.add_argument("--bus", choices=("ipc", "tcp"), default="ipc",
                        help="local processes: ipc sockets in a private folder (default) or loopback tcp; both CURVE")
    parser.add_argument("--seed", type=int, default=None, help="override the topology's seed")
    parser.add_argument("--log", dest="log_path", default=None,
                        help="write the event log here (default: the topology's log_path, if it sets one)")
    parser.add_argument("--until-s", type=float, default=None, help="stop after this many (virtual) seconds")
    parser.add_argument("--log-level", default=None, help="debug shows one line per handled message")
    # Unknown options (e.g. `--report DIR`) and anything after `--` go to the file's topology(argv).
    parser.set_defaults(func=run_command, accepts_extra_args=True)


def run_command(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    argv = list(args.passthrough)  # gyre run FILE [options] -- ARGS: ARGS go to topology(argv)
    module = load_topology_module(args.file)
    prepare = getattr(module, "prepare", None)
    if callable(prepare):
        prepare(argv)
    topology = build_topology(module, argv)
    if args.seed is not None:
        topology.seed = args.seed
    # --log wins; otherwise the topology's own choice (e.g. the main job records into its report folder).
    options = RunOptions(log_path=args.log_path or topology.log_path or None, until_s=args.until_s)
    if args.virtual and args.ray_address:
        print("gyre run: --virtual and --ray exclude each other", file=sys.stderr)
        return 2
    if args.virtual:
        result = VirtualLauncher().run(topology, options)
    elif args.ray_address:
        from gyre.runtime.ray_launcher import RayLauncher  # importing ray costs seconds: only when asked

        result = RayLauncher(args.file, tuple(argv), args.seed, args.ray_address).run(topology, options)
    else:
        result = LocalProcessLauncher(args.file, tuple(argv), args.seed, bus=args.bus).run(topology, options)
    print(f"gyre run: {result.reason} (exit {result.exit_code})", file=sys.stderr)
    finish = getattr(module, "finish", None)
    if callable(finish):
        finished = finish(argv, result)
        return int(finished) if finished is not None else result.exit_code
    return result.exit_code
