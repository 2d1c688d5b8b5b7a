"""`gyre bench gradients`: bytes and seconds to bring the satellites' gradients into the core, per cell per micro-step,
by reduction rounds (today's path) against the parameter server the cells used before, at 2 and 3 training cells.

Each training cell is its own OS process (spawned): the core (this process) and `cells - 1` satellites, each holding
a flat fp32 gradient buffer of `numel` elements (default: the tiny model's parameter count). One *round* is one
micro-step on every satellite, brought into the core:
- `rounds` (engines/grad_exchange.py): a reduce-scatter ring among the satellites over a gloo group, then each
  reduced chunk to the core; the bytes are what `reduce_to_core` moved (tensor payloads), the group formed once per
  membership (`join_s`) and reused;
- `parameter_server` (the old path): the core pulls every satellite's whole buffer through Mooncake (TCP on
  loopback) and adds it; the bytes are the core's Mooncake `bytes_read`, a satellite's what was read from it.
Figures per cell and round: bytes sent + received by the core and by the busiest satellite, the largest over cells,
and the median seconds a round takes at the core. The sum the core gets is checked against the satellites' buffers
on both paths.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import attrs
import structlog
import torch

from gyre.runtime.logs import CURRENT_STDERR

__all__ = ["GradientBenchConfig", "GradientBenchResult", "PathFigures", "main", "register", "run_gradient_bench"]

TINY_NUMEL = 1_312_128
"""Parameters of the tiny preset (gyre model init --preset tiny)."""


@attrs.frozen
class GradientBenchConfig:
    cells: tuple[int, ...] = (2, 3)
    """Training cells (the core included) to measure."""
    numel: int = TINY_NUMEL
    """Elements of the flat fp32 gradient buffer."""
    rounds: int = 5
    """Rounds measured per path and cell count (a median is taken)."""
    timeout_s: float = 120.0
    """Bound on every wait (a satellite that never comes fails the bench)."""

    def __attrs_post_init__(self) -> None:
        if not self.cells or any(type(c) is not int or c < 2 for c in self.cells):
            raise ValueError(f"cells must be counts >= 2 (the core and a satellite), got {self.cells!r}")
        if self.numel < max(self.cells) or self.rounds < 1:
            raise ValueError("numel must be at least the number of satellites and rounds >= 1")


@attrs.frozen
class PathFigures:
    path: str
    """"rounds" or "parameter_server"."""
    cells: int
    core_sent: int
    core_received: int
    satellite_sent: int
    """The busiest satellite's (per round: one micro-step each)."""
    satellite_received: int
    largest_sent: int
    """Most bytes any one cell sent in a round."""
    largest_received: int
    """Most bytes any one cell received in a round."""
    largest_total: int
    """Most bytes (sent + received) any one cell moved in a round."""
    round_s: float
    """Median seconds per round at the core."""
    join_s: float
    """Rounds: seconds the core spent forming the group (once per membership, every member already connected to
    the store and arriving at once); 0 for the parameter server."""


@attrs.frozen
class GradientBenchResult:
    numel: int
    buffer_bytes: int
    figures: tuple[PathFigures, ...]
    rounds_growth_largest_received: float
    """Most bytes one cell received per micro-step, at the most cells over the fewest, rounds path (1.0 = flat)."""
    rounds_growth_largest_sent: float
    rounds_growth_largest_total: float
    """Sent + received: bounded by 2 buffers (S + (m - 1) / m * S for a satellite of m), not flat."""
    parameter_server_growth_largest_received: float
    """The same for the parameter server: its core receives one buffer per satellite."""
    server_over_rounds_largest_received: float
    """Most bytes one cell received, parameter server over rounds, at the most cells."""


def _quiet() -> None:
    """stdout carries the result: log lines go to stderr, warnings and worse only (here and in each satellite)."""
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(CURRENT_STDERR),
                        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _satellite_buffer(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))


