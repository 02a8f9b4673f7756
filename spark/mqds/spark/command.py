"""``mqds spark-job``: per-topic and per-sender statistics of a time window, computed with Spark, in Parquet.

The job itself is :mod:`mqds.spark.job`; it needs pyspark and pyarrow, which
this module imports only when the command runs, so ``mqds --help`` and the
rest of the command line work without them.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mqds.cli.console import EXIT_OK, EXIT_USAGE, TIME_HELP, CommandError, connection, parse_time, table
from mqds.client.connection import parse_endpoints
from mqds.protocol.topics import TopicError, validate_filter
from mqds.spark.options import format_time_us

if TYPE_CHECKING:
    from mqds.spark import job

DESCRIPTION = """\
Read the messages stored in a time window through the Spark connector (format "mqds") and write
two Parquet tables partitioned by date (UTC) under --out:

  OUT/topics    per (date, topic):  messages, bytes (payload), first_timestamp, last_timestamp,
                qos0, qos1, qos2 (the QoS mix), retained, senders (distinct)
  OUT/senders   per (date, sender): the same, with topics (distinct) instead of senders

The job pins a snapshot of the cluster first (one read fence per vnode), so both tables count the
same messages while publishers keep writing; the token is saved as OUT/_mqds_snapshot.json and
--snapshot with it recomputes exactly the same figures. Running the job again over a date replaces
that date's partitions (the others stay): run it over whole days for complete daily figures.
At the end it prints what it read and wrote and the top rows of both tables.

Without spark-submit it runs Spark in this process (--master, default local[*]); with
'spark-submit .../mqds/spark/command.py ARGS' (or 'python -m mqds.spark.command ARGS') it takes the
cluster spark-submit gives it. Needs pyspark and pyarrow: pip install 'mqds-spark[cli]'.
"""


def run(opts: argparse.Namespace) -> int:
    now_s = time.time()
    try:
        since_us = parse_time(opts.since, now_s)
        until_us = parse_time(opts.until, now_s)
    except ValueError as err:
        raise CommandError(str(err), EXIT_USAGE) from None
    if until_us <= since_us:
        raise CommandError("--until must be after --since: the window is [since, until)", EXIT_USAGE)
    try:
        validate_filter(opts.topic_filter)
    except TopicError as err:
        raise CommandError(f"--topic-filter: {err}", EXIT_USAGE) from None
    if opts.top < 1 or (opts.max_records_per_partition is not None and opts.max_records_per_partition < 1):
        raise CommandError("--top and --max-records-per-partition must be at least 1", EXIT_USAGE)
    endpoints = parse_endpoints(opts.endpoints)
    settings = connection(opts, 30.0)
    try:
        from mqds.spark import job
    except ImportError as err:
        # mqds.spark's own message says what to install; anything else gets the hint here.
        hint = (
            str(err)
            if "pip install" in str(err)
            else f"needs pyspark and pyarrow: pip install 'mqds-spark[cli]' ({err})"
        )
        raise CommandError(hint) from None
    snapshot = _snapshot(opts.snapshot)
    extra = {}
    if opts.max_records_per_partition:
        extra["maxRecordsPerPartition"] = str(opts.max_records_per_partition)
    print(
        f"mqds spark-job: starting Spark ({opts.master or 'local[*]'}) to read {opts.topic_filter!r} from "
        f"{len(endpoints)} node(s) ...",
        flush=True,
    )
    from pyspark.sql import SparkSession

    # Inside a program that already runs Spark, use its session and leave it running.
    ours = SparkSession.getActiveSession() is None
    spark = job.session(opts.master)
    try:
        result = job.run_job(
            spark,
            endpoints,
            Path(opts.out),
            since_us,
            until_us,
            topic_filter=opts.topic_filter,
            snapshot=snapshot,
            settings=settings,
            extra_options=extra,
            top=opts.top,
        )
    finally:
        if ours:
            spark.stop()
    print(summary(result, opts.topic_filter, since_us, until_us), flush=True)
    return EXIT_OK


def _snapshot(value: str | None) -> str | None:
    """--snapshot: the token's JSON text, or a file holding it (as the job saves it)."""
    if value is None:
        return None
    text = value.strip()
    if not text.startswith("{"):
        try:
            text = Path(value).read_text().strip()
        except OSError as err:
            raise CommandError(f"--snapshot: {err.strerror or err}: {value}", EXIT_USAGE) from None
    from mqds.spark.snapshot import Snapshot

    try:
        Snapshot.from_token(text)
    except ValueError as err:
        raise CommandError(f"--snapshot: {err}", EXIT_USAGE) from None
    return text


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], connection: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "spark-job",
        parents=[connection],
        help="per-topic and per-sender statistics of a time window, with Spark, to Parquet",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--since",
        default="1d",
        metavar="TIME",
        help=f"start of the window, included (default 1d: a day ago); {TIME_HELP}",
    )
    parser.add_argument("--until", default="now", metavar="TIME", help="end of the window, excluded (default now)")
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="where to write topics/, senders/ and _mqds_snapshot.json"
    )
    parser.add_argument(
        "--topic-filter", default="#", metavar="FILTER", help="only messages matching this MQTT filter (default '#')"
    )
    parser.add_argument(
        "--snapshot",
        metavar="TOKEN|FILE",
        help="read this snapshot (a token from mqds.spark.pin_snapshot, or the _mqds_snapshot.json of an earlier "
        "run) instead of pinning a new one",
    )
    parser.add_argument(
        "--master",
        metavar="URL",
        help="Spark master (default local[*], or what spark-submit gives); e.g. local[2], spark://host:7077",
    )
    parser.add_argument("--top", type=int, default=10, metavar="N", help="top rows of each table to print (default 10)")
    parser.add_argument(
        "--max-records-per-partition",
        type=int,
        metavar="N",
        help="the source's maxRecordsPerPartition: cut a vnode's generation into Spark partitions of about N "
        "messages (default 500,000)",
    )
    parser.set_defaults(run=run)


