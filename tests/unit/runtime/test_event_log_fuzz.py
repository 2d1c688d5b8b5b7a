"""The event log reader over thousands of corrupted copies of a small real log: no traceback, no silent loss.

The oracle: reading either fails with a one-line `EventLogError`, or returns a prefix of the records written, in
order, with a torn tail that covers every byte after the last one returned and holds none of the records written
after it. A copy that a crash could have left (a prefix of the file, maybe followed by zeros) must read without an
error and give back every whole record in it.
"""

from __future__ import annotations

import argparse
import random
import zlib

import pytest

from gyre.messages.ping_pong import Ball, Score, ScoreAsked
from gyre.messages.runtime_control import ActorFailed
from gyre.runtime import Codec, Envelope, EventLogWriter, Kind, read_log
from gyre.runtime import cli_log
from gyre.runtime.envelope import ID_STRIDE
from gyre.runtime.event_log import MAGIC, EventLogError, ReadReport

CODEC = Codec()
CASES = 3000
#: One in this many cases also goes through `gyre log show` (the CLI's own parse is slower than the reader).
CLI_EVERY = 15


def _messages() -> list[tuple[Envelope, object]]:
    """Records of several sizes and kinds, so that corruption lands in lengths, headers and bodies alike."""
    rows: list[tuple[Envelope, object]] = []
    for n in range(14):
        sender, receiver = ("ping", "pong") if n % 2 == 0 else ("pong", "ping")
        kind = (Kind.TELL, Kind.ASK, Kind.REPLY, Kind.EVENT)[n % 4]
        if n % 5 == 3:
            msg: object = ActorFailed(receiver, "ValueError", "x" * (n * 7), n, "restarted")
        elif n % 4 == 1:
            msg = ScoreAsked()
        elif n % 4 == 2:
            msg = Score(n)
        else:
            msg = Ball(n, n * n)
        topic = "scores" if kind == Kind.EVENT else ""
        rows.append((Envelope(ID_STRIDE + n + 1, sender, receiver, topic, 50.0 + n / 8, 0, 0, kind), msg))
    return rows


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """(file bytes, each record's serialized bytes, each record's (handled_s, header, body))."""
    path = tmp_path_factory.mktemp("fuzz") / "real.glog"
    writer = EventLogWriter(path)
    for envelope, msg in _messages():
        writer.append(envelope.time_s, *CODEC.encode(envelope, msg))
    writer.close()
    data = path.read_bytes()
    records = [(r.handled_s, r.header, r.body) for r in read_log(path)]
    serialized, offset = [], len(MAGIC)
    for _, header, body in records:
        length = 12 + len(header) + len(body)
        serialized.append(data[offset : offset + 8 + length])
        offset += 8 + length
    assert offset == len(data) and len(records) == 14
    return data, serialized, records


