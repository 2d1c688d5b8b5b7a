"""A small training run for `gyre run --resume` tests, in virtual time: the real task source, claimer, run monitor
and checkpointer around the scripted executor and core of `gyre bench faults` (gyre.benchmarks.faults).

The scripted core follows the core's contract (actors/cells/core_checkpoint.py): it claims each step's micro-steps,
reports them done, publishes StepApplied, saves its part (its version and a running hash of what it trained: the
"weights") after every step and tells the checkpointer; `--resume-from` restores it. `--crash-after-step K` ends a
fresh run (not a resumed one) with status 1 right after step K, as a dying core does.

    gyre run tests/integration/runtime/resume_topology.py --virtual --report R --steps 4 --crash-after-step 1
    gyre run tests/integration/runtime/resume_topology.py --virtual --report R --resume
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gyre.benchmarks.faults import fault_topology
from gyre.runtime import Topology


def topology(argv: list[str]) -> Topology:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--crash-after-step", type=int, default=-1)
    parser.add_argument("--resume-from", default="")
    args = parser.parse_args(argv)
    report = Path(args.report)
    result = fault_topology(str(report / "run_checkpoints"), steps=args.steps, seed=3, resume_from=args.resume_from,
                            crash_after_step=args.crash_after_step, report=str(report))
    result.log_path = str(report / "events.glog")
    return result
