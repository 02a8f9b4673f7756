"""The pipeline job: a time window of stored messages -> per-topic and per-sender statistics in Parquet.

``mqds spark-job --endpoints ... --since ... --until ... --out DIR`` (or
``spark-submit .../mqds/spark/job.py`` with the same arguments) pins a
snapshot of the cluster, reads the window through the ``mqds`` source once,
and writes two tables partitioned by date (UTC), ``DIR/topics`` and
``DIR/senders``: per (date, topic) and per (date, sender) the message count,
payload bytes, first and last timestamp, QoS mix, retained messages and the
number of distinct senders (topics). A date's partition is replaced when the
job runs again over it, so re-running a window is safe; run it over whole
days for complete daily figures. The snapshot token is saved next to the
tables: ``--snapshot DIR/_mqds_snapshot.json`` recomputes exactly the same.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from mqds.client import ConnectionSettings
from mqds.spark import FORMAT, register
from mqds.spark.snapshot import Snapshot, pin_snapshot

SNAPSHOT_FILE = "_mqds_snapshot.json"

# The UTC date of a message, whatever the session's time zone.
_UTC_DATE = "date_from_unix_date(CAST(floor(unix_micros(timestamp) / 86400000000) AS INT))"


LOG_LEVEL = "ERROR"
"""Spark's log level in the sessions the job and the benchmarks start."""


