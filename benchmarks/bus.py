"""`gyre bench bus [--json]`: the bus's round-trip rate and latency, one-way throughput with and without recording,
over ipc:// and tcp://, with and without CURVE, against Ray actor calls measured in the same run on the same machine.

Gyre side: two actors in two OS processes started by the real `LocalProcessLauncher` (this file is also the
topology file). The driver asks the echo actor `Echo` messages one at a time (round trips: rate, p50, p99), then
sends a stream of tells with `send` (waiting for room, as a producer should) and asks for the count at the end: the
reply comes after every tell was handled, because one sender's messages keep their order (one-way throughput).
Each cycle runs four buses one after the other, so that load from other processes on a shared machine hits all
alike: the default (ipc:// + CURVE; the `gyre_*` figures), the same with the event log on (`*_recorded_*`), ipc://
without CURVE (`ipc_plain_*`: only the socket file's mode keeps other processes out, what CURVE costs is the
difference) and tcp:// on 127.0.0.1 + CURVE (`tcp_curve_*`, a run across machines on one). Each figure is the
median over every repeat of every cycle.

Ray side: `ray.init(address="local", num_cpus=2)` (a cluster of its own, even when another runs on the machine), kept
on 127.0.0.1 (see `_RayBaseline`), one remote actor with a method, sequential `ray.get(a.m.remote(x))` round trips.

Floors: the same round trips as a plain pyzmq + msgpack loop between two processes, without any runtime: blocking
calls (`raw_zmq_*`), and asyncio with a reader callback on the socket (`raw_asyncio_*`, the shape gyre has), measured
in the same run, so a reader can tell the runtime's own cost from the machine's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from gyre.messages.ping_pong import Echo, Score, ScoreAsked
from gyre.runtime.actor import Actor, handler
from gyre.runtime.launch import LocalProcessLauncher, RunOptions
from gyre.runtime.topology import Topology
from gyre.runtime.zmq_transport import ZmqConfig

TARGET_RATIO = 5.0
TARGET_P99_MS = 1.0
TARGET_RECORDING_OVERHEAD = 0.15
TARGET_TCP_CURVE_RATIO = 4.0

#: The buses a cycle measures: name -> (LocalProcessLauncher.bus, CURVE on ipc, record the event log).
BUSES = {
    "gyre": ("ipc", True, False),
    "recorded": ("ipc", True, True),
    "ipc_plain": ("ipc", False, False),
    "tcp_curve": ("tcp", True, False),
}


@attrs.frozen
class BenchConfig:
    """One benchmark run's sizes."""

    roundtrips: int = 2000
    """Sequential asks per repeat."""
    oneway: int = 20000
    """Tells per repeat of the one-way phase."""
    repeats: int = 3
    """Repeats of both phases within one run."""
    warmup: int = 300
    """Asks before measuring (sockets connected, caches warm)."""
    payload_bytes: int = 64
    """Size of each Echo's payload."""
    out_path: str = ""
    """Where the driver writes its measurements (JSON)."""


class BenchEcho(Actor):
    """Answers an Echo ask with the same Echo; counts Echo tells; tells the count when asked for the score."""

    async def on_start(self) -> None:
        self.count = 0

    @handler(Echo)
    def on_echo(self, msg: Echo) -> Echo:
        self.count += 1
        return msg  # the reply of an ask; ignored for a tell

    @handler(ScoreAsked)
    def on_count(self, msg: ScoreAsked) -> Score:
        return Score(self.count)


