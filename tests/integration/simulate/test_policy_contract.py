"""The same policy objects drive real and emulated cells: one contract test per shipped policy.

For each policy, a real main-job run recorded under it (data/*.glog: real cells, engines and trainer, slimmed by
slim_log.py) and the control-plane re-run of that run (the same policy object, decoded from the log, over emulated
cells calibrated from it) are reduced to the same trace: each cell's first announced role, then every decision the
scheduler made about it (SwitchRole as the real cell received it; a switch the emulated cell began) and the role it
then announced. The same checks, which say what the policy promises the cells and what the cells promise back, run
on both traces:

- cells: every switch ends in the role it asked for, a cell is never switched while it switches, and the first
  announcement comes before any decision about the cell;
- async: the fixed split is made once, at the cells' announcements, and never touched again;
- colocate: decisions come in waves of every cell, to train and back to rollout in turn;
- elastic: the core is the first cell to train, and a satellite is not sent to train within the policy's dwell
  time of its last change (GYRE_CONTROL_PLANE_LOG=PATH adds a recorded elastic log: an 8-step one with 13 real
  switches passes).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import structlog

from gyre.messages.cells import ROLLOUT, SWITCHING, TRAIN, RoleChanged, SwitchRole
from gyre.policies.scheduling import AsyncPolicy, ColocatePolicy, ElasticPolicy
from gyre.runtime import Codec, read_log
from gyre.simulate.counterfactual import policy_for, read_recorded_run, replay_control_plane

DATA = Path(__file__).parent / "data"


@pytest.fixture(autouse=True)
def quiet_logs():
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    yield
    structlog.configure(**saved)


Trace = list[tuple[float, str, str, str]]
"""(time, cell, what, role): what is "announce" (first role), "decide" (a switch to role begins) or "became"."""


def real_trace(log: Path) -> Trace:
    codec, seen, trace = Codec(), set(), []
    announced: set[str] = set()
    for record in read_log(log, codec):
        if record.type_name not in (RoleChanged.__gyre_type__, SwitchRole.__gyre_type__):
            continue
        key = (record.envelope.sender, record.envelope.msg_id)
        if key in seen:
            continue
        seen.add(key)
        msg = record.decode(codec)
        if isinstance(msg, SwitchRole):
            trace.append((record.handled_s, msg.cell, "decide", msg.role))
        elif msg.cell not in announced:
            announced.add(msg.cell)
            trace.append((record.handled_s, msg.cell, "announce", msg.role))
        else:
            trace.append((record.handled_s, msg.cell, "became", msg.role))
    return sorted(trace, key=lambda e: e[0])


def emulated_trace(log: Path) -> tuple[Trace, object]:
    run = read_recorded_run(log)
    result = replay_control_plane(run, None)
    assert result["finished"]
    trace: Trace = []
    by_cell: dict[str, list[tuple[float, str]]] = {}
    for cell, time_s, role in result["_record"].role_changes:
        by_cell.setdefault(cell, []).append((time_s, role))
    for cell, changes in by_cell.items():
        if run.boot_s[cell] > 0:
            changes = changes[1:]  # the boot, before the first announcement
        trace.append((changes[0][0], cell, "announce", changes[0][1]))
        for (time_s, role), (_, after) in zip(changes[1:], changes[2:]):
            if role == SWITCHING:
                trace.append((time_s, cell, "decide", after))
        for time_s, role in changes[1:]:
            if role != SWITCHING:
                trace.append((time_s, cell, "became", role))
    return sorted(trace, key=lambda e: (e[0], e[2] != "became")), run


def check_cells_keep_their_side(trace: Trace) -> None:
    role: dict[str, str] = {}
    pending: dict[str, str] = {}
    for _, cell, what, target in trace:
        if what == "announce":
            assert cell not in role, f"{cell} announced twice"
            role[cell] = target
        elif what == "decide":
            assert cell in role, f"a decision about {cell} before it announced itself"
            assert cell not in pending, f"{cell} switched while it was switching"
            assert target != role[cell], f"{cell} asked to become what it is ({target})"
            pending[cell] = target
        else:
            assert pending.pop(cell, None) == target, f"{cell} became {target} unasked"
            role[cell] = target


def decisions(trace: Trace) -> list[tuple[float, str, str]]:
    return [(t, cell, role) for t, cell, what, role in trace if what == "decide"]


def both(name: str | Path) -> tuple[Trace, Trace, object]:
    log = DATA / name
    real = real_trace(log)
    emulated, run = emulated_trace(log)
    for trace in (real, emulated):
        check_cells_keep_their_side(trace)
    return real, emulated, run


def test_async_contract_on_real_and_emulated_cells() -> None:
    real, emulated, run = both("agent_rl_async_3steps.glog")
    policy = run.scheduler.policy
    assert isinstance(policy, AsyncPolicy) and policy_for(run, None)[1] is policy  # the same object drives both
    for trace in (real, emulated):
        first = {cell: role for _, cell, what, role in trace if what == "announce"}
        wanted = {cell: TRAIN if cell in policy.train_cells else ROLLOUT for cell in first}
        made = [(cell, role) for _, cell, role in decisions(trace)]
        assert sorted(made) == sorted((c, wanted[c]) for c in first if first[c] != wanted[c])  # once, and only those
    assert [(c, r) for _, c, r in decisions(real)] == [(c, r) for _, c, r in decisions(emulated)]


def test_colocate_contract_on_real_and_emulated_cells() -> None:
    real, emulated, run = both("agent_rl_colocate_3steps.glog")
    assert isinstance(run.scheduler.policy, ColocatePolicy)
    for trace in (real, emulated):
        made = decisions(trace)
        cells = len(run.cells)
        assert made and len(made) % cells == 0
        waves = [made[i:i + cells] for i in range(0, len(made), cells)]
        for index, wave in enumerate(waves):
            assert sorted(cell for _, cell, _ in wave) == sorted(run.cells)  # every cell, together
            assert {role for _, _, role in wave} == {TRAIN if index % 2 == 0 else ROLLOUT}  # train, then back
        assert len(waves) >= run.steps  # at least one training wave a step


ELASTIC_LOGS = [DATA / "agent_rl_4steps.glog"] + (
    [Path(os.environ["GYRE_CONTROL_PLANE_LOG"])] if os.environ.get("GYRE_CONTROL_PLANE_LOG") else [])


@pytest.mark.parametrize("log", ELASTIC_LOGS, ids=lambda p: p.name)
def test_elastic_contract_on_real_and_emulated_cells(log: Path) -> None:
    real, emulated, run = both(log)
    if not isinstance(run.scheduler.policy, ElasticPolicy):
        pytest.skip(f"{log} was not recorded under elastic")
    policy = run.scheduler.policy
    for trace in (real, emulated):
        made = decisions(trace)
        first_train = next(cell for _, cell, role in made if role == TRAIN)
        assert first_train == run.core
        last_change: dict[str, float] = {}
        for t, cell, what, role in trace:
            # Into training only: a satellite may come back at once when none rolls out (idle_rollout_trains).
            if what == "decide" and role == TRAIN and cell != run.core and cell in last_change:
                assert t - last_change[cell] >= policy.min_dwell_s - 1e-6
            if what in ("announce", "became"):
                last_change[cell] = t