def session(master: str | None = None, app_name: str = "mqds-spark-job") -> SparkSession:
    """The Spark session of a job: the one spark-submit made, or a local one (``master``, default ``local[*]``).

    Python workers run this interpreter unless PYSPARK_PYTHON says otherwise,
    so they find mqds and pyarrow where the driver does.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name).config("spark.ui.showConsoleProgress", "false")
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ
    if master or not under_submit:
        # One machine: a few shuffle partitions per core, not Spark's 200 (each a task on the same cores).
        builder = builder.master(master or "local[*]")
        builder = builder.config("spark.sql.shuffle.partitions", str(2 * (os.cpu_count() or 2)))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(LOG_LEVEL)
    return spark


def connection_options(settings: ConnectionSettings) -> dict[str, str]:
    """The source options that carry ``settings`` (files are passed by path: they must exist on the executors)."""
    options = {"timeout": str(settings.timeout_s)}
    if settings.tls:
        options["tls"] = "true"
    for name, value in (
        ("tlsCa", settings.tls_ca),
        ("tlsCert", settings.tls_client_cert),
        ("tlsKey", settings.tls_client_key),
    ):
        if value is not None:
            options[name] = value.decode() if isinstance(value, bytes) else os.fspath(value)
    if settings.tls_server_name:
        options["tlsServerName"] = settings.tls_server_name
    if settings.auth_token:
        options["token"] = settings.auth_token
    return options


def topic_stats(messages: DataFrame) -> DataFrame:
    """Per (date, topic): messages, bytes, first/last timestamp, QoS mix, retained, distinct senders."""
    return _stats(messages, "topic", "senders", "sender")


def sender_stats(messages: DataFrame) -> DataFrame:
    """Per (date, sender): messages, bytes, first/last timestamp, QoS mix, retained, distinct topics."""
    return _stats(messages, "sender", "topics", "topic")


def _stats(messages: DataFrame, key: str, distinct_name: str, distinct_of: str) -> DataFrame:
    return messages.groupBy("date", key).agg(
        F.count(F.lit(1)).alias("messages"),
        F.sum("bytes").alias("bytes"),
        F.min("timestamp").alias("first_timestamp"),
        F.max("timestamp").alias("last_timestamp"),
        *[F.sum((F.col("qos") == q).cast("long")).alias(f"qos{q}") for q in (0, 1, 2)],
        F.sum(F.col("retain").cast("long")).alias("retained"),
        F.countDistinct(distinct_of).alias(distinct_name),
    )


@dataclass(frozen=True)
class JobResult:
    """What a run read and wrote, and the top rows to show."""

    messages: int
    vnodes: int
    dates: list[str]
    topic_rows: int
    sender_rows: int
    out_dir: Path
    snapshot_path: Path
    pinned_at_us: int
    top_topics: list[tuple[object, ...]]
    """The ``top`` (date, topic) rows by messages, in :data:`TOP_COLUMNS` order (timestamps in microseconds)."""
    top_senders: list[tuple[object, ...]]
    seconds: float


TOP_COLUMNS = ["date", "{key}", "messages", "bytes", "qos0", "qos1", "qos2", "first_timestamp", "last_timestamp"]


def run_job(
    spark: SparkSession,
    endpoints: str | Sequence[str],
    out_dir: Path,
    since_us: int,
    until_us: int,
    *,
    topic_filter: str = "#",
    snapshot: str | None = None,
    settings: ConnectionSettings | None = None,
    extra_options: Mapping[str, str] | None = None,
    top: int = 10,
) -> JobResult:
    """Read ``[since_us, until_us)`` of the messages matching ``topic_filter`` and write the statistics.

    ``snapshot`` (a token) reads that snapshot instead of pinning a new one.
    """
    started = time.monotonic()
    settings = settings or ConnectionSettings()
    endpoint_text = endpoints if isinstance(endpoints, str) else ",".join(endpoints)
    token = snapshot or pin_snapshot(endpoint_text, settings=settings)
    pinned = Snapshot.from_token(token)
    out_dir.mkdir(parents=True, exist_ok=True)
    snapshot_path = out_dir / SNAPSHOT_FILE
    snapshot_path.write_text(token + "\n")
    register(spark)
    source = (
        spark.read.format(FORMAT)
        .option("endpoints", endpoint_text)
        .option("topicFilter", topic_filter)
        .option("startTime", str(since_us))
        .option("endTime", str(until_us))
        .option("snapshot", token)
        .options(**connection_options(settings))
        .options(**dict(extra_options or {}))
        .load()
    )
    # One scan feeds both tables: the first write fills the cache with the
    # small columns (not the payloads), the second reads it from there.
    messages = source.select(
        F.expr(_UTC_DATE).alias("date"),
        "topic",
        "sender",
        "qos",
        "retain",
        F.length("payload").cast("long").alias("bytes"),
        "timestamp",
    ).persist()
    try:
        for name, table in (("topics", topic_stats(messages)), ("senders", sender_stats(messages))):
            (
                table.write.mode("overwrite")
                .option("partitionOverwriteMode", "dynamic")
                .partitionBy("date")
                .parquet(str(out_dir / name))
            )
        # What the report counts, in one pass over the cache.
        totals = messages.agg(
            F.count(F.lit(1)).alias("messages"),
            F.countDistinct("date", "topic").alias("topics"),
            F.countDistinct("date", "sender").alias("senders"),
            F.sort_array(F.collect_set("date")).alias("days"),
        ).collect()[0]
    finally:
        messages.unpersist()
    days = list(totals["days"])
    tops: dict[str, list[tuple[object, ...]]] = {"topics": [], "senders": []}
    for name, key in (("topics", "topic"), ("senders", "sender")):
        if not days:
            break
        # The top rows as written, this run's dates only (earlier runs may have written others).
        written = spark.read.parquet(str(out_dir / name)).where(F.col("date").isin(days))
        columns = [
            F.expr(f"unix_micros({c})").alias(c) if c.endswith("_timestamp") else F.col(c.format(key=key))
            for c in TOP_COLUMNS
        ]
        best = written.orderBy(F.desc("messages"), F.col(key)).limit(top).select(*columns).collect()
        tops[name] = [tuple(row) for row in best]
    return JobResult(
        messages=int(totals["messages"]),
        vnodes=sum(1 for v in pinned.vnodes if v.fence_us),
        dates=[str(day) for day in days],
        topic_rows=int(totals["topics"]),
        sender_rows=int(totals["senders"]),
        out_dir=out_dir,
        snapshot_path=snapshot_path,
        pinned_at_us=pinned.pinned_at_us,
        top_topics=tops["topics"],
        top_senders=tops["senders"],
        seconds=time.monotonic() - started,
    )
