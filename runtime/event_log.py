"""The append-only event log: every delivered message with its envelope, in the order its receiver handled it.

File layout: the magic line `GYRELOG1\\n`, then records. A record is `<u32 payload length><u32 crc32 of payload>`
followed by the payload, which is `<f64 handled-at seconds><u32 header length>` + the wire header + the wire body (the
same bytes the bus carried, so recording costs a buffered write and no re-encoding). The handled-at time is the
receiver's clock when its handler took the message: replay sets the clock to it. A process killed mid-write leaves a torn last
record: the reader detects it (short read or bad checksum at the tail), skips it, and says so.

In a multi-process run each process writes its own segment (`LOG.parts/NODE.glog`); the launcher merges them into
LOG by time at the end, keeping every segment's own order (replay depends on each receiver's order, which a
segment holds exactly).
"""

from __future__ import annotations

import heapq
import os
import struct
import zlib
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

import attrs

from gyre.runtime.codec import Codec
from gyre.runtime.envelope import Envelope
from gyre.runtime.errors import CodecError, GyreError

MAGIC = b"GYRELOG1\n"
_RECORD = struct.Struct("<II")
_PREFIX = struct.Struct("<dI")
#: A record larger than this is taken as corruption, not data (large payloads never travel on the bus).
MAX_RECORD_BYTES = 256 * 1024 * 1024


class EventLogError(GyreError):
    """The file is not an event log, or a record in its middle is corrupt."""


@attrs.frozen(slots=True)
class LogRecord:
    """One delivered message as logged."""

    envelope: Envelope
    """The message's envelope (receiver = the actor that handled it)."""
    handled_s: float
    """Receiver's runtime-clock time when its handler took the message."""
    type_name: str
    """Wire name of the message type."""
    version: int
    """Schema version of the message type."""
    header: bytes
    """The wire header exactly as carried."""
    body: bytes
    """The wire body exactly as carried."""

    def decode(self, codec: Codec):
        return codec.decode_body(self.type_name, self.version, self.body)


class EventLogWriter:
    """Appends records to a buffer of its own; past `buffer_bytes`, and on `flush()` (the launcher calls it twice a
    second) and `close()`, the buffer goes to the OS in one write. Recording sits on the path of every message, so
    a record costs a few appends to a bytearray, one checksum and no system call."""

    def __init__(self, path: str | os.PathLike, buffer_bytes: int = 1 << 20) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: BinaryIO = open(self.path, "wb", buffering=0)
        self._file.write(MAGIC)
        self._buffer = bytearray()
        self._limit = buffer_bytes
        self.records_written = 0

    def append(self, handled_s: float, header: bytes, body: bytes) -> None:
        payload = _PREFIX.pack(handled_s, len(header)) + header + body
        buffer = self._buffer
        buffer += _RECORD.pack(len(payload), zlib.crc32(payload))
        buffer += payload
        self.records_written += 1
        if len(buffer) >= self._limit:
            self.flush()

    def flush(self) -> None:
        if self._buffer and not self._file.closed:
            view = memoryview(self._buffer)
            while view:  # an unbuffered file may take part of a large write
                view = view[self._file.write(view) :]
            view.release()
            self._buffer.clear()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            os.fsync(self._file.fileno())
            self._file.close()


@attrs.define
class ReadReport:
    """What reading a log found besides its records."""

    torn_tail_bytes: int = 0
    """Bytes at the end that did not form a whole, valid record (a crash mid-write); they were skipped."""


def _read_segment(path: Path, codec: Codec, report: ReadReport) -> Iterator[LogRecord]:
    with open(path, "rb") as handle:
        data = handle.read()
    if not data.startswith(MAGIC):
        raise EventLogError(f"{path} is not a Gyre event log (bad magic)")
    offset = len(MAGIC)
    end = len(data)
    while offset < end:
        if end - offset < _RECORD.size:
            report.torn_tail_bytes += end - offset
            return
        length, crc = _RECORD.unpack_from(data, offset)
        start = offset + _RECORD.size
        if length > MAX_RECORD_BYTES:  # no writer makes such a record: corruption, not a crash mid-write
            raise EventLogError(f"{path}: record at byte {offset} claims {length} bytes")
        if start + length > end:  # the writer died before the whole payload reached the file
            report.torn_tail_bytes += end - offset
            return
        payload = data[start : start + length]
        if zlib.crc32(payload) != crc:
            if start + length == end:
                report.torn_tail_bytes += end - offset
                return
            raise EventLogError(f"{path}: checksum mismatch in the record at byte {offset}")
        handled_s, header_len = _PREFIX.unpack_from(payload, 0)
        header = payload[_PREFIX.size : _PREFIX.size + header_len]
        body = payload[_PREFIX.size + header_len :]
        try:
            envelope, type_name, version = codec.decode_header(header)
        except CodecError as error:
            raise EventLogError(f"{path}: record at byte {offset} has a bad header: {error}") from error
        yield LogRecord(envelope, handled_s, type_name, version, header, body)
        offset = start + length


def segment_paths(path: str | os.PathLike) -> list[Path]:
    """The files that make up a log: the file itself, or the segments of a `.parts` directory."""
    path = Path(path)
    if path.is_dir():
        return sorted(path.glob("*.glog"))
    if path.exists():
        return [path]
    parts = Path(str(path) + ".parts")
    if parts.is_dir():
        return sorted(parts.glob("*.glog"))
    raise FileNotFoundError(f"no event log at {path}")


def read_log(path: str | os.PathLike, codec: Codec | None = None, report: ReadReport | None = None) -> Iterator[LogRecord]:
    """Every record of a log (or of its segments, merged by time, each segment's own order kept)."""
    codec = codec or Codec()
    report = report if report is not None else ReadReport()
    segments = [list(_read_segment(p, codec, report)) for p in segment_paths(path)]
    if len(segments) == 1:
        yield from segments[0]
        return
    yield from heapq.merge(*segments, key=lambda record: record.handled_s)


def merge_segments(segments: Iterable[Path], into: Path, codec: Codec | None = None) -> ReadReport:
    """Write one log holding every record of `segments`, merged by time; returns what reading them found."""
    codec = codec or Codec()
    report = ReadReport()
    lists = [list(_read_segment(p, codec, report)) for p in segments]
    writer = EventLogWriter(into)
    try:
        for record in heapq.merge(*lists, key=lambda r: r.handled_s):
            writer.append(record.handled_s, record.header, record.body)
    finally:
        writer.close()
    return report
