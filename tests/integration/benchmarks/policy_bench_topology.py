"""A stand-in training topology for the test of `gyre bench policies`: it speaks the bench's flag contract and
writes run.json through the real run monitor, but its "training" is a timer that publishes StepApplied, so the test
exercises the bench's orchestration (subprocesses, flags, run.json) in seconds. The step interval depends on the
policy and split, so the test can check that the bench tells them apart and picks async's best split."""

from __future__ import annotations

import argparse

import attrs

from gyre.actors.training.run_monitor import RunMonitor, RunMonitorConfig
from gyre.messages.ping_pong import Tick
from gyre.messages.training import StepApplied
from gyre.runtime import Actor, Topology, handler

CELLS = ("core", "sat1", "sat2")
STEP_INTERVAL_S = {"elastic": 0.05, "colocate": 0.2, "async:core": 0.15, "async:core,sat1": 0.1}


@attrs.frozen
class StepperConfig:
    interval_s: float
    """Runtime-clock seconds between published steps."""


class Stepper(Actor):
    """Publishes StepApplied every interval_s until the run monitor stops the topology."""

    config_cls = StepperConfig

    async def on_start(self) -> None:
        self.send_later(self.config.interval_s, Tick(0))

    @handler(Tick)
    def on_tick(self, msg: Tick) -> None:
        self.publish(StepApplied(step_id=msg.number, version=msg.number + 1, loss=0.0, grad_norm=0.0, num_tokens=100,
                                 num_samples=4, stale_samples_dropped=0))
        self.send_later(self.config.interval_s, Tick(msg.number + 1))


def topology(argv: list[str]) -> Topology:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--async-train-cells", default="core")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--skip-eval", action="store_true")
    args = parser.parse_args(argv)
    key = args.policy if args.policy != "async" else f"async:{args.async_train_cells}"
    result = Topology("policy_bench_stand_in")
    result.add("stepper", Stepper, StepperConfig(interval_s=STEP_INTERVAL_S[key]))
    result.add("monitor", RunMonitor, RunMonitorConfig(report_dir=args.report, steps=args.steps, cells=CELLS,
                                                       core_cell="core", progress=False), process="control")
    return result
