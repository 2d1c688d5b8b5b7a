"""`gyre replay`: one actor on its recorded inbox (`--actor NAME`, gyre.runtime.cli_replay), or the whole control
plane of a recorded run with a policy swapped in (`--control-plane`, counterfactual.py):

    gyre replay REPORT/events.glog --control-plane [--policy elastic|async|colocate] [--split K|CELLS] [--json]

re-runs the run's scheduler, micro-step claimer and task source (their recorded configs) in virtual time over
emulated cells calibrated from the same log and the run's own executions, and prints the time the run would have
taken and seconds per step beside the recorded run's own. `--policy` defaults to the recorded policy's kind (with
its recorded settings); `--split` is async's train cells: a count (the core first) or comma-separated names.

The command lives here, not in gyre.runtime, because the control-plane re-run composes actors and emulated cells
from the layers above the runtime; the one-actor replay is the runtime's and is called as it was. Exit status:
0 done (or identical), 1 a one-actor replay that differs, 2 a log that cannot drive the replay (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from gyre.runtime.cli_replay import add_arguments, replay_command

POLICIES = ("elastic", "async", "colocate")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "replay", help="replay one actor from an event log (--actor), or re-run a recorded run's control plane "
        "under another policy on cells calibrated from the log (--control-plane)")
    add_arguments(parser, actor_required=False)
    parser.add_argument("--control-plane", action="store_true",
                        help="re-run the recorded run's control plane in virtual time (simulate/counterfactual.py)")
    parser.add_argument("--policy", choices=POLICIES, default=None,
                        help="with --control-plane: the policy swapped in, with the recorded settings when the run used "
                        "that kind (default: the recorded policy itself)")
    parser.add_argument("--split", default="", metavar="K|CELLS",
                        help="with --policy async: train cells, a count (core first) or names (default: the "
                        "recorded split, or the core alone)")
    parser.add_argument("--json", action="store_true", help="with --control-plane: print one JSON object")
    parser.add_argument("--tick-s", type=float, default=None,
                        help="with --control-plane: the emulated cells' tick, the resolution of a session's end "
                        "(default: 1/200 of the recorded s/step, within 0.01-2 s)")
    parser.set_defaults(func=_handle)


def _handle(args: argparse.Namespace) -> int:
    if not args.control_plane:
        if args.actor is None:
            print("gyre replay: name an actor (--actor NAME) or ask for --control-plane", file=sys.stderr)
            return 2
        if args.policy or args.split or args.json:
            print("gyre replay: --policy, --split and --json go with --control-plane", file=sys.stderr)
            return 2
        return replay_command(args)
    if args.actor is not None:
        print("gyre replay: --actor and --control-plane are two different replays: choose one", file=sys.stderr)
        return 2
    if args.tick_s is not None and args.tick_s <= 0:
        print("gyre replay: --tick-s must be > 0", file=sys.stderr)
        return 2
    import structlog

    from gyre.runtime.config_codec import CodeTrust
    from gyre.simulate.counterfactual import (
        CounterfactualError,
        calibration_summary,
        read_recorded_run,
        replay_control_plane,
    )

    # The emulated actors log every switch and step; the answer is the figures.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    try:
        run = read_recorded_run(args.log, CodeTrust(tuple(args.code)))
        result = replay_control_plane(run, args.policy, args.split, tick_s=args.tick_s)
    except CounterfactualError as error:
        print(f"gyre replay: {error}", file=sys.stderr)
        return 2
    result.pop("_record")
    if args.json:
        print(json.dumps({**result, "calibration": calibration_summary(run)}, default=str))
        return 0
    recorded = result["recorded"]
    print(f"{args.log}: {recorded['steps']} steps on {len(run.cells)} cells ({', '.join(run.cells)}), "
          f"recorded under {recorded['policy']}; cells calibrated from the log")
    print(f"{'':<26}{'run s':>9}{'s/step':>9}{'after step 1':>14}{'switches':>10}")
    for label, figures in ((f"recorded ({recorded['policy']})", recorded), (f"re-run ({result['policy']})", result)):
        after = figures["seconds_per_step_after_first"]
        print(f"{label:<26}{figures['run_s']:>9.1f}{figures['seconds_per_step']:>9.2f}"
              f"{(f'{after:.2f}' if after is not None else 'n/a'):>14}{figures['switches']:>10d}")
    if not result["finished"]:
        print(f"the re-run did not finish its {recorded['steps']} steps "
              f"({len(result['step_times_s'])} applied)")
    else:
        print(f"re-run / recorded: {result['vs_recorded']:.3f}x the run's time")
    return 0

