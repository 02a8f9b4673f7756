"""Benchmark part: a streaming micro-batch's fixed cost, next to Spark's own ``rate`` source in the same session.

A stream that is kept up to date runs micro-batches of a few new messages;
what one costs, whatever its size, bounds how fresh its output can be. Both
streams run with ``trigger(processingTime="0 seconds")`` into the ``noop``
sink for ``seconds``: the mqds one over a filter that a thread keeps writing
a few messages to, Spark's ``rate`` source at a few rows a second. The figure
is the median of Spark's ``triggerExecution`` over the micro-batches that
read rows, leaving out the first two (they compile and start workers).
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from mqds.client import Client, Message
from mqds.spark import FORMAT
from mqds.spark.job import LOG_LEVEL

MESSAGES_PER_WRITE = 10
WRITE_EVERY_S = 0.25


def micro_batch_s(spark: SparkSession, endpoints: list[str], topic_prefix: str, seconds: float) -> tuple[float, int]:
    """The median micro-batch time of an mqds stream of a few new messages at a time, and how many were timed."""
    stop = threading.Event()

    def write() -> None:
        with Client(endpoints, timeout_s=30) as client:
            n = 0
            while not stop.is_set():
                client.store_batch(
                    [
                        Message(f"{topic_prefix}/d/{i % 3}", b"x", sender=f"s{i % 4}", qos=1)
                        for i in range(n, n + MESSAGES_PER_WRITE)
                    ]
                )
                n += MESSAGES_PER_WRITE
                stop.wait(WRITE_EVERY_S)

    writer = threading.Thread(target=write, name="micro-batch-writer", daemon=True)
    writer.start()
    try:
        stream = (
            spark.readStream.format(FORMAT)
            .option("endpoints", ",".join(endpoints))
            .option("topicFilter", f"{topic_prefix}/#")
            .option("startingOffsets", "earliest")
            .load()
        )
        return _median_trigger_s(stream, seconds)
    finally:
        stop.set()
        writer.join(30)


def rate_source_micro_batch_s(spark: SparkSession, seconds: float) -> tuple[float, int]:
    """The same figure for Spark's built-in ``rate`` source: what any source pays in this session."""
    stream = (
        spark.readStream.format("rate").option("rowsPerSecond", str(int(MESSAGES_PER_WRITE / WRITE_EVERY_S))).load()
    )
    return _median_trigger_s(stream, seconds)


def _median_trigger_s(stream: DataFrame, seconds: float) -> tuple[float, int]:
    with tempfile.TemporaryDirectory(prefix="mqds-spark-bench-checkpoint-") as checkpoint:
        query = (
            stream.writeStream.format("noop")
            .option("checkpointLocation", checkpoint)
            .trigger(processingTime="0 seconds")
            .start()
        )
        try:
            time.sleep(seconds)
        finally:
            # Stopping cancels the micro-batch running then, and its tasks log that at ERROR with a
            # stack trace as they end; the session's level (mqds.spark.job.session sets ERROR)
            # comes back once no job is left (10 s at most).
            context = stream.sparkSession.sparkContext
            context.setLogLevel("OFF")
            try:
                query.stop()
                deadline = time.monotonic() + 10
                while context.statusTracker().getActiveStageIds() and time.monotonic() < deadline:
                    time.sleep(0.05)
            finally:
                context.setLogLevel(LOG_LEVEL)
        progress: list[Any] = [p for p in query.recentProgress if p["numInputRows"]][2:]
    if not progress:
        raise RuntimeError(f"the stream ran no micro-batch with rows in {seconds} s")
    return statistics.median(p["durationMs"]["triggerExecution"] for p in progress) / 1000, len(progress)
