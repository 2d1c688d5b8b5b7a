"""CPU seconds of a command's whole process tree, by process: where a run's CPU goes.

    python benchmarks/studies/process_cpu.py --out cpu.json -- gyre run examples/agent_rl.py --report /tmp/r --skip-eval \
        --steps 4 --policy async

Polls /proc every `--interval-s` for every descendant of the command and keeps, per pid, its own CPU time and the
CPU time of the children it has reaped (`cutime + cstime`). That second figure is what makes short-lived processes
visible: the warm launcher's server reaps every agent it forks, the executor's process reaps every scorer. At the
end it prints one line per process that used at least a second, largest first, and writes all of them to `--out`.

Do not add the rows up: a parent's reaped time already holds the whole CPU time of every descendant it reaped
(the root's holds nearly everything once the run's processes have exited). A process that starts and ends between
two polls is counted only through its parent's reaped time, which is the point of reading it. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        todo.extend(_children(current))
    return pids


def _sample(pid: int) -> dict | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "(comm)": state is field 3 of proc(5)
    utime, stime, cutime, cstime = (int(x) / CLOCK_TICKS_PER_S for x in fields[11:15])
    return {"ppid": int(fields[1]), "comm": stat[stat.index("(") + 1:stat.rindex(")")], "cmdline": cmdline[:300],
            "self_cpu_s": utime + stime, "system_cpu_s": stime, "reaped_children_cpu_s": cutime + cstime,
            "rss_mib": int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 2**20}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for every process's figures")
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    started = time.perf_counter()
    child = subprocess.Popen(command)
    last: dict[int, dict] = {}
    while child.poll() is None:
        for pid in _tree(child.pid):
            sample = _sample(pid)
            if sample is not None:
                sample["peak_rss_mib"] = max(sample.pop("rss_mib"), last.get(pid, {}).get("peak_rss_mib", 0.0))
                last[pid] = sample
        time.sleep(args.interval_s)
    wall_s = time.perf_counter() - started
    for sample in last.values():
        sample["total_cpu_s"] = sample["self_cpu_s"] + sample["reaped_children_cpu_s"]
    rows = sorted(last.items(), key=lambda item: -item[1]["total_cpu_s"])
    print(f"wall {wall_s:.1f} s, exit {child.returncode}; CPU-s by process (self + reaped children):")
    for pid, sample in rows:
        if sample["total_cpu_s"] >= 1.0:
            print(f"  {pid:>7} parent {sample['ppid']:>7}  self {sample['self_cpu_s']:7.1f}  reaped "
                  f"{sample['reaped_children_cpu_s']:7.1f}  rss {sample['peak_rss_mib']:6.0f} MiB  "
                  f"{sample['cmdline'][:70]}")
    Path(args.out).write_text(json.dumps({"wall_s": wall_s, "exit_code": child.returncode,
                                          "processes": {str(pid): sample for pid, sample in rows}}, indent=1))
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
