"""The run monitor's per-step record counts the samples the claimer refused as too stale (its LandingsLost "stale"),
which StepApplied cannot carry: the core never sees them."""

from __future__ import annotations

import json

from gyre.actors.training.run_monitor import RunMonitor, RunMonitorConfig
from gyre.messages.samples import LandingsLost
from gyre.messages.training import StepApplied
from gyre.runtime import Topology
from gyre.runtime.testing import run_actors


def test_each_step_records_the_stale_samples_dropped_since_the_step_before(tmp_path):
    topology = Topology("monitor")
    topology.add("monitor", RunMonitor, RunMonitorConfig(report_dir=str(tmp_path), steps=3, cells=("core",),
                                                         progress=False))

    async def driver(h):
        monitor = h.actor("monitor")
        h.publish(LandingsLost(2, 32, "stale", step_id=0, base_version=0))
        h.publish(LandingsLost(1, 5, "in transit", step_id=0, base_version=0))  # lost, not stale: not counted here
        h.publish(LandingsLost(1, 16, "stale", step_id=0, base_version=0))
        h.publish(StepApplied(0, 1, 0.5, 1.0, 100, 10, 0))
        await h.wait_until(lambda: len(monitor.steps) == 1, what="step 0 recorded")
        h.publish(StepApplied(1, 2, 0.5, 1.0, 100, 10, 0))
        await h.wait_until(lambda: len(monitor.steps) == 2, what="step 1 recorded")
        h.publish(LandingsLost(1, 7, "stale", step_id=2, base_version=2))
        h.publish(StepApplied(2, 3, 0.5, 1.0, 100, 10, 0))
        await h.wait_stopped()

    run_actors(topology, driver, timeout_s=30)
    steps = json.loads((tmp_path / "run.json").read_text())["steps"]
    assert [step["stale_dropped"] for step in steps] == [48, 0, 7]