class BenchDriver(Actor):
    """Runs the phases in a background task (handlers must not hold the mailbox for seconds) and ends the run."""

    config_cls = BenchConfig

    async def on_start(self) -> None:
        self.spawn(self._measure(), name="bench")

    async def _measure(self) -> None:
        config: BenchConfig = self.config
        payload = bytes(config.payload_bytes)
        now = self.clock.now
        for number in range(config.warmup):
            await self.ask("echo", Echo(number, payload), timeout_s=60.0)
        results: dict[str, list] = {"roundtrip_per_s": [], "p50_ms": [], "p99_ms": [], "oneway_per_s": []}
        for _ in range(config.repeats):
            latencies_s = []
            start = now()
            for number in range(config.roundtrips):
                sent = now()
                await self.ask("echo", Echo(number, payload), timeout_s=60.0)
                latencies_s.append(now() - sent)
            elapsed_s = now() - start
            latencies_s.sort()
            results["roundtrip_per_s"].append(config.roundtrips / elapsed_s)
            results["p50_ms"].append(_percentile(latencies_s, 0.50) * 1e3)
            results["p99_ms"].append(_percentile(latencies_s, 0.99) * 1e3)

            before = (await self.ask("echo", ScoreAsked(), timeout_s=60.0)).returned
            start = now()
            for number in range(config.oneway):
                await self.send("echo", Echo(number, payload), timeout_s=60.0)
            after = (await self.ask("echo", ScoreAsked(), timeout_s=120.0)).returned
            elapsed_s = now() - start
            if after - before != config.oneway:
                raise RuntimeError(f"the echo actor counted {after - before} of {config.oneway} tells")
            results["oneway_per_s"].append(config.oneway / elapsed_s)
        Path(config.out_path).write_text(json.dumps(results))
        self.stop_topology("bench done")


def _percentile(sorted_values: list[float], fraction: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(fraction * (len(sorted_values) - 1))))
    return sorted_values[index]


def topology(argv: list[str]) -> Topology:
    """The benchmark's topology: driver and echo in two processes."""
    parser = argparse.ArgumentParser(prog="bus_bench")
    for field in attrs.fields(BenchConfig):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    args = parser.parse_args(argv)
    config = BenchConfig(**{field.name: getattr(args, field.name) for field in attrs.fields(BenchConfig)})
    result = Topology("bus_bench", seed=0)
    result.add("driver", BenchDriver, config, process="driver")
    result.add("echo", BenchEcho, process="echo")
    return result


def _gyre_run(config: BenchConfig, bus: str, curve_on_ipc: bool, record: bool, work_dir: Path,
              run_number: int) -> dict[str, list]:
    out_path = work_dir / f"run{run_number}.json"
    argv = [
        f"--{name.replace('_', '-')}={value}"
        for name, value in attrs.asdict(attrs.evolve(config, out_path=str(out_path))).items()
    ]
    topology_file = str(Path(__file__).resolve())
    log_path = str(work_dir / f"run{run_number}.glog") if record else None
    zmq_config = ZmqConfig(curve_on_ipc=curve_on_ipc)
    launcher = LocalProcessLauncher(topology_file, tuple(argv), bus=bus, zmq_config=zmq_config)
    result = launcher.run(topology(argv), RunOptions(log_path=log_path))
    if result.exit_code != 0 or not out_path.exists():
        raise RuntimeError(f"benchmark run failed: {result.reason} (exit {result.exit_code})")
    if log_path:
        os.unlink(log_path)
    return json.loads(out_path.read_text())


