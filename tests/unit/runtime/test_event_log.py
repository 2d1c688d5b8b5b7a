"""The event log: records round-trip, a torn tail is skipped and reported, corruption in the middle is an error,
segments merge by time keeping each segment's order, and `gyre log show/stats` read it."""

from __future__ import annotations

import argparse
import struct
import zlib

import pytest

from gyre.messages.ping_pong import Ball, Score, ScoreAsked
from gyre.runtime import Codec, Envelope, EventLogWriter, Kind, read_log
from gyre.runtime import cli_log
from gyre.runtime.envelope import ID_STRIDE
from gyre.runtime.event_log import MAGIC, EventLogError, ReadReport, merge_segments

CODEC = Codec()


def _write(path, count: int = 5, start_s: float = 100.0, step_s: float = 0.5, sender_index: int = 1) -> list[int]:
    """A log of `count` Balls from ping to pong; returns the byte offset where each record starts."""
    writer = EventLogWriter(path)
    offsets = []
    size = len(MAGIC)
    for n in range(count):
        envelope = Envelope(sender_index * ID_STRIDE + n + 1, "ping", "pong", "", start_s + n * step_s, 0, 0, Kind.TELL)
        header, body = CODEC.encode(envelope, Ball(n, n * 2))
        offsets.append(size)
        writer.append(start_s + n * step_s, header, body)
        size += 8 + 12 + len(header) + len(body)
    writer.close()
    assert path.stat().st_size == size
    return offsets


def test_records_round_trip(tmp_path) -> None:
    path = tmp_path / "a.glog"
    _write(path, 4)
    records = list(read_log(path))
    assert [r.decode(CODEC) for r in records] == [Ball(n, n * 2) for n in range(4)]
    assert [r.handled_s for r in records] == [100.0, 100.5, 101.0, 101.5]
    assert [r.envelope.sequence for r in records] == [1, 2, 3, 4]
    assert all(r.type_name == "gyre.ping_pong.Ball" and r.version == 1 for r in records)


def test_a_torn_last_record_is_skipped_and_reported_at_every_cut(tmp_path) -> None:
    path = tmp_path / "a.glog"
    offsets = _write(path, 3)
    data = path.read_bytes()
    for cut in range(offsets[-1] + 1, len(data)):
        path.write_bytes(data[:cut])
        report = ReadReport()
        records = list(read_log(path, CODEC, report))
        assert [r.decode(CODEC).number for r in records] == [0, 1]
        assert report.torn_tail_bytes == cut - offsets[-1]


def test_a_garbled_last_record_counts_as_torn(tmp_path) -> None:
    path = tmp_path / "a.glog"
    offsets = _write(path, 3)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a write that reached the file only in part (checksum fails at the tail)
    path.write_bytes(bytes(data))
    report = ReadReport()
    assert len(list(read_log(path, CODEC, report))) == 2
    assert report.torn_tail_bytes == len(data) - offsets[-1]


def test_corruption_in_the_middle_is_an_error(tmp_path) -> None:
    path = tmp_path / "a.glog"
    offsets = _write(path, 4)
    data = bytearray(path.read_bytes())
    data[offsets[1] + 20] ^= 0x55  # a payload byte of the second record
    path.write_bytes(bytes(data))
    with pytest.raises(EventLogError, match=f"checksum mismatch in the record at byte {offsets[1]}"):
        list(read_log(path))


def test_an_absurd_record_length_in_the_middle_is_an_error(tmp_path) -> None:
    path = tmp_path / "a.glog"
    offsets = _write(path, 3)
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, offsets[1], 2**31)
    path.write_bytes(bytes(data))
    with pytest.raises(EventLogError, match="claims"):
        list(read_log(path))


def test_not_a_log(tmp_path) -> None:
    path = tmp_path / "a.glog"
    path.write_bytes(b"hello, world\n")
    with pytest.raises(EventLogError, match="bad magic"):
        list(read_log(path))
    with pytest.raises(FileNotFoundError):
        list(read_log(tmp_path / "missing.glog"))


def test_segments_merge_by_time_keeping_each_segments_order(tmp_path) -> None:
    parts = tmp_path / "run.glog.parts"
    parts.mkdir()
    _write(parts / "a.glog", 3, start_s=10.0, step_s=1.0, sender_index=1)  # 10, 11, 12
    _write(parts / "b.glog", 3, start_s=10.5, step_s=1.0, sender_index=2)  # 10.5, 11.5, 12.5
    merged = list(read_log(tmp_path / "run.glog"))  # the parts directory stands in for the unmerged log
    assert [r.handled_s for r in merged] == [10.0, 10.5, 11.0, 11.5, 12.0, 12.5]
    report = merge_segments(sorted(parts.glob("*.glog")), tmp_path / "merged.glog")
    assert report.torn_tail_bytes == 0
    again = list(read_log(tmp_path / "merged.glog"))
    assert [(r.header, r.body, r.handled_s) for r in again] == [(r.header, r.body, r.handled_s) for r in merged]


