"""`gyre run FILE [--virtual --seed N [--faults PLAN] | --ray ADDRESS | --bus ipc|tcp] [--log PATH] [--resume] [ARGS]`:
start a topology file; options gyre run does not know, and anything after `--`, go to the file's topology(argv).
`--faults PLAN` runs it on the deterministic runner under a seeded fault plan (gyre.runtime.faults) and prints the
faults that fired.

`--resume` continues the run whose checkpoints the topology keeps (`Topology.checkpoint_dir`; for the main job
REPORT/run_checkpoints): the newest whole checkpoint (gyre.runtime.checkpoint.load_latest: a torn newer one is
passed over, and said so), the topology arguments and seed the run started with (recorded at its start in
`run_args.json` and in every manifest), and `--resume-from CHECKPOINT` added for the topology file to hand to its
actors. Arguments given with --resume must agree with the run's (the ones that locate the run, like `--report DIR`,
do); one that differs is refused with both values. The event log gets a new segment: LOG becomes a folder of
segments (LOG/0000.glog the first run's, LOG/0001.glog the first resume's, ...; segments a killed run left unmerged
are merged first) that `gyre log` and `read_log` read as one log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from gyre.runtime.checkpoint import encode_json, load_latest, write_file_atomic
from gyre.runtime.errors import GyreError
from gyre.runtime.event_log import merge_segments
from gyre.runtime.faults import FaultPlanError, parse_plan
from gyre.runtime.launch import LocalProcessLauncher, RunOptions, VirtualLauncher
from gyre.runtime.logs import configure_logging
from gyre.runtime.topology import build_topology, load_topology_module

RUN_ARGS = "run_args.json"
"""The run's arguments in its checkpoint root (the checkpointer copies them into each manifest)."""
FAULT_RUN_LIMIT_S = 86_400.0
"""Virtual seconds a run under --faults may take without --until-s: a fault may stall it, and it must end."""
RESUME_FLAG = "--resume-from"
"""What `--resume` adds to the topology's arguments: the checkpoint folder its actors restore from."""


class ResumeError(GyreError):
    """A run cannot be resumed: no checkpoint, or arguments that conflict with the run's."""


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
    parser.add_argument("--faults", default=None, metavar="PLAN",
                        help="with --virtual: run under a seeded fault plan (gyre.runtime.faults), e.g. "
                             "\"kill claimer at 3 StepApplied; delay executor>claimer SamplesLanded 0.5\"; the faults "
                             "that fired are printed")
    parser.add_argument("--restart-processes", default="", metavar="GROUPS",
                        help="local processes: comma-separated process groups started again when they die, if "
                             "their actors' restart policies allow it (e.g. the satellites: sat1,sat2); any other "
                             "process that exits ends the run")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run the topology's checkpoints record (the main job: --report DIR) from "
                             "its newest whole checkpoint, with the run's own arguments; a conflicting one is refused")
    # Unknown options (e.g. `--report DIR`) and anything after `--` go to the file's topology(argv).
    parser.set_defaults(func=run_command, accepts_extra_args=True)


# ---- resuming ------------------------------------------------------------------------------------------------------
def _flags(argv: list[str]) -> dict[str, list[str]]:
    """`--name value`, `--name=value` and bare `--name` (value "") of an argument list, each name's values in order
    (a repeatable flag keeps them all); words that follow no flag are kept under ""."""
    flags: dict[str, list[str]] = {}
    index = 0
    while index < len(argv):
        word = argv[index]
        if word.startswith("--") and len(word) > 2:
            name, equals, value = word.partition("=")
            if not equals:
                following = argv[index + 1] if index + 1 < len(argv) else None
                value = following if following is not None and not following.startswith("--") else ""
                index += 1 if value else 0
            flags.setdefault(name, []).append(value)
        else:
            flags.setdefault("", []).append(word)
        index += 1
    return flags


def conflicts(run_argv: list[str], given: list[str]) -> list[str]:
    """The arguments in `given` that the run, started with `run_argv`, did not have: "--flag: given X, the run's Y"."""
    run, asked = _flags(run_argv), _flags(given)
    problems = []
    for name, values in asked.items():
        theirs = run.get(name)
        if theirs == values:
            continue
        label, shown = name or "arguments", " ".join(values)
        if theirs is None:
            problems.append(f"{label}: given {shown!r}, the run had none")
        else:
            problems.append(f"{label}: given {shown!r}, the run's {' '.join(theirs)!r}")
    return problems


