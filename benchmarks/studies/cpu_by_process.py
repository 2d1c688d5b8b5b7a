"""CPU seconds of a command's whole process tree, summed by kind of process: where a run's CPU goes.

    python benchmarks/studies/cpu_by_process.py --out cpu.json -- \
        gyre run examples/agent_rl.py --report /tmp/ms --steps 4 --skip-eval

Kinds: `cell` (a launcher child named gyre:core, gyre:satN: the trainer and the cell's actors; trainer_group
workers too), `engine server` (gyre.engines.engine_server), `control` (gyre:control: claimer, scheduler, builder,
task source, monitor, broker, migrator), `proxy` (gyre:proxy), `runs` (gyre:runs: executor and evaluator),
`warm launcher` (the fork servers themselves), `agent` and `scorer` (their forked children: the server's
--preload says which), `sandbox` (bwrap and what runs in it), `launcher` (the command itself: prepare, the
supervisor, finish), `other`. The launcher's children are told apart by the name runtime/launch.py gives them
(/proc/PID/comm), so this needs a Gyre that names them.

Polls /proc every `--interval-s` for every descendant of the command. A process's CPU is its own (utime + stime,
all threads) at the last poll that saw it. Agents and scorers mostly start and end between two polls: what a
parent reaped (cutime + cstime) beyond the last-seen CPU of the children that vanished in the same interval goes to
the kind of child that parent makes (a warm launcher's: agent or scorer; anyone else's: `other`). So the kinds add
up to the tree's CPU, within the few ticks a child spends between its last poll and its exit. Linux only (/proc).

Prints one line per kind (CPU-s, share, the system CPU of the processes seen, processes seen) and the wall time
with the load average before and after; `--out` gets the kinds and every process seen. With `--report DIR` (the
run's report folder) it also counts, from DIR/events.glog and DIR/run.json, what the run did per optimizer step:
model calls, tokens generated, prompt tokens prefilled (not served from the prefix cache) and cached, and tokens
trained; then CPU per step and per model call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gyre.benchmarks.studies.process_cpu import _sample, _tree  # the /proc reading both studies share

CELL_PREFIXES = ("core", "sat")
LAUNCHER_GROUPS = {"control": "control", "proxy": "proxy", "runs": "runs"}
"""gyre:NAME -> kind, for the launcher's children that are not cells."""


def kind_of(sample: dict, parent: dict | None, root: bool) -> str:
    """The kind of one process (module docstring), from its name, command line and parent."""
    comm, cmdline = sample["comm"], sample["cmdline"]
    if root:
        return "launcher"
    if comm.startswith("gyre:"):
        group = comm[len("gyre:"):]
        if group.startswith(CELL_PREFIXES):
            return "cell"
        return LAUNCHER_GROUPS.get(group, "other")
    if "gyre.engines.engine_server" in cmdline:
        return "engine server"
    if "gyre.engines.trainer_group" in cmdline:
        return "cell"
    if comm == "bwrap" or (parent is not None and parent.get("kind") == "sandbox"):
        return "sandbox"
    if "warm_launcher_server" in cmdline:
        if parent is not None and "warm_launcher_server" in parent["cmdline"]:
            return child_kind_of(parent)
        return "warm launcher"
    return "other"


def child_kind_of(sample: dict) -> str:
    """The kind of the children a process makes: a warm launcher forks agents or scorers (its --preload says
    which: the agents' preloads openai), a sandbox runs sandboxed commands, anything else `other`."""
    if "warm_launcher_server" in sample["cmdline"]:
        return "agent" if "openai" in sample["cmdline"] else "scorer"
    if sample.get("kind") in ("sandbox", "agent", "scorer"):
        return sample["kind"]
    return "other"


