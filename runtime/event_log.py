"""The append-only event log: every delivered message with its envelope, in the order its receiver handled it.

File layout: the magic line `GYRELOG1\\n`, then records. A record is `<u32 payload length><u32 crc32 of payload>`
followed by the payload, which is `<f64 handled-at seconds><u32 header length>` + the wire header + the wire body (the
same bytes the bus carried, so recording costs a buffered write and no re-encoding). The handled-at time is the
receiver's clock when its handler took the message: replay sets the clock to it.

Reading rule (how a torn tail differs from corruption). A record is valid when its length is at least the 12-byte
prefix and at most `MAX_RECORD_BYTES`, the payload fits in the file, its crc32 matches, and its header length and
header fit the payload. The writer only appends, so a crash can leave only a prefix of the record stream,
possibly followed by zeros (a file system that grew the file but never wrote the data; a zero length with a zero
checksum is not an empty record, since crc32(b"") is 0 and no writer makes a payload under 12 bytes). So at the
first offset where no valid record starts, the reader looks for a valid record at every later byte: if one is
found, the log is corrupt in its middle and reading fails with `EventLogError` naming both offsets (never a
silent loss of the records after it); if none is, the bytes from there to the end are a torn tail, skipped and
counted in `ReadReport.torn_tail_bytes`. A record whose checksum matches but whose layout or header does not fit
is corruption wherever it sits (a crash cannot make a matching checksum). A file cut inside its magic line is an
empty log with a torn tail. What this format cannot see: a whole record cut out cleanly at record boundaries
(records carry no sequence number); file systems lose tails and zero or garble blocks, they do not do that.
The rule needs no format change, so every GYRELOG1 file ever written reads as before.

In a multi-process run each process writes its own segment (`LOG.parts/NODE.glog`); the launcher merges them into
LOG by time at the end, keeping every segment's own order (replay depends on each receiver's order, which a
segment holds exactly).
"""

from __future__ import annotations

import heapq
import os
import re
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
_LENGTH = struct.Struct("<I")
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
    """Bytes at the end, summed over segments, where no valid record starts, neither there nor later (a crash
    mid-write, or the zeros a file system leaves after one); they were skipped."""


def _read_segment(path: Path, codec: Codec, report: ReadReport) -> Iterator[LogRecord]:
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except IsADirectoryError as error:
        raise EventLogError(f"{path} is a directory, not an event log segment") from error
    except OSError as error:
        raise EventLogError(f"cannot read {path}: {error.strerror or error}") from error
    if not data.startswith(MAGIC):
        if MAGIC.startswith(data):  # the writer died before its magic line reached the file: a log of no records
            report.torn_tail_bytes += len(data)
            return
        raise EventLogError(f"{path} is not a Gyre event log (bad magic)")
    offset = len(MAGIC)
    end = len(data)
    while offset < end:
        parsed = _parse_record(data, offset, end, codec)
        if isinstance(parsed, str):
            later = _next_valid_record(data, offset + 1, end, codec)
            if later is None:
                report.torn_tail_bytes += end - offset
                return
            raise EventLogError(
                f"{path}: {parsed} in the record at byte {offset}, but a valid record starts at byte {later}: the log "
                f"is corrupt in its middle, not torn at its end"
            )
        record, after = parsed
        if isinstance(record, str):
            raise EventLogError(f"{path}: record at byte {offset} has a valid checksum but {record}")
        yield record
        offset = after


def _parse_record(data: bytes, offset: int, end: int, codec: Codec) -> str | tuple[LogRecord | str, int]:
    """The record at `offset` and the offset after it; a str where no valid record starts (why not); a (str,
    offset) pair for a record whose checksum matches but whose insides do not fit (never a crash's doing)."""
    if end - offset < _RECORD.size:
        return f"{end - offset} bytes, too few for a record's length and checksum,"
    length, crc = _RECORD.unpack_from(data, offset)
    start = offset + _RECORD.size
    if length < _PREFIX.size or length > MAX_RECORD_BYTES:
        return f"the length field claims {length} bytes (a record holds {_PREFIX.size} to {MAX_RECORD_BYTES})"
    if start + length > end:
        return f"the length field claims {length} bytes, past the end of the file,"
    after = start + length
    if zlib.crc32(data[start:after]) != crc:
        return "checksum mismatch"
    handled_s, header_len = _PREFIX.unpack_from(data, start)
    if header_len > length - _PREFIX.size:
        return f"a header length of {header_len} bytes in a payload of {length}", after
    header_end = start + _PREFIX.size + header_len
    header = data[start + _PREFIX.size : header_end]
    try:
        envelope, type_name, version = codec.decode_header(header)
    except CodecError as error:
        return f"a bad header: {error}", after
    return LogRecord(envelope, handled_s, type_name, version, header, data[header_end:after]), after


#: A byte that is not zero: the scan for a later record skips runs of zeros (a zero-filled tail) in one step.
_NONZERO = re.compile(rb"[^\x00]")


def _next_valid_record(data: bytes, offset: int, end: int, codec: Codec) -> int | None:
    """The first offset at or after `offset` where a whole valid record starts, None if there is none. Costs a few
    operations per byte of the rest of the file (a MiB of random bytes: about 0.25 s), paid only where reading
    stopped early; a checksum is computed only where a length fits, so random bytes rarely cost one."""
    unpack_length = _LENGTH.unpack_from
    smallest = _PREFIX.size
    while end - offset >= _RECORD.size + smallest:
        (length,) = unpack_length(data, offset)
        if length == 0:
            found = _NONZERO.search(data, offset)
            if found is None:
                return None
            # a length's low bytes may be zero, so a record can start up to 3 bytes before the next non-zero byte
            offset = max(offset + 1, found.start() - 3)
            continue
        if length < smallest or offset + _RECORD.size + length > end:  # the cheap test first: most bytes fail it
            offset += 1
            continue
        parsed = _parse_record(data, offset, end, codec)
        if not isinstance(parsed, str) and not isinstance(parsed[0], str):
            return offset
        offset += 1
    return None


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