def resume_arguments(module: Any, file: str, given: list[str], seed: int | None) -> tuple[list[str], int | None, Path]:
    """The arguments, seed and checkpoint folder a resumed run starts from. Raises ResumeError."""
    if RESUME_FLAG in _flags(given):
        raise ResumeError(f"{RESUME_FLAG} is what --resume adds; give --resume alone")
    try:
        located = build_topology(module, given)
    except SystemExit as error:
        raise ResumeError(f"cannot build the topology to find its checkpoints: {error}") from None
    root = located.checkpoint_dir
    if not root:
        raise ResumeError(f"{file}'s topology keeps no checkpoints (Topology.checkpoint_dir is empty)")
    checkpoint, skipped = load_latest(root)
    for passed in skipped:
        print(f"gyre run --resume: passed over {passed.path}: {passed.reason}", file=sys.stderr)
    if checkpoint is None:
        raise ResumeError(f"no whole checkpoint under {root} to resume from"
                          + (f" ({len(skipped)} torn or corrupt)" if skipped else
                             " (did the run checkpoint? the main job needs --checkpoint-every N)"))
    record = checkpoint.manifest.get("run")
    if record is None and (Path(root) / RUN_ARGS).is_file():
        record = json.loads((Path(root) / RUN_ARGS).read_text(encoding="utf-8"))
    if record is None:
        raise ResumeError(f"{checkpoint.path} does not record the run's arguments ({RUN_ARGS} is missing)")
    run_argv = list(record["argv"])
    problems = conflicts(run_argv, given)
    if seed is not None and record.get("seed") is not None and seed != record["seed"]:
        problems.append(f"--seed: given {seed}, the run's {record['seed']}")
    elif seed is not None and record.get("seed") is None:
        problems.append(f"--seed: given {seed}, the run had none")
    if Path(record.get("file", file)).resolve() != Path(file).resolve():
        problems.append(f"file: given {file}, the run's {record['file']}")
    if problems:
        raise ResumeError("a resumed run keeps the arguments it started with; these differ: " + "; ".join(problems)
                          + f" (the run's: {' '.join(run_argv) or '(none)'}; resume with those, or drop the flag)")
    print(f"gyre run --resume: from {checkpoint.path} (step {checkpoint.step_id}, weight version "
          f"{checkpoint.manifest.get('weight_version')}, {len(checkpoint.manifest.get('reroll_groups', []))} groups "
          f"to re-roll)", file=sys.stderr)
    return [*run_argv, RESUME_FLAG, str(checkpoint.path)], record.get("seed"), checkpoint.path


def next_log_segment(log_path: str) -> str:
    """Turn LOG into a folder of segments (module docstring) and return the path of the next one to write."""
    log = Path(log_path)
    if log.is_file():
        moved = log.with_name(log.name + ".first")
        os.replace(log, moved)
        log.mkdir()
        os.replace(moved, log / "0000.glog")
    log.mkdir(parents=True, exist_ok=True)
    # Segments a killed run never merged: LOG.parts (a first run's) and LOG/NNNN.glog.parts (a resumed run's).
    leftovers = [(log.with_name(log.name + ".parts"), log / "0000.glog")]
    leftovers += [(parts, parts.with_suffix("")) for parts in sorted(log.glob("*.glog.parts"))]
    for parts, into in leftovers:
        if parts.is_dir():
            if into.exists():
                into = log / f"{_next_number(log):04d}.glog"
            report = merge_segments(sorted(parts.glob("*.glog")), into)
            print(f"gyre run --resume: merged the killed run's log segments {parts} into {into}"
                  + (f" (a torn tail of {report.torn_tail_bytes} bytes skipped)" if report.torn_tail_bytes else ""),
                  file=sys.stderr)
            shutil.rmtree(parts, ignore_errors=True)
    return str(log / f"{_next_number(log):04d}.glog")


def _next_number(folder: Path) -> int:
    numbers = [int(p.stem) for p in folder.glob("*.glog") if p.stem.isdigit()]
    return max(numbers, default=-1) + 1