# ---- gyre log show / stats ----------------------------------------------------------------------------------------
def _cli(argv: list[str]) -> int:
    """`gyre log ...` through the subcommand's own parser (the full `gyre` would also import every plug-in)."""
    parser = argparse.ArgumentParser(prog="gyre")
    cli_log.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def conversation(tmp_path):
    """A small log: tells between ping and pong, an ask and its reply, one torn record at the end."""
    path = tmp_path / "talk.glog"
    writer = EventLogWriter(path)
    rows = [
        (Envelope(ID_STRIDE + 1, "ping", "pong", "", 1.0, 0, 0, Kind.TELL), Ball(1, 1)),
        (Envelope(2 * ID_STRIDE + 1, "pong", "ping", "", 1.1, 0, ID_STRIDE + 1, Kind.TELL), Ball(1, 2)),
        (Envelope(ID_STRIDE + 2, "ping", "pong", "", 1.2, 0, 0, Kind.ASK), ScoreAsked()),
        (Envelope(2 * ID_STRIDE + 2, "pong", "ping", "", 1.3, ID_STRIDE + 2, ID_STRIDE + 2, Kind.REPLY), Score(1)),
    ]
    for envelope, msg in rows:
        writer.append(envelope.time_s, *CODEC.encode(envelope, msg))
    writer.close()
    with open(path, "ab") as handle:
        handle.write(b"\x40\x00\x00\x00torn")
    return path


