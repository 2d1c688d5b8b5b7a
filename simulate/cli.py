"""`gyre simulate`: compare scheduling policies on an emulated cluster before renting it (harness.py).

    gyre simulate --workload terminalbench --hardware h200 --cells 8 --gpus-per-cell 8 \\
        --model-active-params 22e9 --groups 64 --group-size 16 --staleness 1 --steps 20 --json --out sim/

prints one line per policy and one line of cell-hours by account per policy (where the time went, accounting.py),
or, with --json, one object with elastic_hours, colocate_hours, async_best_hours and async_best_split (no
streaming), async_streaming_best_hours and async_streaming_best_split, lower_bound_hours, wall_s, each policy's
`time_accounts` and the `accounting` summary; with --out it writes result.json and one role picture per policy
(roles.png).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import structlog

from gyre.simulate.hardware import HARDWARE, ModelProfile
from gyre.simulate.harness import Setup, compare
from gyre.simulate.workloads import WORKLOADS


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("simulate", help="compare scheduling policies on emulated GPU cells (virtual time)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--out", default=None, help="folder for result.json and the role pictures")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="terminalbench")
    p.add_argument("--workload-from", default=None, metavar="LOG",
                   help="replay the executions of a recorded run (its event log: calls, tokens, tool gaps, setup and "
                   "scoring times; simulate/recorded.py) instead of a --workload preset")
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="h200")
    p.add_argument("--cells", type=int, default=8)
    p.add_argument("--gpus-per-cell", type=int, default=8)
    p.add_argument("--model-active-params", type=float, default=22e9)
    p.add_argument("--model-total-params", type=float, default=None,
                   help="default: 235e9 for 22e9 active (Qwen3-235B-A22B), else equal to the active ones (dense)")
    p.add_argument("--kv-bytes-per-token", type=float, default=None,
                   help="default: Qwen3-235B's 192,512; for a dense model 2 x layers x kv heads x 128 x 2 bytes")
    p.add_argument("--groups", type=int, default=64, help="groups per step")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--admit-up-to-capacity", action="store_true",
                   help="the emulated proxy places a session only on a cell with free capacity; the rest wait")
    p.add_argument("--rebalance-on-join", action="store_true",
                   help="a cell that joins rollout takes over live sessions between calls from the fullest cells (their "
                   "KV moved); the real proxy does not do this yet (sessions stay where they were placed)")
    p.add_argument("--elastic-work-per-switch", type=float, default=8.0,
                   help="the elastic run's ElasticPolicy(work_per_switch=...): a satellite leaves rollout only for "
                   "waiting training work worth this many measured switch round trips (0: the session-counting "
                   "rules, as elastic-sessions runs them)")
    p.add_argument("--only", action="append", default=[],
                   help="run only policies whose name starts with this (elastic, colocate, async[, async-streaming[)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="policy runs at a time, each in its own process (the figures do not depend on it; default: "
                   "2, or 1 on a one-core machine)")
    p.set_defaults(func=_handle)


def setup_from_args(args: argparse.Namespace) -> Setup:
    if args.jobs < 1:
        raise SystemExit("gyre simulate: --jobs must be >= 1")
    if args.elastic_work_per_switch < 0:
        raise SystemExit("gyre simulate: --elastic-work-per-switch must be >= 0")
    for name in ("cells", "gpus_per_cell", "groups", "group_size", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"gyre simulate: --{name.replace('_', '-')} must be >= 1")
    if args.staleness < 0:
        raise SystemExit("gyre simulate: --staleness must be >= 0")
    total = args.model_total_params
    if total is None:
        total = 235e9 if args.model_active_params == 22e9 else args.model_active_params
    model_kwargs: dict[str, Any] = {"active_params": args.model_active_params, "total_params": total}
    if args.kv_bytes_per_token is not None:
        model_kwargs["kv_bytes_per_token"] = args.kv_bytes_per_token
    workload = WORKLOADS[args.workload]
    if args.workload_from:
        from gyre.runtime.errors import GyreError
        from gyre.simulate.recorded import workload_from_log

        try:
            workload = workload_from_log(args.workload_from)
        except (OSError, GyreError) as error:  # unreadable, corrupt, or nothing to replay
            raise SystemExit(f"gyre simulate: --workload-from {args.workload_from}: {error}") from None
    try:
        return Setup(workload=workload, hardware=args.hardware, cells=args.cells,
                     gpus_per_cell=args.gpus_per_cell, model=ModelProfile(**model_kwargs), groups=args.groups,
                     group_size=args.group_size, staleness=args.staleness, steps=args.steps, seed=args.seed,
                     admit_up_to_capacity=args.admit_up_to_capacity, rebalance_on_join=args.rebalance_on_join,
                     elastic_work_per_switch=args.elastic_work_per_switch)
    except ValueError as error:
        raise SystemExit(f"gyre simulate: {error}") from None


def _handle(args: argparse.Namespace) -> int:
    setup = setup_from_args(args)
    try:
        setup.cell_model()
    except ValueError as error:
        raise SystemExit(f"gyre simulate: {error}") from None
    # The emulated actors log every switch and step; a comparison of 16 runs wants only its answer.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    result = compare(setup, tuple(args.only), jobs=args.jobs)
    runs = result.pop("_runs")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        from gyre.simulate.pictures import draw_roles

        draw_roles(runs, out / "roles.png")
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'policy':<28}{'hours':>8}{'s/step':>9}{'rollout':>9}{'busy h':>9}{'idle h':>9}{'switches':>9}")
    for run in runs:
        print(f"{run.name:<28}{run.hours:>8.2f}{run.seconds_per_step:>9.0f}{run.rollout_share:>9.2f}"
              f"{run.busy_cell_hours:>9.1f}{run.idle_cell_hours:>9.1f}{run.switches:>9d}")
    print(f"\ncell-hours by account (simulate/accounting.py); packed: the run's own decode, prefill, training and "
          f"optimizer work spread perfectly over {result['setup']['cells']} cells, in hours")
    print(f"{'policy':<28}" + "".join(f"{title:>8}" for title, _ in ACCOUNT_COLUMNS) + f"{'batch':>7}{'KV':>6}{'packed':>8}")
    for run in runs:
        accounts = run.time_accounts
        hours, decode = accounts["cell_hours"], accounts["decode"]
        print(f"{run.name:<28}" + "".join(f"{sum(hours[k] for k in keys):>8.1f}" for _, keys in ACCOUNT_COLUMNS)
              + f"{decode['mean_sequences']:>7.0f}{decode['mean_kv_occupancy']:>6.2f}{accounts['packed_hours']:>8.2f}")
    print(f"lower bound {result['lower_bound_hours']:.2f} h; elastic vs colocate "
          f"{_ratio(result['elastic_vs_colocate'])}, vs the best streaming async ({result['async_streaming_best_split']}) "
          f"{_ratio(result['elastic_vs_async_streaming_best'])}; {result['wall_s']:.0f} s", file=sys.stdout)
    accounting = result["accounting"]
    if "target_hours" in accounting and "async_streaming_best_packed_hours" in accounting:
        print(f"{accounting['target_vs_async_streaming_best']:.2f}x the strongest async is {accounting['target_hours']:.2f}"
              f" h; its own work packed perfectly takes {accounting['async_streaming_best_packed_hours']:.2f} h"
              + (f", elastic's {accounting['elastic_packed_hours']:.2f} h" if "elastic_packed_hours" in accounting
                 else ""))
    return 0


ACCOUNT_COLUMNS = (
    ("decode", ("rollout.decode",)), ("prefill", ("rollout.prefill",)),
    ("again", ("rollout.prefill_evicted", "rollout.prefill_moved")), ("tools", ("rollout.tools",)),
    ("empty", ("rollout.empty",)), ("train", ("train.compute", "train.optimizer")),
    ("t-idle", ("train.idle_step_filling", "train.idle_step_fixed")),
    ("sync", ("rollout.weight_sync", "train.weight_sync")), ("switch", ("switching",)),
)
"""The text output's account columns: (title, accounts summed); "again" is prefill repeated (evicted prefixes, and
sessions that moved without their KV)."""


def _ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "n/a"