def _corrupt(rng: random.Random, data: bytes, boundaries: set[int]) -> tuple[str, bytes, bool]:
    """(what was done, the corrupted bytes, whether a crash alone could have left them)."""
    size = len(data)
    body = range(len(MAGIC), size)  # the magic line has its own test; corrupting it only ever gives "bad magic"
    mode = rng.randrange(10)
    if mode == 0:
        cut = rng.randrange(len(MAGIC), size)
        return f"truncate at {cut}", data[:cut], True
    if mode == 1:
        cut, zeros = rng.randrange(len(MAGIC), size + 1), rng.choice((1, 3, 8, 20, 100, 4096))
        return f"truncate at {cut}, {zeros} zeros", data[:cut] + bytes(zeros), True
    out = bytearray(data)
    if mode == 2:
        for _ in range(rng.randint(1, 3)):
            at = rng.choice(body)
            out[at] ^= 1 << rng.randrange(8)
        return "bit flips", bytes(out), False
    if mode == 3:
        at = rng.choice(body)
        out[at] = rng.randrange(256)
        return f"byte {at} overwritten", bytes(out), bytes(out) == data
    if mode == 4:
        at = rng.choice(body)
        span = rng.randint(1, 64)
        out[at : at + span] = bytes(min(span, size - at))
        return f"zeroed {span} bytes at {at}", bytes(out), False
    if mode == 5:
        at = rng.choice(sorted(boundaries - {size}))  # a length or checksum field, where a bad value hurts most
        out[at + rng.randrange(8)] = rng.randrange(256)
        return f"record field at {at} changed", bytes(out), bytes(out) == data
    if mode == 6:
        at = rng.choice(body)
        span = rng.randint(1, 40)
        if at in boundaries and at + span in boundaries:
            span += 1  # a whole record cut out cleanly is what this format cannot see (see event_log's docstring)
        return f"deleted {span} bytes at {at}", data[:at] + data[at + span :], at + span >= size
    if mode == 7:
        at = rng.choice(body)
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 24)))
        return f"inserted {len(junk)} bytes at {at}", data[:at] + junk + data[at:], False
    if mode == 8:
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))
        return f"{len(junk)} random bytes appended", data + junk, False
    at = rng.choice(body)
    span = rng.randint(1, 80)
    out[at : at + span] = bytes(rng.randrange(256) for _ in range(min(span, size - at)))
    return f"garbled {span} bytes at {at}", bytes(out), False


def _check(case: str, data: bytes, crash_only: bool, original, path) -> str:
    """Read `data` as a log and hold the result to the oracle; returns "error", "torn" or "whole"."""
    _, serialized, written = original
    path.write_bytes(data)
    report = ReadReport()
    try:
        got = [(r.handled_s, r.header, r.body) for r in read_log(path, CODEC, report)]
    except EventLogError as error:
        message = str(error)
        assert not crash_only, f"{case}: what a crash leaves must read, got {message}"
        assert "\n" not in message and ("at byte" in message or "bad magic" in message), f"{case}: {message}"
        return "error"
    count = len(got)
    assert got == written[:count], f"{case}: the reader returned records that were not written, or out of order"
    end = len(MAGIC) + sum(len(s) for s in serialized[:count])
    assert report.torn_tail_bytes == len(data) - end, f"{case}: the torn tail does not cover the rest of the file"
    tail = data[end:]
    lost = [n for n in range(count, len(serialized)) if serialized[n] in tail]
    assert not lost, f"{case}: records {lost} are intact after the torn tail at byte {end}: a silent loss"
    if crash_only:
        whole = sum(1 for n in range(len(serialized)) if data.startswith(MAGIC + b"".join(serialized[: n + 1])))
        assert count == whole, f"{case}: {whole} whole records survive the crash, {count} came back"
    return "torn" if report.torn_tail_bytes else "whole"


def _show(path) -> int:
    parser = argparse.ArgumentParser(prog="gyre")
    cli_log.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["log", "show", str(path)])
    return args.func(args)


def test_thousands_of_corrupted_logs_read_without_a_traceback_or_a_silent_loss(original, tmp_path, capsys) -> None:
    data, serialized, _ = original
    boundaries = set()
    offset = len(MAGIC)
    for record in serialized:
        boundaries.add(offset)
        offset += len(record)
    boundaries.add(offset)
    rng = random.Random(20240611)
    path = tmp_path / "corrupt.glog"
    outcomes: dict[str, int] = {"error": 0, "torn": 0, "whole": 0}
    for number in range(CASES):
        case, corrupted, crash_only = _corrupt(rng, data, boundaries)
        case = f"case {number} ({case}, crc {zlib.crc32(corrupted):08x})"
        outcomes[_check(case, corrupted, crash_only, original, path)] += 1
        if number % CLI_EVERY == 0:
            status = _show(path)
            out, err = capsys.readouterr()
            assert status in (0, 1), case
            if status == 1:
                assert err.startswith("gyre log: ") and err.count("\n") == 1 and out == "", f"{case}: {err!r}"
    # the corruptions reach both ways a damaged log reads, so the oracle was exercised on each
    assert outcomes["error"] > CASES // 10 and outcomes["torn"] > CASES // 10, outcomes