class _RayBaseline:
    """A Ray cluster on this machine with one echo actor; `measure` runs sequential `ray.get(a.m.remote(x))`.

    Kept on 127.0.0.1: by default Ray's node takes the interface's address and its servers listen on every
    interface, and `_node_ip_address="127.0.0.1"` does not help (`ray._private.services.resolve_ip_for_localhost`
    turns it back into the interface's address). With RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read once when ray is
    imported, `get_node_ip_address` answers the loopback address, on Linux too, and Ray's servers listen on 127.0.0.1
    only (checked with `ss -ltnp`, Ray 2.60). The variable stays set in this process's environment, so Ray's
    workers, which inherit it, agree; nothing else reads it."""

    def __init__(self, warmup: int) -> None:
        if "ray" not in sys.modules:
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray

        self._ray = ray
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        address = self.node_address = ray.nodes()[0]["NodeManagerAddress"]
        if address != "127.0.0.1":
            ray.shutdown()
            raise RuntimeError(f"Ray's node came up on {address}, not 127.0.0.1 (ray was imported before the bench)")

        @ray.remote
        class EchoActor:
            def m(self, x: Any) -> Any:
                return x

        self._actor = EchoActor.remote()
        for number in range(warmup):
            ray.get(self._actor.m.remote(number))

    def measure(self, calls: int, repeats: int, into: dict[str, list]) -> None:
        ray, actor = self._ray, self._actor
        for _ in range(repeats):
            latencies_s = []
            start = time.perf_counter()
            for number in range(calls):
                sent = time.perf_counter()
                ray.get(actor.m.remote(number))
                latencies_s.append(time.perf_counter() - sent)
            elapsed_s = time.perf_counter() - start
            latencies_s.sort()
            into.setdefault("roundtrip_per_s", []).append(calls / elapsed_s)
            into.setdefault("p50_ms", []).append(_percentile(latencies_s, 0.50) * 1e3)
            into.setdefault("p99_ms", []).append(_percentile(latencies_s, 0.99) * 1e3)

    def close(self) -> None:
        self._ray.shutdown()


def _raw_echo(pull_endpoint: str, push_endpoint: str, count: int) -> None:
    import msgpack
    import zmq

    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.bind(pull_endpoint)
    push = context.socket(zmq.PUSH)
    push.connect(push_endpoint)
    for _ in range(count):
        header, body = pull.recv_multipart()
        msgpack.unpackb(header)
        push.send_multipart([header, msgpack.packb(msgpack.unpackb(body))])
    context.destroy(linger=1000)


def _raw_async_echo(pull_endpoint: str, push_endpoint: str) -> None:
    import asyncio

    import msgpack
    import zmq

    async def serve() -> None:
        context = zmq.Context()
        pull = context.socket(zmq.PULL)
        pull.bind(pull_endpoint)
        push = context.socket(zmq.PUSH)
        push.connect(push_endpoint)
        done = asyncio.get_running_loop().create_future()

        def on_readable() -> None:
            while pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                header, body = pull.recv_multipart()
                if header == b"stop":
                    done.set_result(None)
                    return
                msgpack.unpackb(header)
                push.send_multipart([header, msgpack.packb(msgpack.unpackb(body))])

        asyncio.get_running_loop().add_reader(pull.getsockopt(zmq.FD), on_readable)
        asyncio.get_running_loop().call_soon(on_readable)
        await done
        context.destroy(linger=1000)

    asyncio.run(serve())


