"""`gyre log show LOG` and `gyre log stats LOG`: read an event log.

Exit status: 0 when the log was read (a torn tail is reported on stderr and is no failure: a crash leaves one); 1
with one line on stderr when it cannot be (missing, not a log, corrupt in its middle: the line names the byte).
Output cut short by its reader (`gyre log show LOG | head`) ends the command quietly with status 0.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
from typing import Callable

from gyre.runtime.codec import Codec
from gyre.runtime.errors import CodecError
from gyre.runtime.event_log import EventLogError, ReadReport, read_log


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("log", help="read an event log")
    verbs = parser.add_subparsers(dest="verb", required=True)
    show = verbs.add_parser("show", help="print records, one per line")
    show.add_argument("log")
    show.add_argument("--actor", action="append", default=[], help="only records sent or handled by this actor")
    show.add_argument("--type", dest="types", action="append", default=[], help="only this message type (suffix match)")
    show.add_argument("--limit", type=int, default=None, help="stop after this many records")
    show.set_defaults(func=_reading(show_command))
    stats = verbs.add_parser("stats", help="counts by actor and type, time span, rate")
    stats.add_argument("log")
    stats.set_defaults(func=_reading(stats_command))


def _reading(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`command` with the log's errors as one line and exit status 1, and a closed pipe as a quiet end."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            status = command(args)
            sys.stdout.flush()  # here, not at exit, so that a reader gone by now is caught below
            return status
        except BrokenPipeError:
            _silence_stdout()
            return 0
        except (EventLogError, OSError) as error:
            plain = isinstance(error, EventLogError) or not error.strerror
            print(f"gyre log: {error if plain else f'{error.strerror}: {error.filename}'}", file=sys.stderr)
            return 1

    return run


def _silence_stdout() -> None:
    """Point stdout at /dev/null: the reader is gone, and Python's flush at exit would raise BrokenPipeError again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stdout (tests) has no descriptor to redirect
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _matches(record, actors: list[str], types: list[str]) -> bool:
    envelope = record.envelope
    if actors and envelope.sender not in actors and envelope.receiver not in actors:
        return False
    if types and not any(record.type_name == t or record.type_name.endswith("." + t) for t in types):
        return False
    return True


def show_command(args: argparse.Namespace) -> int:
    codec = Codec()
    report = ReadReport()
    shown = 0
    start = None
    for record in read_log(args.log, codec, report):
        if not _matches(record, args.actor, args.types):
            continue
        if args.limit is not None and shown >= args.limit:
            break
        start = record.handled_s if start is None else start
        envelope = record.envelope
        try:
            body = repr(record.decode(codec))
        except CodecError as error:
            body = f"<undecodable: {error}>"
        target = envelope.receiver + (f" (event {envelope.topic})" if envelope.topic else "")
        extra = f" corr={envelope.correlation_id}" if envelope.correlation_id else ""
        print(
            f"{record.handled_s - start:10.6f}s #{envelope.sequence:<6d} {envelope.kind.name:<5} "
            f"{envelope.sender} -> {target}{extra} cause={envelope.causation_id}: {body}"
        )
        shown += 1
    if report.torn_tail_bytes:
        print(f"(a torn last record of {report.torn_tail_bytes} bytes was skipped)", file=sys.stderr)
    return 0


def stats_command(args: argparse.Namespace) -> int:
    report = ReadReport()
    by_type: collections.Counter[str] = collections.Counter()
    by_receiver: collections.Counter[str] = collections.Counter()
    by_sender: collections.Counter[str] = collections.Counter()
    first = last = None
    total = 0
    size = 0
    for record in read_log(args.log, None, report):
        total += 1
        size += len(record.header) + len(record.body)
        by_type[record.type_name] += 1
        by_receiver[record.envelope.receiver] += 1
        by_sender[record.envelope.sender] += 1
        first = record.handled_s if first is None else min(first, record.handled_s)
        last = record.handled_s if last is None else max(last, record.handled_s)
    span = (last - first) if total else 0.0
    print(f"records: {total}  bytes: {size}  span: {span:.3f}s  rate: {total / span if span else 0:.1f}/s")
    if report.torn_tail_bytes:
        print(f"torn tail skipped: {report.torn_tail_bytes} bytes")
    for title, counter in (("by type", by_type), ("handled by", by_receiver), ("sent by", by_sender)):
        print(f"{title}:")
        for name, count in counter.most_common():
            print(f"  {count:8d}  {name}")
    return 0
