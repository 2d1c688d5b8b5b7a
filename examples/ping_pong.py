"""Ping and pong: the smallest topology that exercises tells, timers, an ask and a clean stop.

    gyre run examples/ping_pong.py --log runs/ping.glog            # two processes over ZeroMQ
    gyre run examples/ping_pong.py --virtual --seed 1 --log runs/v.glog
    gyre replay runs/v.glog --actor pong
"""

from __future__ import annotations

import argparse

import attrs

from gyre.messages.ping_pong import Ball, Score, ScoreAsked, Tick
from gyre.runtime import Actor, Topology, handler


@attrs.frozen
class PingConfig:
    """How long the rally lasts."""

    rounds: int = 20
    """Balls to serve before stopping the run."""
    interval_s: float = 0.01
    """Runtime-clock time between serves."""
    ask_every: int = 5
    """Ask pong for the score every this many rounds."""


class Ping(Actor):
    """Serves a ball on every tick of a timer, asks for the score now and then, ends the run after `rounds`."""

    config_cls = PingConfig

    async def on_start(self) -> None:
        self.served = 0
        self.returned = 0
        self.send_later(self.config.interval_s, Tick(0))

    @handler(Tick)
    async def on_tick(self, msg: Tick) -> None:
        if self.served >= self.config.rounds:
            score = await self.ask("pong", ScoreAsked())
            self.stop_topology(f"rally over: pong returned {score.returned} of {self.served}")
            return
        self.served += 1
        self.tell("pong", Ball(self.served, self.rng.randint(1, 6)))
        if self.served % self.config.ask_every == 0:
            score = await self.ask("pong", ScoreAsked())
            self.log.info("score", served=self.served, returned=score.returned)
        self.send_later(self.config.interval_s, Tick(msg.number + 1))

    @handler(Ball)
    def on_ball(self, msg: Ball) -> None:
        self.returned += 1


@attrs.frozen
class PongConfig:
    """Pong's one knob."""

    spin: int = 1
    """Added to every returned ball's spin (change it to see replay report a difference)."""


class Pong(Actor):
    """Returns every ball and keeps score."""

    config_cls = PongConfig

    async def on_start(self) -> None:
        self.returned = 0

    @handler(Ball)
    def on_ball(self, msg: Ball) -> None:
        self.returned += 1
        self.tell("ping", Ball(msg.number, msg.spin + self.config.spin))

    @handler(ScoreAsked)
    def on_score(self, msg: ScoreAsked) -> Score:
        return Score(self.returned)


def topology(argv: list[str]) -> Topology:
    parser = argparse.ArgumentParser(prog="ping_pong")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    result = Topology("ping_pong", seed=0)
    result.add("ping", Ping, PingConfig(rounds=args.rounds))
    result.add("pong", Pong, PongConfig())
    return result
