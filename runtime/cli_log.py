"""`gyre log show LOG` and `gyre log stats LOG`: read an event log."""

from __future__ import annotations

import argparse
import collections
import sys

from gyre.runtime.codec import Codec
from gyre.runtime.errors import CodecError
from gyre.runtime.event_log import ReadReport, read_log


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("log", help="read an event log")
    verbs = parser.add_subparsers(dest="verb", required=True)
    show = verbs.add_parser("show", help="print records, one per line")
    show.add_argument("log")
    show.add_argument("--actor", action="append", default=[], help="only records sent or handled by this actor")
    show.add_argument("--type", dest="types", action="append", default=[], help="only this message type (suffix match)")
    show.add_argument("--limit", type=int, default=None, help="stop after this many records")
    show.set_defaults(func=show_command)
    stats = verbs.add_parser("stats", help="counts by actor and type, time span, rate")
    stats.add_argument("log")
    stats.set_defaults(func=stats_command)


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