def _raw_asyncio_roundtrips(calls: int, repeats: int, warmup: int, payload_bytes: int) -> dict[str, list]:
    """The asyncio floor: round trips between two asyncio processes that answer in the socket's reader callback."""
    import asyncio

    import msgpack
    import zmq

    async def drive(there: str, back: str) -> dict[str, list]:
        loop = asyncio.get_running_loop()
        context = zmq.Context()
        pull = context.socket(zmq.PULL)
        pull.bind(back)
        push = context.socket(zmq.PUSH)
        push.connect(there)
        waiting: dict[int, asyncio.Future] = {}

        def on_readable() -> None:
            while pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                header, body = pull.recv_multipart()
                waiting.pop(msgpack.unpackb(header)[1]).set_result(msgpack.unpackb(body))

        loop.add_reader(pull.getsockopt(zmq.FD), on_readable)
        payload = bytes(payload_bytes)

        async def roundtrip(number: int) -> None:
            future = loop.create_future()
            waiting[number] = future
            push.send_multipart([msgpack.packb((1, number, "driver", "echo")), msgpack.packb([number, payload])])
            await future

        try:
            for number in range(warmup):
                await roundtrip(number)
            results: dict[str, list] = {"roundtrip_per_s": [], "p50_ms": [], "p99_ms": []}
            for _ in range(repeats):
                latencies_s = []
                start = time.perf_counter()
                for number in range(calls):
                    sent = time.perf_counter()
                    await roundtrip(number)
                    latencies_s.append(time.perf_counter() - sent)
                elapsed_s = time.perf_counter() - start
                latencies_s.sort()
                results["roundtrip_per_s"].append(calls / elapsed_s)
                results["p50_ms"].append(_percentile(latencies_s, 0.50) * 1e3)
                results["p99_ms"].append(_percentile(latencies_s, 0.99) * 1e3)
            push.send_multipart([b"stop", b""])
            return results
        finally:
            loop.remove_reader(pull.getsockopt(zmq.FD))
            context.destroy(linger=1000)

    with tempfile.TemporaryDirectory(prefix="gyre-raw-") as folder:
        there, back = f"ipc://{folder}/there", f"ipc://{folder}/back"
        echo = multiprocessing.get_context("spawn").Process(target=_raw_async_echo, args=(there, back), daemon=True)
        echo.start()
        try:
            return asyncio.run(drive(there, back))
        finally:
            echo.join(timeout=10)
            if echo.is_alive():
                echo.kill()


def _raw_zmq_roundtrips(calls: int, repeats: int, warmup: int, payload_bytes: int) -> dict[str, list]:
    """The floor: blocking pyzmq + msgpack round trips between two processes over ipc://."""
    import msgpack
    import zmq

    with tempfile.TemporaryDirectory(prefix="gyre-raw-") as folder:
        there, back = f"ipc://{folder}/there", f"ipc://{folder}/back"
        context = zmq.Context()
        pull = context.socket(zmq.PULL)
        pull.bind(back)
        echo = multiprocessing.get_context("spawn").Process(
            target=_raw_echo, args=(there, back, warmup + calls * repeats), daemon=True
        )
        echo.start()
        push = context.socket(zmq.PUSH)
        push.connect(there)
        payload = bytes(payload_bytes)

        def roundtrip(number: int) -> None:
            push.send_multipart([msgpack.packb((1, number, "driver", "echo")), msgpack.packb([number, payload])])
            msgpack.unpackb(pull.recv_multipart()[1])

        try:
            for number in range(warmup):
                roundtrip(number)
            results: dict[str, list] = {"roundtrip_per_s": [], "p50_ms": [], "p99_ms": []}
            for _ in range(repeats):
                latencies_s = []
                start = time.perf_counter()
                for number in range(calls):
                    sent = time.perf_counter()
                    roundtrip(number)
                    latencies_s.append(time.perf_counter() - sent)
                elapsed_s = time.perf_counter() - start
                latencies_s.sort()
                results["roundtrip_per_s"].append(calls / elapsed_s)
                results["p50_ms"].append(_percentile(latencies_s, 0.50) * 1e3)
                results["p99_ms"].append(_percentile(latencies_s, 0.99) * 1e3)
            return results
        finally:
            echo.join(timeout=10)
            if echo.is_alive():
                echo.kill()
            context.destroy(linger=0)