def measure(command: list[str], interval_s: float) -> dict:
    """Run `command`, poll its tree until it exits, and return the kinds' CPU and every process seen."""
    load_before = os.getloadavg()
    started = time.perf_counter()
    child = subprocess.Popen(command)
    seen: dict[int, dict] = {}
    unseen_by_kind: dict[str, float] = {}
    while True:
        alive = child.poll() is None
        current: dict[int, dict] = {}
        for pid in _tree(child.pid):
            sample = _sample(pid)
            if sample is None:
                continue
            # Named at every poll: a process forked by a cell becomes an engine server when it execs, a launcher
            # child names itself once it runs; its CPU goes to the kind it had last.
            previous = seen.get(pid)
            if previous is not None and not sample["cmdline"]:  # a zombie has no command line: keep its kind
                sample["kind"] = previous["kind"]
            else:
                sample["kind"] = kind_of(sample, current.get(sample["ppid"]) or seen.get(sample["ppid"]),
                                         pid == child.pid)
            current[pid] = sample
        # What each parent reaped since the last poll, beyond the last-seen CPU of its children that vanished.
        vanished: dict[int, float] = {}
        for pid, old in seen.items():
            if old.get("gone") or pid in current:
                continue
            old["gone"] = True
            vanished[old["ppid"]] = vanished.get(old["ppid"], 0.0) + old["self_cpu_s"] + old["reaped_children_cpu_s"]
        for pid, sample in current.items():
            old = seen.get(pid)
            reaped_delta = sample["reaped_children_cpu_s"] - (old["reaped_children_cpu_s"] if old is not None else 0.0)
            unexplained = reaped_delta - vanished.get(pid, 0.0)
            if unexplained > 0:
                kind = child_kind_of(sample)
                unseen_by_kind[kind] = unseen_by_kind.get(kind, 0.0) + unexplained
        seen.update(current)
        if not alive:
            break
        time.sleep(interval_s)
    wall_s = time.perf_counter() - started
    by_kind: dict[str, dict] = {}
    for sample in seen.values():
        row = by_kind.setdefault(sample["kind"], {"cpu_s": 0.0, "system_cpu_s": 0.0, "processes": 0,
                                                  "unseen_cpu_s": 0.0})
        row["cpu_s"] += sample["self_cpu_s"]
        row["system_cpu_s"] += sample["system_cpu_s"]
        row["processes"] += 1
    for kind, cpu_s in unseen_by_kind.items():
        row = by_kind.setdefault(kind, {"cpu_s": 0.0, "system_cpu_s": 0.0, "processes": 0, "unseen_cpu_s": 0.0})
        row["cpu_s"] += cpu_s
        row["unseen_cpu_s"] += cpu_s
    return {"command": command, "wall_s": wall_s, "exit_code": child.returncode, "load_before": load_before,
            "load_after": os.getloadavg(), "cpu_s": sum(row["cpu_s"] for row in by_kind.values()),
            "by_kind": dict(sorted(by_kind.items(), key=lambda item: -item[1]["cpu_s"])),
            "processes": {str(pid): sample for pid, sample in seen.items()}}


def run_counts(report: Path) -> dict:
    """What a run did, from its report folder: steps applied, model calls and their tokens (each call once, though
    several actors record it), tokens trained (run.json's steps)."""
    from gyre.messages.model_calls import ModelCallCompleted
    from gyre.runtime.codec import Codec
    from gyre.runtime.event_log import read_log

    codec = Codec()
    calls: dict[tuple[str, int], tuple[int, int, int]] = {}
    for record in read_log(report / "events.glog", codec):
        if record.type_name != "gyre.model_calls.ModelCallCompleted":
            continue
        call = record.decode(codec)
        assert isinstance(call, ModelCallCompleted)
        calls[(call.execution_id, call.call_index)] = (call.prompt_tokens, call.cached_tokens, len(call.output_ids))
    steps = json.loads((report / "run.json").read_text())["steps"]
    return {"steps": len(steps), "model_calls": len(calls),
            "generated_tokens": sum(output for _, _, output in calls.values()),
            "prefilled_tokens": sum(max(0, prompt - cached) for prompt, cached, _ in calls.values()),
            "cached_prompt_tokens": sum(min(prompt, cached) for prompt, cached, _ in calls.values()),
            "trained_tokens": sum(step["tokens"] for step in steps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the kinds and every process's figures")
    parser.add_argument("--interval-s", type=float, default=0.5, help="seconds between polls of /proc")
    parser.add_argument("--report", type=Path, help="the run's report folder: count its calls, tokens and steps")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    if not args.interval_s > 0:
        parser.error(f"--interval-s must be > 0, got {args.interval_s}")
    result = measure(command, args.interval_s)
    load = lambda values: "/".join(f"{value:.1f}" for value in values)  # noqa: E731
    print(f"wall {result['wall_s']:.1f} s, exit {result['exit_code']}, load average (1/5/15 min) "
          f"{load(result['load_before'])} before, {load(result['load_after'])} after; CPU {result['cpu_s']:.1f} s:")
    for kind, row in result["by_kind"].items():
        print(f"  {kind:<14} {row['cpu_s']:8.1f} s  {row['cpu_s'] / max(result['cpu_s'], 1e-9):6.1%}  "
              f"(system {row['system_cpu_s']:6.1f} s)  {row['processes']:5d} processes seen, "
              f"+{row['unseen_cpu_s']:.1f} s of unseen ones")
    if args.report is not None and (args.report / "events.glog").is_file():
        counts = result["counts"] = run_counts(args.report)
        steps = max(counts["steps"], 1)
        print(f"  {counts['steps']} steps; per step: " + ", ".join(
            f"{counts[name] / steps:,.0f} {name.replace('_', ' ')}" for name in
            ("model_calls", "generated_tokens", "prefilled_tokens", "cached_prompt_tokens", "trained_tokens")))
        print(f"  CPU per step {result['cpu_s'] / steps:.1f} s, per model call "
              f"{1000 * result['cpu_s'] / max(counts['model_calls'], 1):.1f} ms (everything included)")
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