def test_log_show_prints_one_line_per_record_and_filters(conversation, capsys) -> None:
    assert _cli(["log", "show", str(conversation)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 4
    assert "TELL  ping -> pong" in lines[0] and "Ball(number=1, spin=1)" in lines[0]
    assert "REPLY pong -> ping" in lines[3] and f"corr={ID_STRIDE + 2}" in lines[3] and "Score(returned=1)" in lines[3]
    assert "torn last record of 8 bytes was skipped" in err

    assert _cli(["log", "show", str(conversation), "--type", "Ball"]) == 0
    assert [line.split(": ", 1)[1] for line in capsys.readouterr().out.splitlines()] == [
        "Ball(number=1, spin=1)", "Ball(number=1, spin=2)"
    ]
    assert _cli(["log", "show", str(conversation), "--type", "gyre.ping_pong.Score", "--actor", "pong"]) == 0
    assert capsys.readouterr().out.count("\n") == 1
    assert _cli(["log", "show", str(conversation), "--actor", "nobody"]) == 0
    assert capsys.readouterr().out == ""
    assert _cli(["log", "show", str(conversation), "--limit", "3"]) == 0
    assert capsys.readouterr().out.count("\n") == 3


def test_log_stats_counts_by_type_and_actor(conversation, capsys) -> None:
    assert _cli(["log", "stats", str(conversation)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("records: 4 ")
    assert "span: 0.300s" in out
    assert "torn tail skipped: 8 bytes" in out
    by_type = out.split("by type:")[1].split("handled by:")[0]
    assert "2  gyre.ping_pong.Ball" in by_type and "1  gyre.ping_pong.Score\n" in by_type
    handled = out.split("handled by:")[1].split("sent by:")[0]
    assert "2  pong" in handled and "2  ping" in handled


# ---- finding 7: a short payload, a zero-filled tail, a bad length in the middle ------------------------------------
def test_a_checksummed_payload_shorter_than_its_prefix_is_an_error_not_a_struct_error(tmp_path) -> None:
    path = tmp_path / "a.glog"
    _write(path, 3)
    payload = b"\x01\x02\x03\x04"  # fewer bytes than the handled-at time and header length need
    with open(path, "ab") as handle:
        handle.write(struct.pack("<II", len(payload), zlib.crc32(payload)) + payload)
    _write(tmp_path / "b.glog", 2)
    with open(path, "ab") as handle:  # valid records after it: the short one sits in the middle
        handle.write((tmp_path / "b.glog").read_bytes()[len(MAGIC):])
    with pytest.raises(EventLogError, match="at byte"):
        list(read_log(path))


def test_a_record_whose_header_length_overruns_its_payload_is_an_error(tmp_path) -> None:
    path = tmp_path / "a.glog"
    offsets = _write(path, 3)
    data = bytearray(path.read_bytes())
    length = struct.unpack_from("<I", data, offsets[2])[0]
    payload_at = offsets[2] + 8
    struct.pack_into("<I", data, payload_at + 8, length)  # header length = the whole payload: no room for it
    struct.pack_into("<I", data, offsets[2] + 4, zlib.crc32(bytes(data[payload_at : payload_at + length])))
    path.write_bytes(bytes(data))
    with pytest.raises(EventLogError, match=f"record at byte {offsets[2]} has a valid checksum but"):
        list(read_log(path))


@pytest.mark.parametrize("zeros", [1, 7, 8, 12, 64, 4096])
def test_a_zero_filled_tail_is_torn_not_a_record(tmp_path, zeros) -> None:
    """A file system that crashed after growing the file but before writing its data leaves zeros; crc32(b"") is
    0, so a zero length with a zero checksum looks like an empty record unless lengths are checked."""
    path = tmp_path / "a.glog"
    offsets = _write(path, 3)
    with open(path, "ab") as handle:
        handle.write(bytes(zeros))
    report = ReadReport()
    assert [r.decode(CODEC).number for r in read_log(path, CODEC, report)] == [0, 1, 2]
    assert report.torn_tail_bytes == zeros
    data = path.read_bytes()
    cut = offsets[2] + 15  # a record cut mid-payload, then zeros where the rest of its write should be
    path.write_bytes(data[:cut] + bytes(zeros))
    report = ReadReport()
    assert [r.decode(CODEC).number for r in read_log(path, CODEC, report)] == [0, 1]
    assert report.torn_tail_bytes == 15 + zeros


def test_a_bad_length_in_the_middle_is_an_error_not_a_torn_tail(tmp_path) -> None:
    """The finding: a length field corrupted in record 2 of 75 claimed more than the rest of the file, and the
    reader called the other 73 records a torn tail."""
    path = tmp_path / "a.glog"
    offsets = _write(path, 75)
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, offsets[2], len(data))
    path.write_bytes(bytes(data))
    with pytest.raises(EventLogError, match=f"record at byte {offsets[2]}.*valid record starts at byte {offsets[3]}"):
        list(read_log(path))
    for wrong in (0, 3, 11, 40):  # too short for a record, or a length that lands inside the next one
        struct.pack_into("<I", data, offsets[2], wrong)
        path.write_bytes(bytes(data))
        with pytest.raises(EventLogError, match=f"record at byte {offsets[2]}"):
            list(read_log(path))


def test_a_zeroed_block_in_the_middle_is_an_error(tmp_path) -> None:
    path = tmp_path / "a.glog"
    offsets = _write(path, 10)
    data = bytearray(path.read_bytes())
    data[offsets[3] : offsets[6]] = bytes(offsets[6] - offsets[3])
    path.write_bytes(bytes(data))
    with pytest.raises(EventLogError, match=f"record at byte {offsets[3]}.*valid record starts at byte {offsets[6]}"):
        list(read_log(path))


def test_a_file_cut_inside_its_magic_is_an_empty_torn_log(tmp_path) -> None:
    path = tmp_path / "a.glog"
    for cut in range(len(MAGIC)):
        path.write_bytes(MAGIC[:cut])
        report = ReadReport()
        assert list(read_log(path, CODEC, report)) == []
        assert report.torn_tail_bytes == cut


def test_log_show_and_stats_report_a_bad_log_in_one_line_with_status_1(tmp_path, capsys) -> None:
    path = tmp_path / "a.glog"
    offsets = _write(path, 75)
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, offsets[2], len(data))
    path.write_bytes(bytes(data))
    for verb in ("show", "stats"):
        assert _cli(["log", verb, str(path)]) == 1
        out, err = capsys.readouterr()
        assert out == ""
        assert err.startswith(f"gyre log: {path}: ") and f"record at byte {offsets[2]}" in err and err.count("\n") == 1
    (tmp_path / "not.glog").write_bytes(b"hello\n")
    for argv, wanted in (
        (["log", "show", str(tmp_path / "not.glog")], "bad magic"),
        (["log", "stats", str(tmp_path / "missing.glog")], "no event log at"),
        (["log", "show", str(tmp_path / "dir.glog.parts" / "x.glog")], "no event log at"),
    ):
        assert _cli(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("gyre log: ") and wanted in err and err.count("\n") == 1


def test_log_show_into_a_pipe_closed_early_ends_quietly(tmp_path) -> None:
    """The finding: `gyre log show LOG | head` ended in a BrokenPipeError traceback."""
    import subprocess
    import sys

    path = tmp_path / "long.glog"
    _write(path, 5000)  # some 500 kB of lines: far more than a pipe holds, so writes go on after `head` has left
    launcher = "import sys; from gyre.runtime.testing import gyre_cli; sys.exit(gyre_cli(sys.argv[1:]))"
    shown = subprocess.Popen(
        [sys.executable, "-c", launcher, "log", "show", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert b"Ball(number=0, spin=0)" in shown.stdout.readline()
    shown.stdout.close()  # what `head -1` does after its line
    err = shown.stderr.read().decode()
    assert shown.wait(timeout=120) == 0, err
    assert err == ""