def run_bench(config: BenchConfig, runs: int, ray_calls: int, with_ray: bool = True) -> dict[str, Any]:
    """Measure and return the figures: medians over every repeat of every run.

    Each of the `runs` cycles measures Ray, every bus of BUSES and the raw pyzmq floors one after the other, so
    that a burst of load from other processes falls on all of them alike."""
    buses: dict[str, dict[str, list]] = {name: {} for name in BUSES}
    raw: dict[str, list] = {}
    raw_async: dict[str, list] = {}
    ray_results: dict[str, list] = {}
    baseline = _RayBaseline(warmup=min(200, ray_calls)) if with_ray else None
    try:
        with tempfile.TemporaryDirectory(prefix="gyre-bench-") as work:
            for run_number in range(runs):
                if baseline is not None:
                    baseline.measure(ray_calls, config.repeats, ray_results)
                for number, (name, (bus, curve_on_ipc, record)) in enumerate(BUSES.items()):
                    got = _gyre_run(config, bus, curve_on_ipc, record, Path(work), len(BUSES) * run_number + number)
                    for key, values in got.items():
                        buses[name].setdefault(key, []).extend(values)
                for floor, into in ((_raw_zmq_roundtrips, raw), (_raw_asyncio_roundtrips, raw_async)):
                    got = floor(config.roundtrips, config.repeats, config.warmup, config.payload_bytes)
                    for key, values in got.items():
                        into.setdefault(key, []).extend(values)
    finally:
        if baseline is not None:
            baseline.close()
    median = statistics.median
    figures: dict[str, Any] = {}
    for name in ("gyre", "ipc_plain", "tcp_curve"):
        measured = buses[name]
        figures[f"{name}_roundtrip_per_s"] = median(measured["roundtrip_per_s"])
        figures[f"{name}_roundtrip_p50_ms"] = median(measured["p50_ms"])
        figures[f"{name}_roundtrip_p99_ms"] = median(measured["p99_ms"])
        figures[f"{name}_oneway_per_s"] = median(measured["oneway_per_s"])
    figures["gyre_roundtrip_recorded_per_s"] = median(buses["recorded"]["roundtrip_per_s"])
    figures["gyre_oneway_recorded_per_s"] = median(buses["recorded"]["oneway_per_s"])
    figures["recording_overhead"] = 1.0 - figures["gyre_oneway_recorded_per_s"] / figures["gyre_oneway_per_s"]
    # What CURVE costs on ipc:// (the share of plain ipc's rate it takes away), round trips and one-way.
    figures["curve_cost_roundtrip"] = 1.0 - figures["gyre_roundtrip_per_s"] / figures["ipc_plain_roundtrip_per_s"]
    figures["curve_cost_oneway"] = 1.0 - figures["gyre_oneway_per_s"] / figures["ipc_plain_oneway_per_s"]
    figures["raw_zmq_roundtrip_per_s"] = median(raw["roundtrip_per_s"])
    figures["raw_zmq_roundtrip_p99_ms"] = median(raw["p99_ms"])
    figures["raw_asyncio_roundtrip_per_s"] = median(raw_async["roundtrip_per_s"])
    figures["raw_asyncio_roundtrip_p99_ms"] = median(raw_async["p99_ms"])
    if with_ray:
        figures["ray_roundtrip_per_s"] = median(ray_results["roundtrip_per_s"])
        figures["ray_roundtrip_p50_ms"] = median(ray_results["p50_ms"])
        figures["ray_roundtrip_p99_ms"] = median(ray_results["p99_ms"])
        figures["ratio"] = figures["gyre_roundtrip_per_s"] / figures["ray_roundtrip_per_s"]
        figures["ipc_plain_ratio"] = figures["ipc_plain_roundtrip_per_s"] / figures["ray_roundtrip_per_s"]
        figures["tcp_curve_ratio"] = figures["tcp_curve_roundtrip_per_s"] / figures["ray_roundtrip_per_s"]
    figures["targets_met"] = {
        "ratio_at_least_5x": figures.get("ratio", 0.0) >= TARGET_RATIO,
        "p99_at_most_1ms": figures["gyre_roundtrip_p99_ms"] <= TARGET_P99_MS,
        "recording_overhead_at_most_15pct": figures["recording_overhead"] <= TARGET_RECORDING_OVERHEAD,
        "tcp_curve_ratio_at_least_4x": figures.get("tcp_curve_ratio", 0.0) >= TARGET_TCP_CURVE_RATIO,
        "tcp_curve_p99_at_most_1ms": figures["tcp_curve_roundtrip_p99_ms"] <= TARGET_P99_MS,
    }
    figures["setup"] = {
        "runs": runs,
        "repeats_per_run": config.repeats,
        "roundtrips_per_repeat": config.roundtrips,
        "oneway_per_repeat": config.oneway,
        "payload_bytes": config.payload_bytes,
        "ray_calls_per_repeat": ray_calls if with_ray else 0,
        "ray_node_address": baseline.node_address if baseline is not None else None,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "load_average_1m": os.getloadavg()[0],
    }
    return figures


