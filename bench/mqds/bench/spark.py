"""Benchmark: read stored messages into Spark, next to replaying them with the client in one process.

``python -m mqds.bench.spark`` (``make bench-spark``) starts a local 3-node
cluster in a temporary directory (or uses ``--endpoints``), stores
``--messages`` (default 1,000,000) messages under a topic prefix of its own,
then in the same run:

- Spark (``--master``, default ``local[*]``): ``df.count()`` ``--counts``
  times (the first apart: it starts Python workers and has the JVM compile
  its Arrow paths; then the best of the others), the same count of a
  DataFrame loaded with a schema of two columns (:data:`FEW_COLUMNS`: Spark
  prunes no columns for a Python source, so that is how a query reads only
  what it uses; best of all but its first), and a group-by per sender
  (count, payload bytes, first and last timestamp), each timed, after a
  warm-up read of 20,000 other messages;
- ``Client.replay_batches`` (the baseline) and ``Client.replay`` (a
  ``Message`` object each) of the same filter in this one process, counted;
- a streaming micro-batch's fixed cost (``--stream-seconds``): the median
  micro-batch of a stream of a few new messages at a time, next to Spark's
  own ``rate`` source in the same session (``mqds.bench.spark_stream``).

It prints rows/s of each, the CPU every process of the machine spent per
1,000 rows (nodes, JVM, Python workers: Linux only), and the ratio Spark /
replay in batches. Both read every
message from the nodes and decode it; Spark spreads the vnodes over its
tasks, replay goes vnode by vnode. On a small machine the nodes, the Spark
workers and the replaying process share the same cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pyspark.sql import functions as F

from mqds.bench.spark_stream import micro_batch_s, rate_source_micro_batch_s
from mqds.cli.console import ProgressLine, bar, table
from mqds.client import Client, Message
from mqds.client.connection import parse_endpoints
from mqds.spark import FORMAT, register
from mqds.spark.job import session
from mqds.spark.snapshot import pin_snapshot

# Read first, apart from the measured ones (see measure()).
WARMUP_MESSAGES = 20_000
FEW_COLUMNS = "shard int, timestamp timestamp"
"""The schema of the count that reads two columns."""


@dataclass(frozen=True)
class Figure:
    """One measured read: what, how many rows, how long."""

    what: str
    rows: int
    seconds: float
    cpu_s: float | None = None  # every process of the machine, while it ran (None: not Linux)

    @property
    def cpu_ms_per_1000(self) -> float | None:
        return None if self.cpu_s is None or not self.rows else self.cpu_s / self.rows * 1e6

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


def store(
    endpoints: list[str], prefix: str, messages: int, senders: int, size: int, batch: int, threads: int, topics: int
) -> float:
    """Store ``messages`` messages under ``prefix`` as fast as acknowledged; the seconds it took.

    Topics are ``<prefix>/<sender>/m<n>``, ``topics`` of them per sender, as
    ``mqds bench`` writes ``bench/<clientid>/<n>``: a vnode learns a wildcard
    for a level once it has seen 10 values there, so with 100 (the default) a
    sender's first ten topics get streams of their own and the rest share one;
    with 10 or fewer every topic is a stream.
    """
    payload = bytes(range(256)) * (size // 256 + 1)
    payload = payload[:size]
    names = [f"spark-bench-{i}" for i in range(senders)]
    done = 0
    lock = threading.Lock()
    line = ProgressLine(sys.stderr, every_s=5.0)

    def batches() -> Iterator[list[Message]]:
        for start in range(0, messages, batch):
            sender = names[(start // batch) % senders]
            count = min(batch, messages - start)
            yield [Message(f"{prefix}/{sender}/m{(start + i) % topics}", payload, sender, qos=1) for i in range(count)]

    started = time.monotonic()
    with Client(endpoints, timeout_s=60) as client:

        def send(part: list[Message]) -> None:
            nonlocal done
            client.store_batch(part)
            with lock:
                done += len(part)
                rate = done / max(time.monotonic() - started, 1e-3)
                line.show(f"storing {bar(done / messages)} {done:>9,}/{messages:,}  {rate:>8,.0f} msg/s")

        with ThreadPoolExecutor(threads) as pool:
            for _ in pool.map(send, batches()):
                pass
    took = time.monotonic() - started
    line.show(f"stored {messages:,} messages in {took:.1f} s ({messages / took:,.0f} msg/s)", final=True)
    return took


@dataclass
class StreamFigures:
    """A streaming micro-batch's fixed cost: the mqds source's and Spark's rate source's, in seconds."""

    mqds_s: float
    rate_s: float
    batches: int


def machine_cpu_s() -> float | None:
    """CPU seconds every process of the machine has used since boot (``/proc/stat``; None where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal: all but idle and iowait are work.
    ticks = [int(x) for x in fields[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def timed(what: str, read: Callable[[], int]) -> Figure:
    """Run ``read`` (it returns the rows it read) and measure it: wall time and the machine's CPU."""
    cpu0, t0 = machine_cpu_s(), time.monotonic()
    rows = read()
    seconds, cpu1 = time.monotonic() - t0, machine_cpu_s()
    return Figure(what, rows, seconds, None if cpu0 is None or cpu1 is None else cpu1 - cpu0)


def measure(
    endpoints: list[str], prefix: str, master: str | None, stream_s: float, counts: int
) -> tuple[list[Figure], Figure, float, int, StreamFigures | None]:
    """The timed reads; also the warm-up read, the Spark start-up time, the number of Spark partitions and
    the micro-batch figures (None with ``stream_s`` 0)."""
    endpoint_text = ",".join(endpoints)
    topic_filter = f"{prefix}/data/#"
    started = time.monotonic()
    spark = session(master, "mqds-spark-bench")
    startup_s = time.monotonic() - started
    try:
        register(spark)
        # Pinned: both Spark reads see the same rows even if something else writes meanwhile.
        token = pin_snapshot(endpoint_text)
        df = (
            spark.read.format(FORMAT)
            .option("endpoints", endpoint_text)
            .option("topicFilter", topic_filter)
            .option("snapshot", token)
            .load()
        )
        # Warm up on other messages: the first read of a session starts the Python workers (imports of
        # pyarrow, grpc, mqds) and has the JVM compile the Arrow paths; that is not the source's speed.
        warm_started = time.monotonic()
        warm_rows = (
            spark.read.format(FORMAT)
            .option("endpoints", endpoint_text)
            .option("topicFilter", f"{prefix}/warmup/#")
            .load()
            .count()
        )
        warmup = Figure("warm-up read (not counted)", warm_rows, time.monotonic() - warm_started)
        cores = spark.sparkContext.defaultParallelism
        figures = [timed(f"Spark df.count() ({cores} cores), first", df.count)]
        again = [timed(f"Spark df.count() ({cores} cores), again", df.count) for _ in range(counts - 1)]
        if again:
            figures.append(min(again, key=lambda f: f.seconds))
        partitions = df.rdd.getNumPartitions()
        # Spark prunes no columns for a Python source; a schema of fewer columns does it by hand.
        narrow = (
            spark.read.format(FORMAT)
            .schema(FEW_COLUMNS)
            .option("endpoints", endpoint_text)
            .option("topicFilter", topic_filter)
            .option("snapshot", token)
            .load()
        )
        few = [timed(f"Spark count(), .schema({FEW_COLUMNS!r})", narrow.count) for _ in range(max(2, counts))]
        figures.append(min(few[1:], key=lambda f: f.seconds))  # the first has the JVM compile its paths

        def group_by_sender() -> int:
            grouped = (
                df.groupBy("sender")
                .agg(
                    F.count(F.lit(1)).alias("messages"),
                    F.sum(F.length("payload")).alias("bytes"),
                    F.min("timestamp").alias("first"),
                    F.max("timestamp").alias("last"),
                )
                .collect()
            )
            return sum(int(r["messages"]) for r in grouped)

        figures.append(timed("Spark group-by sender", group_by_sender))
        streaming = None
        if stream_s > 0:
            print(f"timing streaming micro-batches for {2 * stream_s:.0f} s ...", flush=True)
            mqds_s, batches = micro_batch_s(spark, endpoints, f"{prefix}/stream", stream_s)
            rate_s, _ = rate_source_micro_batch_s(spark, stream_s)
            streaming = StreamFigures(mqds_s, rate_s, batches)
    finally:
        spark.stop()
    with Client(endpoints, timeout_s=60) as client:
        figures.append(
            timed("Client.replay (objects), one process", lambda: sum(1 for _ in client.replay(topic_filter)))
        )
        figures.append(
            timed("Client.replay_batches, one process", lambda: sum(map(len, client.replay_batches(topic_filter))))
        )
    return figures, warmup, startup_s, partitions, streaming


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mqds.bench.spark", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=1_000_000, help="messages to store and read (1,000,000)")
    parser.add_argument("--size", type=int, default=100, help="payload bytes (100)")
    parser.add_argument("--senders", type=int, default=64, help="distinct senders (clientids), spread over vnodes (64)")
    parser.add_argument(
        "--topics-per-sender",
        type=int,
        default=100,
        help="distinct topics per sender, <prefix>/<sender>/m<n> (100, as mqds bench writes them: a vnode gives the "
        "first ten topics of a sender streams of their own and the rest one shared stream; 10 or fewer make a stream "
        "per topic, and more calls)",
    )
    parser.add_argument("--batch", type=int, default=1000, help="messages per store call (1000)")
    parser.add_argument("--threads", type=int, default=8, help="store calls in flight (8)")
    parser.add_argument(
        "--endpoints", help="an existing cluster (host:port,...) instead of a local 3-node one in a temporary directory"
    )
    parser.add_argument("--shards", type=int, default=16, help="vnodes of the local cluster (16)")
    parser.add_argument("--master", help="Spark master (default local[*])")
    parser.add_argument(
        "--stream-seconds",
        type=float,
        default=20,
        help="how long each stream runs to time micro-batches of a few new messages, the mqds source and then "
        "Spark's rate source for comparison (20; 0 skips them)",
    )
    parser.add_argument(
        "--counts",
        type=int,
        default=3,
        help="times df.count() runs: the first is printed apart (cold Python workers and JVM), then the best of "
        "the others (3); the count of two columns runs as often (at least twice), its best after the first shown",
    )
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    opts = parser.parse_args(argv)
    numbers = (opts.messages, opts.senders, opts.topics_per_sender, opts.batch, opts.threads, opts.shards, opts.counts)
    if min(numbers) < 1 or opts.size < 0:
        parser.error(
            "--messages, --senders, --topics-per-sender, --batch, --threads, --shards and --counts must be at least 1, "
            "--size 0 or more"
        )
    prefix = f"sparkbench/{uuid.uuid4().hex[:8]}"
    with contextlib.ExitStack() as stack:
        if opts.endpoints:
            endpoints = parse_endpoints(opts.endpoints)
        else:
            try:
                from mqds.tools.local_cluster import LocalCluster
            except ImportError:
                parser.error("starting a local cluster needs the server package (mqds-server); or give --endpoints")
            base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mqds-spark-bench-")))
            cluster = stack.enter_context(LocalCluster(base / "c", 3, n_shards=opts.shards))
            print(f"starting a local 3-node cluster ({opts.shards} vnodes, 3 replicas each) ...", flush=True)
            cluster.start()
            endpoints = cluster.addresses
        shape = (opts.senders, opts.size, opts.batch, opts.threads, opts.topics_per_sender)
        store(endpoints, f"{prefix}/warmup", WARMUP_MESSAGES, *shape)
        store_s = store(endpoints, f"{prefix}/data", opts.messages, *shape)
        with Client(endpoints, timeout_s=60) as client:
            streams = len(client.get_streams(f"{prefix}/data/#"))
        figures, warmup, startup_s, partitions, streaming = measure(
            endpoints, prefix, opts.master, opts.stream_seconds, opts.counts
        )
    replay = figures[-1]
    rows = [
        [f.what, f"{f.rows:,}", f"{f.seconds:.1f}", f"{f.rows_per_s:,.0f}", _ms(f.cpu_ms_per_1000)] for f in figures
    ]
    print(
        f"\nread {opts.messages:,} messages of {opts.size} bytes in {streams:,} streams "
        f"({partitions} Spark partitions); Spark started in {startup_s:.1f} s and read {warmup.rows:,} other "
        f"messages in {warmup.seconds:.1f} s first (not counted)"
    )
    print(table(["READ", "ROWS", "SECONDS", "ROWS/S", "CPU MS/1K ROWS"], rows, right=(1, 2, 3, 4)))
    print("CPU: every process of the machine while the read ran (nodes, Spark's JVM and Python workers, the replay)")
    for f in figures[:-1]:
        print(f"{f.what}: {f.rows_per_s / replay.rows_per_s:.2f}x the single-process replay in batches")
    if streaming is not None:
        print(
            f"streaming micro-batch of a few new messages: {streaming.mqds_s:.2f} s (median of {streaming.batches}; "
            f"target < 0.5 s); Spark's rate source, same session and trigger: {streaming.rate_s:.2f} s"
        )
    wrong = [f.what for f in figures if f.rows != opts.messages]
    if opts.json:
        print(
            json.dumps(
                {
                    "messages": opts.messages,
                    "store_s": round(store_s, 2),
                    "spark_startup_s": round(startup_s, 2),
                    "warmup_s": round(warmup.seconds, 2),
                    "partitions": partitions,
                    "streams": streams,
                    "reads": [
                        {
                            "what": f.what,
                            "rows": f.rows,
                            "seconds": round(f.seconds, 3),
                            "rows_per_s": round(f.rows_per_s),
                            "cpu_ms_per_1000": None if f.cpu_ms_per_1000 is None else round(f.cpu_ms_per_1000, 2),
                        }
                        for f in figures
                    ],
                    "count_rows_per_s": round(max(f.rows_per_s for f in figures if "df.count" in f.what)),
                    "count_few_columns_rows_per_s": round(max(f.rows_per_s for f in figures if FEW_COLUMNS in f.what)),
                    "micro_batch_s": round(streaming.mqds_s, 3) if streaming else None,
                    "rate_source_micro_batch_s": round(streaming.rate_s, 3) if streaming else None,
                }
            )
        )
    if wrong:
        print(f"FAILED: {', '.join(wrong)} did not read {opts.messages:,} rows", file=sys.stderr)
        return 1
    return 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