def _satellite(rank: int, size: int, numel: int, rounds: int, host: str, port: int, timeout_s: float,
               conn: Any) -> None:
    """A satellite process: the old path's registered buffer first, then its side of every round."""
    _quiet()
    torch.set_num_threads(1)
    from gyre.engines.grad_exchange import ReductionMember
    from gyre.engines.transfer import TransferAgent

    grads = _satellite_buffer(rank, numel)
    with TransferAgent() as agent:
        addr, nbytes = agent.register_tensor(grads)
        conn.send((agent.peer, addr, nbytes))
        conn.recv()  # the core has pulled every round's buffers
    member = ReductionMember(timeout_s=timeout_s)
    member.store(host, port)
    conn.send("ready")  # so the core's join_s is the group's formation, not this process's Mooncake shutdown
    sent = received = 0
    work = torch.empty_like(grads)
    for _ in range(rounds):
        work.copy_(grads)  # the round uses the buffer as work space
        moved = member.reduce(host, port, 1, rank, size, work)
        sent, received = max(sent, moved.sent), max(received, moved.received)
    conn.send((sent, received))
    member.drop()


def _measure(cells: int, config: GradientBenchConfig) -> list[PathFigures]:
    from gyre.engines.grad_exchange import ReductionMember, RendezvousServer
    from gyre.engines.transfer import TransferAgent

    numel, size = config.numel, cells
    server = RendezvousServer("127.0.0.1", config.timeout_s)
    context = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(1, size):
        parent, child = context.Pipe()
        proc = context.Process(target=_satellite, args=(rank, size, numel, config.rounds, server.host, server.port,
                                                        config.timeout_s, child), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        expected = sum(_satellite_buffer(rank, numel) for rank in range(1, size))
        # The old path: the core pulls each satellite's buffer through Mooncake and adds it.
        descriptors = [_recv(pipe, config.timeout_s) for pipe in pipes]
        with TransferAgent() as agent:
            incoming = torch.zeros(numel)
            agent.register_tensor(incoming)
            total = torch.zeros(numel)
            before = agent.statistics().bytes_read
            times = []
            for _ in range(config.rounds):
                started = time.perf_counter()
                total.zero_()
                for peer, addr, _ in descriptors:
                    agent.pull_tensor(peer, addr, incoming)
                    total.add_(incoming)
                times.append(time.perf_counter() - started)
            read = (agent.statistics().bytes_read - before) // config.rounds
            if not torch.allclose(total, expected, atol=1e-4):
                raise RuntimeError("the parameter server's sum differs from the satellites' buffers")
        for pipe in pipes:
            pipe.send("pulled")
        per_satellite = read // (size - 1)
        server_figures = PathFigures("parameter_server", cells, 0, read, per_satellite, 0, per_satellite, read,
                                     max(read, per_satellite), statistics.median(times), 0.0)
        # Rounds.
        for pipe in pipes:
            if _recv(pipe, config.timeout_s) != "ready":
                raise RuntimeError("a satellite process is out of step")
        member = ReductionMember(timeout_s=config.timeout_s, store=server.store)
        reduced = torch.zeros(numel)
        times, core_received, join_s = [], 0, 0.0
        for i in range(config.rounds):
            started = time.perf_counter()
            moved = member.reduce(server.host, server.port, 1, 0, size, reduced)
            times.append(time.perf_counter() - started)
            core_received = max(core_received, moved.received)
            if i == 0:
                join_s = member.last_join_s
        if not torch.allclose(reduced, expected, atol=1e-4):
            raise RuntimeError("the round's sum differs from the satellites' buffers")
        moved_by_satellites = [_recv(pipe, config.timeout_s) for pipe in pipes]
        sat_sent = max(sent for sent, _ in moved_by_satellites)
        sat_received = max(received for _, received in moved_by_satellites)
        sat_total = max(sent + received for sent, received in moved_by_satellites)
        member.drop()
        # The first round forms the group: its time is in join_s, the median is over the rest when there are some.
        steady = times[1:] or times
        rounds_figures = PathFigures("rounds", cells, 0, core_received, sat_sent, sat_received, sat_sent,
                                     max(core_received, sat_received), max(core_received, sat_total),
                                     statistics.median(steady), join_s)
        return [server_figures, rounds_figures]
    finally:
        for proc in procs:
            proc.join(config.timeout_s)
            if proc.is_alive():
                proc.kill()


def _recv(pipe: Any, timeout_s: float) -> Any:
    if not pipe.poll(timeout_s):
        raise RuntimeError(f"a satellite process sent nothing within {timeout_s} s")
    return pipe.recv()


def run_gradient_bench(config: GradientBenchConfig = GradientBenchConfig()) -> GradientBenchResult:
    torch.set_num_threads(1)
    figures = [f for cells in config.cells for f in _measure(cells, config)]

    def largest(path: str, cells: int, what: str) -> int:
        return next(getattr(f, what) for f in figures if f.path == path and f.cells == cells)

    low, high = min(config.cells), max(config.cells)

    def growth(path: str, what: str) -> float:
        return largest(path, high, what) / largest(path, low, what)

    return GradientBenchResult(
        numel=config.numel, buffer_bytes=config.numel * 4, figures=tuple(figures),
        rounds_growth_largest_received=growth("rounds", "largest_received"),
        rounds_growth_largest_sent=growth("rounds", "largest_sent"),
        rounds_growth_largest_total=growth("rounds", "largest_total"),
        parameter_server_growth_largest_received=growth("parameter_server", "largest_received"),
        server_over_rounds_largest_received=(largest("parameter_server", high, "largest_received")
                                             / largest("rounds", high, "largest_received")),
    )


def _handle(args: argparse.Namespace) -> int:
    _quiet()
    config = GradientBenchConfig(cells=tuple(args.cells), numel=args.numel, rounds=args.rounds)
    result = run_gradient_bench(config)
    if args.json:
        print(json.dumps(attrs.asdict(result), indent=2))
        return 0
    print(f"buffer S = {result.buffer_bytes} bytes ({result.numel} fp32); bytes per cell per micro-step (one "
          "micro-step per satellite per round)")
    print(f"{'path':17s} {'cells':>5s} {'core_recv':>10s} {'sat_sent':>10s} {'sat_recv':>10s} {'max_sent':>10s} "
          f"{'max_recv':>10s} {'max_total':>10s} {'round_s':>8s} {'join_s':>7s}")
    for f in result.figures:
        print(f"{f.path:17s} {f.cells:5d} {f.core_received:10d} {f.satellite_sent:10d} {f.satellite_received:10d} "
              f"{f.largest_sent:10d} {f.largest_received:10d} {f.largest_total:10d} {f.round_s:8.4f} "
              f"{f.join_s:7.4f}")
    print(f"most cells / fewest, rounds: max received {result.rounds_growth_largest_received:.3f}, max sent "
          f"{result.rounds_growth_largest_sent:.3f}, max sent+received {result.rounds_growth_largest_total:.3f}; "
          f"parameter server: max received {result.parameter_server_growth_largest_received:.3f}; parameter server / "
          f"rounds, max received at the most cells {result.server_over_rounds_largest_received:.3f}")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("gradients", help="bytes per cell per micro-step: reduction rounds vs parameter server")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--cells", type=int, nargs="+", default=[2, 3], help="training cells, core included (2 3)")
    p.add_argument("--numel", type=int, default=TINY_NUMEL, help="gradient elements (default: the tiny model's)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per path and cell count (default 5)")
    p.set_defaults(func=_handle)


def main(argv: list[str] | None = None) -> int:
    """`gyre bench gradients` without the entry point: python -m gyre.benchmarks.gradients [--json ...]."""
    parser = argparse.ArgumentParser(prog="gyre bench")
    register(parser.add_subparsers())
    args = parser.parse_args(["gradients", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
