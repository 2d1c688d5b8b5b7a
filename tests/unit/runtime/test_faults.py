"""Fault plans (gyre.runtime.faults): the text parses into faults or is refused with the bad fault named; the
injector decides each delivery as the plan says; a run under a plan applies it (issue 28)."""

from __future__ import annotations

import math

import attrs
import pytest

from gyre.messages.ping_pong import Ball
from gyre.runtime import Actor, Topology, handler
from gyre.runtime.envelope import Envelope, Kind
from gyre.runtime.faults import Fault, FaultInjector, FaultPlanError, parse_plan, random_plan
from gyre.runtime.testing import run_with_faults


def test_a_plan_parses_into_its_faults():
    faults = parse_plan("kill claimer at 2 StepApplied; drop executor>claimer SamplesLanded 3 2;"
                        " delay a>b * 0.5 ; duplicate *>core StepReady 1; partition sat1 10 20")
    assert faults == (
        Fault("kill", actor="claimer", nth=2, message="StepApplied"),
        Fault("drop", actor="claimer", sender="executor", message="SamplesLanded", nth=3, count=2),
        Fault("delay", actor="b", sender="a", delay_s=0.5),
        Fault("duplicate", actor="core", sender="*", message="StepReady", nth=1),
        Fault("partition", actor="sat1", from_s=10.0, until_s=20.0),
    )
    assert [parse_plan(f.describe())[0] for f in faults] == list(faults)
    assert parse_plan("") == ()


@pytest.mark.parametrize("text, why", [
    ("explode core", "unknown fault"),
    ("kill core at x Ball", "N must be a number"),
    ("drop core Ball 1", "expected SENDER>RECEIVER"),
    ("partition core 5 2", "UNTIL must be after FROM"),
    ("delay a>b Ball inf", "out of range"),
])
def test_a_bad_plan_is_refused_with_the_fault_named(text, why):
    with pytest.raises(FaultPlanError, match=why):
        parse_plan(f"delay a>b Ball 1; {text}")


def _envelope(sender: str, receiver: str, kind: Kind = Kind.TELL) -> Envelope:
    return Envelope(1, sender, receiver, "", 0.0, 0, 0, kind)


def test_the_injector_counts_matches_and_fires_on_the_nth():
    injector = FaultInjector(parse_plan("drop a>b Ball 2 2; duplicate a>c Ball 1; kill d at 3 *; delay a>e Ball 1.5;"
                                        " partition f 1 2"), lambda cls: f"gyre.test.{cls.__name__}")
    ball = Ball(1, 0)
    fates = [injector.intercept(_envelope("a", "b"), ball, 0.0)[0] for _ in range(5)]
    assert fates == ["deliver", "drop", "drop", "deliver", "deliver"]
    assert injector.intercept(_envelope("x", "b"), ball, 0.0) == ("deliver", 0.0)  # another sender
    assert injector.intercept(_envelope("a", "c"), ball, 0.0)[0] == "duplicate"
    assert [injector.intercept(_envelope("z", "d"), ball, 0.0)[0] for _ in range(4)] == [
        "deliver", "deliver", "kill", "deliver"]
    assert injector.intercept(_envelope("a", "e"), ball, 0.0) == ("deliver", 1.5)
    assert [injector.intercept(_envelope("f", "q"), ball, t)[0] for t in (0.5, 1.0, 1.9, 2.0)] == [
        "deliver", "drop", "drop", "deliver"]
    # Replies are never touched: an ask whose request vanished times out instead.
    assert injector.intercept(_envelope("a", "b", Kind.REPLY), ball, 0.0) == ("deliver", 0.0)
    assert len(injector.applied) == 2 + 1 + 1 + 1 + 2


def test_random_plans_are_seeded_and_parse():
    links = (("a", "b", "Ball"),)
    for kind in ("kill", "drop", "delay", "duplicate", "partition"):
        text = random_plan(kind, 3, actors=("a", "b"), links=links, horizon_s=10.0)
        assert text == random_plan(kind, 3, actors=("a", "b"), links=links, horizon_s=10.0)
        assert parse_plan(text)[0].kind == kind
    with pytest.raises(FaultPlanError):
        random_plan("melt", 0, actors=("a",), links=links, horizon_s=1.0)


@attrs.frozen
class PitcherConfig:
    balls: int = 6


class Pitcher(Actor):
    config_cls = PitcherConfig

    async def on_start(self) -> None:
        for number in range(self.config.balls):
            self.send_later(0.1 * (number + 1), Ball(number, 0))

    @handler(Ball)
    def on_ball(self, msg: Ball) -> None:
        self.tell("catcher", msg)


class Catcher(Actor):
    async def on_start(self) -> None:
        self.caught: list[tuple[float, int]] = []

    @handler(Ball)
    def on_ball(self, msg: Ball) -> None:
        self.caught.append((self.clock.now(), msg.number))


def test_a_run_under_a_plan_drops_delays_and_kills_as_told():
    topology = Topology("faults", seed=1)
    topology.add("pitcher", Pitcher)
    topology.add("catcher", Catcher)

    async def inspect(node):
        return list(node.slots["catcher"].actor.caught)

    run = run_with_faults(topology, "drop pitcher>catcher Ball 2 1; delay pitcher>catcher Ball 1", until_s=5.0,
                          inspect=inspect)
    assert run.reason == "time limit of 5.0s reached" and run.exit_code == 1
    assert [rally for _, rally in run.value] == [0, 2, 3, 4, 5]  # the 2nd ball vanished
    assert all(math.isclose(t, 0.1 * (rally + 1) + 1.0) for t, rally in run.value)  # each a second late
    assert run.statistics["fault_drop"] == 1
    killed = run_with_faults(topology, "kill catcher at 3 Ball", until_s=5.0, inspect=inspect)
    assert killed.statistics["failures"] == 1  # restarted by its policy: the new instance caught the rest
    assert [rally for _, rally in killed.value] == [3, 4, 5]