def _cells(row: tuple[object, ...]) -> list[str]:
    """A top row for printing: counts with thousands separators, timestamps (microseconds) as UTC times."""
    from mqds.spark import job

    out = []
    for column, value in zip(job.TOP_COLUMNS, row, strict=True):
        if column.endswith("_timestamp") and isinstance(value, int):
            out.append(format_time_us(value)[:-4] + "Z")  # to the millisecond
        elif isinstance(value, int):
            out.append(f"{value:,}")
        else:
            out.append(str(value))
    return out


def summary(result: job.JobResult, topic_filter: str, since_us: int, until_us: int) -> str:
    """The job's report for people: what it read, what it wrote where, and the top rows."""
    from mqds.spark import job

    lines = [
        f"read {result.messages:,} messages matching {topic_filter!r} stored in "
        f"[{format_time_us(since_us)}, {format_time_us(until_us)}) from {result.vnodes} vnodes "
        f"in {result.seconds:.1f} s (snapshot pinned at {format_time_us(result.pinned_at_us)})",
    ]
    if not result.messages:
        lines.append("no messages in the window: nothing written")
        return "\n".join(lines)
    dates = ", ".join(result.dates) if len(result.dates) <= 3 else f"{result.dates[0]} .. {result.dates[-1]}"
    lines.append(
        f"wrote {result.out_dir / 'topics'} ({result.topic_rows:,} rows) and {result.out_dir / 'senders'} "
        f"({result.sender_rows:,} rows): Parquet, partitioned by date ({dates})"
    )
    lines.append(f"snapshot token: {result.snapshot_path} (--snapshot with it reads exactly the same messages)")
    numeric = (2, 3, 4, 5, 6)
    for title, key, rows in (("topics", "topic", result.top_topics), ("senders", "sender", result.top_senders)):
        headers = [c.format(key=key).upper().replace("_TIMESTAMP", "") for c in job.TOP_COLUMNS]
        lines.append(f"\ntop {len(rows)} {title} by messages:")
        lines.append(table(headers, [_cells(row) for row in rows], right=numeric))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mqds.spark.command ARGS`` and ``spark-submit command.py ARGS``: ``mqds spark-job ARGS``."""
    from mqds.cli import main as cli_main

    return cli_main(["spark-job", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
