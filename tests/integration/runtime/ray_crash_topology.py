"""A ping-pong for the Ray launcher's tests: pong's process dies (os._exit, a real death of its Ray worker) when it
receives ball number `--crash-at`, once (a marker file records that it did, so a restarted pong plays on); and
placement declarations to check: ping or pong pinned by a custom resource, both groups packed on one node, a group that
asks for more than the cluster has."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import attrs

from gyre.messages.ping_pong import Ball, Score, ScoreAsked
from gyre.runtime import Actor, RestartPolicy, Topology, handler
from gyre.runtime.topology import load_topology_module

_EXAMPLE = load_topology_module(Path(__file__).resolve().parents[3] / "examples" / "ping_pong.py")
Ping, PingConfig = _EXAMPLE.Ping, _EXAMPLE.PingConfig


@attrs.frozen
class CrashingPongConfig:
    """When to die."""

    crash_at: int = 10
    """The ball number that kills the process."""
    marker: str = ""
    """File whose existence means the process already died once."""


class CrashingPong(Actor):
    """Returns balls like the example's pong until ball `crash_at`, then ends its process without a goodbye."""

    config_cls = CrashingPongConfig

    async def on_start(self) -> None:
        self.returned = 0
        self.log.info("crashing_pong_armed", crash_at=self.config.crash_at)

    @handler(Ball)
    def on_ball(self, msg: Ball) -> None:
        if self.config.marker and msg.number == self.config.crash_at and not Path(self.config.marker).exists():
            Path(self.config.marker).write_text("died once\n")
            os._exit(17)
        self.returned += 1
        self.tell("ping", Ball(msg.number, msg.spin + 1))

    @handler(ScoreAsked)
    def on_score(self, msg: ScoreAsked) -> Score:
        return Score(self.returned)


def topology(argv: list[str]) -> Topology:
    parser = argparse.ArgumentParser(prog="ray_crash_topology")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--interval-s", type=float, default=0.05)
    parser.add_argument("--crash-at", type=int, default=20)
    parser.add_argument("--ask-every", type=int, default=5)
    parser.add_argument("--marker", default="", help="no crash without one")
    parser.add_argument("--pong-needs", default="", help="a custom resource pong reserves one of")
    parser.add_argument("--ping-needs", default="", help="a custom resource ping reserves one of")
    parser.add_argument("--pack", action="store_true", help="ping and pong on one node, half a CPU each")
    parser.add_argument("--pong-gpus", type=float, default=0.0)
    parser.add_argument("--mode", choices=("restart", "stop_topology"), default="stop_topology")
    args = parser.parse_args(argv)
    result = Topology("ray_crash", seed=0)
    result.add("ping", Ping, PingConfig(rounds=args.rounds, interval_s=args.interval_s, ask_every=args.ask_every))
    result.add("pong", CrashingPong, CrashingPongConfig(args.crash_at, args.marker), restart=RestartPolicy(args.mode))
    if args.pong_needs or args.pong_gpus:
        result.resources("pong", CPU=1, GPU=args.pong_gpus, custom={args.pong_needs: 1} if args.pong_needs else {})
    if args.ping_needs:
        result.resources("ping", CPU=1, custom={args.ping_needs: 1})
    if args.pack:
        result.resources("ping", CPU=0.5)
        result.resources("pong", CPU=0.5)
        result.pack("rally", ["ping", "pong"])
        result.place_packs("STRICT_PACK")
    return result
