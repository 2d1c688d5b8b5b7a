"""Where a training run's rollout compute went, read off its event log: by task kind, by the fate of the group
(landed or dropped), by outcome, and what a cap on each execution's model calls would have cut.

    python benchmarks/studies/rollout_cost.py REPORT_DIR [REPORT_DIR ...] [--json]

A dropped group (its 16 rewards alike) trains nothing, so the rollout compute it used bought nothing; the task
sampler (policies/task_sampling.py) and the agent's bounds decide how much of it there is. The work of a model call
is counted as the tokens the engine computed for it: its prompt tokens not served from the prefix cache, plus its
output tokens (`ModelCallCompleted`). Per kind: groups run and landed, the share of all tokens, and landed groups
per million tokens (what a kind yields for its compute). The call budget: for a cap of K calls an execution, the
share of tokens in calls past the K-th and the successful executions that made more than K calls.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgpack

from gyre.actors.training.trajectory_builder import call_work_tokens, scored_success
from gyre.messages.executions import ExecutionFinished
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.samples import ExecutionScored
from gyre.policies.task_sampling import family_of
from gyre.runtime.codec import Codec
from gyre.runtime.event_log import LogRecord, read_log

WANTED = {"gyre.model_calls.ModelCallCompleted", "gyre.executions.ExecutionFinished", "gyre.executions.GroupDone",
          "gyre.samples.ExecutionScored"}
CALL_BUDGETS = (8, 12, 16, 20, 24)


def _share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _group_fate(record: LogRecord, codec: Codec) -> tuple[str, bool]:
    """(group id, landed) of a GroupDone record. Version 1 (logs written before session 17, without work tokens) is
    read from its fields as they are: group_id and landed come first in both."""
    if record.version == 1:
        group_id, landed = msgpack.unpackb(record.body, use_list=False, raw=False)[:2]
        return group_id, bool(landed)
    message = record.decode(codec)
    return message.group_id, message.landed


def rollout_cost(log_path: Path) -> dict[str, Any]:
    """The breakdown of one run's log (see the module doc). A message may be recorded by several receivers; each
    execution's calls are keyed by call index, each group's fate and each execution's outcome by id, so copies
    count once."""
    codec = Codec()
    call_tokens: dict[str, dict[int, int]] = {}
    group_of: dict[str, str] = {}
    kind_of: dict[str, str] = {}
    success: dict[str, bool] = {}  # scored execution -> success, as the builder judges it
    landed: dict[str, bool] = {}
    for record in read_log(log_path, codec):
        if record.type_name not in WANTED:
            continue
        if record.type_name == "gyre.executions.GroupDone":
            group, fate = _group_fate(record, codec)
            landed[group] = fate
            continue
        message = record.decode(codec)
        if isinstance(message, ModelCallCompleted):
            call_tokens.setdefault(message.execution_id, {})[message.call_index] = call_work_tokens(message)
            group_of[message.execution_id] = message.group_id
        elif isinstance(message, ExecutionFinished):
            group_of[message.execution_id] = message.group_id
            kind_of[message.group_id] = family_of(message.task.task_id, "-")
        elif isinstance(message, ExecutionScored):
            success[message.execution_id] = scored_success(message)
    # Executions of groups that finished (landed or dropped), with a reward.
    executions = [e for e in success if group_of.get(e) in landed]
    tokens = {e: sum(call_tokens.get(e, {}).values()) for e in executions}
    total = sum(tokens.values())
    by_kind: dict[str, dict[str, Any]] = {}
    for group, fate in landed.items():
        entry = by_kind.setdefault(kind_of.get(group, "?"), {"groups": 0, "landed": 0, "tokens": 0})
        entry["groups"] += 1
        entry["landed"] += int(fate)
    for e in executions:
        by_kind[kind_of.get(group_of[e], "?")]["tokens"] += tokens[e]
    for entry in by_kind.values():
        entry["token_share"] = round(_share(entry["tokens"], total), 4)
        entry["landed_per_mtoken"] = round(_share(entry["landed"] * 1e6, entry["tokens"]), 2)

    def outcome(selected: list[str]) -> dict[str, Any]:
        return {"executions": len(selected),
                "calls_per_execution": round(_share(sum(len(call_tokens.get(e, {})) for e in selected),
                                                    len(selected)), 2),
                "tokens_per_execution": round(_share(sum(tokens[e] for e in selected), len(selected)), 1),
                "token_share": round(_share(sum(tokens[e] for e in selected), total), 4)}

    successes = [e for e in executions if success[e]]
    budgets = {}
    for cap in CALL_BUDGETS:
        cut = sum(work for e in executions for index, work in call_tokens.get(e, {}).items() if index >= cap)
        budgets[str(cap)] = {"token_share_cut": round(_share(cut, total), 4),
                             "successes_lost": sum(1 for e in successes if len(call_tokens.get(e, {})) > cap)}
    return {
        "log": str(log_path), "executions": len(executions), "tokens": total,
        "groups": len(landed), "groups_landed": sum(landed.values()),
        "dropped_group_token_share": round(_share(sum(tokens[e] for e in executions if not landed[group_of[e]]),
                                                  total), 4),
        "by_kind": dict(sorted(by_kind.items())),
        "by_outcome": {"success": outcome(successes),
                       "failure": outcome([e for e in executions if not success[e]])},
        "call_budget": budgets,
    }


def _log_of(path: Path) -> Path:
    return path / "events.glog" if path.is_dir() else path


def _print(result: dict[str, Any]) -> None:
    print(f"{result['log']}: {result['executions']} executions, {result['tokens']:,} tokens, groups "
          f"{result['groups_landed']}/{result['groups']} landed; {result['dropped_group_token_share']:.1%} of the "
          f"tokens went to dropped groups")
    print(f"  {'kind':8s} {'groups':>6s} {'landed':>6s} {'tokens':>7s} {'landed/Mtok':>11s}")
    for kind, entry in result["by_kind"].items():
        print(f"  {kind:8s} {entry['groups']:6d} {entry['landed']:6d} {entry['token_share']:7.1%} "
              f"{entry['landed_per_mtoken']:11.1f}")
    for name, entry in result["by_outcome"].items():
        print(f"  {name}: {entry['executions']} executions, {entry['calls_per_execution']} calls and "
              f"{entry['tokens_per_execution']} tokens each, {entry['token_share']:.1%} of the tokens")
    for cap, entry in result["call_budget"].items():
        print(f"  at most {cap} calls an execution: {entry['token_share_cut']:.1%} of the tokens cut, "
              f"{entry['successes_lost']} successes lost")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="report folders (or event logs)")
    parser.add_argument("--json", action="store_true", help="one JSON object per run")
    args = parser.parse_args(argv)
    for path in args.reports:
        log = _log_of(path)
        if not log.exists():
            print(f"rollout_cost: no event log at {log}", file=sys.stderr)
            return 2
        result = rollout_cost(log)
        if args.json:
            print(json.dumps(result))
        else:
            _print(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