def register(subparsers: argparse._SubParsersAction) -> None:
    defaults = BenchConfig()
    parser = subparsers.add_parser("bus", help="bus round trips and throughput vs Ray actor calls")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--runs", type=int, default=3, help="cycles, each one launcher run of every bus")
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="repeats per run")
    parser.add_argument("--roundtrips", type=int, default=defaults.roundtrips, help="asks per repeat")
    parser.add_argument("--oneway", type=int, default=defaults.oneway, help="tells per repeat")
    parser.add_argument("--payload-bytes", type=int, default=defaults.payload_bytes)
    parser.add_argument("--ray-calls", type=int, default=1000, help="Ray round trips per repeat")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray baseline")
    parser.set_defaults(func=bench_command)


def bench_command(args: argparse.Namespace) -> int:
    from gyre.runtime.logs import configure_logging

    configure_logging("warning")
    config = BenchConfig(
        roundtrips=args.roundtrips, oneway=args.oneway, repeats=args.repeats, payload_bytes=args.payload_bytes
    )
    figures = run_bench(config, args.runs, args.ray_calls, with_ray=not args.no_ray)
    if args.json:
        print(json.dumps(figures, indent=None, sort_keys=True))
        return 0
    out = sys.stdout
    print("gyre bus (two processes, ZeroMQ), medians:", file=out)
    for name, label in (("gyre", "ipc + CURVE"), ("ipc_plain", "ipc, no CURVE"), ("tcp_curve", "tcp + CURVE")):
        print(f"  {label:15s}  round trips {figures[f'{name}_roundtrip_per_s']:8.0f} /s   p50 "
              f"{figures[f'{name}_roundtrip_p50_ms']:.3f} ms   p99 {figures[f'{name}_roundtrip_p99_ms']:.3f} ms   "
              f"one-way {figures[f'{name}_oneway_per_s']:8.0f} /s", file=out)
    print(f"  CURVE's cost on ipc: {figures['curve_cost_roundtrip'] * 100:.1f}% of round trips, "
          f"{figures['curve_cost_oneway'] * 100:.1f}% of one-way", file=out)
    print(f"  one-way recorded {figures['gyre_oneway_recorded_per_s']:10.0f} /s   overhead "
          f"{figures['recording_overhead'] * 100:.1f}%", file=out)
    print(f"raw pyzmq, blocking{figures['raw_zmq_roundtrip_per_s']:10.0f} /s   p99 "
          f"{figures['raw_zmq_roundtrip_p99_ms']:.3f} ms (a floor: no runtime)", file=out)
    print(f"raw pyzmq, asyncio {figures['raw_asyncio_roundtrip_per_s']:10.0f} /s   p99 "
          f"{figures['raw_asyncio_roundtrip_p99_ms']:.3f} ms (a floor: no runtime)", file=out)
    if "ray_roundtrip_per_s" in figures:
        print(f"ray actor calls    {figures['ray_roundtrip_per_s']:10.0f} /s   p50 "
              f"{figures['ray_roundtrip_p50_ms']:.3f} ms   p99 {figures['ray_roundtrip_p99_ms']:.3f} ms", file=out)
        print(f"ratio gyre/ray     {figures['ratio']:10.1f}x   (ipc plain {figures['ipc_plain_ratio']:.1f}x, "
              f"tcp + CURVE {figures['tcp_curve_ratio']:.1f}x)", file=out)
    print(f"targets met: {figures['targets_met']}", file=out)
    return 0