def _record_run_args(root: str, file: str, argv: list[str], seed: int | None) -> None:
    """At a fresh start: what a resume must keep (module docstring)."""
    Path(root).mkdir(parents=True, exist_ok=True)
    write_file_atomic(Path(root) / RUN_ARGS,
                      encode_json({"file": str(Path(file).resolve()), "argv": argv, "seed": seed}))


# ---- the command ---------------------------------------------------------------------------------------------------
def run_command(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    argv = list(args.passthrough)  # gyre run FILE [options] -- ARGS: ARGS go to topology(argv)
    module = load_topology_module(args.file)
    if args.virtual and args.ray_address:
        print("gyre run: --virtual and --ray exclude each other", file=sys.stderr)
        return 2
    if args.faults is not None and not args.virtual:
        print("gyre run: --faults needs --virtual (faults are injected on the deterministic runner's one node)",
              file=sys.stderr)
        return 2
    if args.faults is not None:
        try:
            parse_plan(args.faults)
        except FaultPlanError as error:
            print(f"gyre run --faults: {error}", file=sys.stderr)
            return 2
    resumed = None
    if args.resume:
        try:
            argv, args.seed, resumed = resume_arguments(module, args.file, argv, args.seed)
        except ResumeError as error:
            print(f"gyre run --resume: {error}", file=sys.stderr)
            return 2
    prepare = getattr(module, "prepare", None)
    if callable(prepare):
        prepare(argv)
    topology = build_topology(module, argv)
    if args.seed is not None:
        topology.seed = args.seed
    if resumed is None and topology.checkpoint_dir:
        _record_run_args(topology.checkpoint_dir, args.file, argv, args.seed)
    # --log wins; otherwise the topology's own choice (e.g. the main job records into its report folder).
    log_path = args.log_path or topology.log_path or None
    if resumed is not None and log_path:
        log_path = next_log_segment(log_path)
    options = RunOptions(log_path=log_path, until_s=args.until_s)
    if args.faults is not None:
        from gyre.runtime.launch import RunResult
        from gyre.runtime.fault_run import run_with_faults

        faulted = run_with_faults(topology, args.faults, until_s=args.until_s or FAULT_RUN_LIMIT_S, log_path=log_path)
        for when, fault, hit in faulted.applied:
            print(f"gyre run --faults: {when:.3f}s {fault}: {hit}", file=sys.stderr)
        result = RunResult(faulted.exit_code, faulted.reason)
    elif args.virtual:
        result = VirtualLauncher().run(topology, options)
    elif args.ray_address:
        from gyre.runtime.ray_launcher import RayLauncher  # importing ray costs seconds: only when asked

        result = RayLauncher(args.file, tuple(argv), args.seed, args.ray_address).run(topology, options)
    else:
        restart = tuple(name for name in args.restart_processes.split(",") if name)
        unknown = sorted(set(restart) - set(topology.processes()))
        if unknown:
            print(f"gyre run: --restart-processes names no process group of the topology: {unknown}; its groups: "
                  f"{sorted(topology.processes())}", file=sys.stderr)
            return 2
        result = LocalProcessLauncher(args.file, tuple(argv), args.seed, bus=args.bus,
                                      restart_processes=restart).run(topology, options)
    print(f"gyre run: {result.reason} (exit {result.exit_code})", file=sys.stderr)
    if result.exit_code != 0 and topology.checkpoint_dir:
        newest, _ = load_latest(topology.checkpoint_dir)
        if newest is not None:
            print(f"gyre run: the run can go on from its checkpoint of step {newest.step_id} ({newest.path}): "
                  f"gyre run {args.file} {' '.join(_located(argv))} --resume", file=sys.stderr)
    finish = getattr(module, "finish", None)
    if callable(finish):
        finished = finish(argv, result)
        return int(finished) if finished is not None else result.exit_code
    return result.exit_code


def _located(argv: list[str]) -> list[str]:
    """The run's arguments without what --resume adds (for the hint printed after a failed run)."""
    if RESUME_FLAG in argv:
        cut = argv.index(RESUME_FLAG)
        return argv[:cut] + argv[cut + 2:]
    return argv
