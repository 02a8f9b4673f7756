"""The pipeline job (mqds spark-job) over a real cluster: the Parquet statistics match what was stored."""

from __future__ import annotations

import collections
import datetime
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from mqds.cli import main
from mqds.client import Client, Message
from mqds.spark.options import format_time_us
from mqds.spark.snapshot import Snapshot
from mqds.tools.local_cluster import LocalCluster

pytestmark = [pytest.mark.spark, pytest.mark.integration]


def expected(stored: list[Message], key: str, other: str) -> dict[tuple[str, str], dict[str, Any]]:
    """The statistics per (UTC date, key) computed in Python from the messages as stored."""
    groups: dict[tuple[str, str], list[Message]] = collections.defaultdict(list)
    for m in stored:
        day = datetime.datetime.fromtimestamp((m.timestamp_us or 0) // 1_000_000, datetime.UTC).date().isoformat()
        groups[(day, getattr(m, key))].append(m)
    return {
        group: {
            "messages": len(ms),
            "bytes": sum(len(m.payload) for m in ms),
            "first_us": min(m.timestamp_us or 0 for m in ms),
            "last_us": max(m.timestamp_us or 0 for m in ms),
            "qos": (sum(m.qos == 0 for m in ms), sum(m.qos == 1 for m in ms), sum(m.qos == 2 for m in ms)),
            "retained": sum(m.retain for m in ms),
            "distinct": len({getattr(m, other) for m in ms}),
        }
        for group, ms in groups.items()
    }


def written(spark: SparkSession, path: Path, key: str, distinct: str) -> dict[tuple[str, str], dict[str, Any]]:
    rows = (
        spark.read.parquet(str(path))
        .select(
            F.col("date").cast("string").alias("date"),
            key,
            "messages",
            "bytes",
            F.expr("unix_micros(first_timestamp)").alias("first_us"),
            F.expr("unix_micros(last_timestamp)").alias("last_us"),
            "qos0",
            "qos1",
            "qos2",
            "retained",
            distinct,
        )
        .collect()
    )
    return {
        (r.date, r[key]): {
            "messages": r.messages,
            "bytes": r.bytes,
            "first_us": r.first_us,
            "last_us": r.last_us,
            "qos": (r.qos0, r.qos1, r.qos2),
            "retained": r.retained,
            "distinct": r[distinct],
        }
        for r in rows
    }


def test_the_job_writes_per_topic_and_per_sender_statistics_partitioned_by_date(
    spark: SparkSession,
    cluster: LocalCluster,
    endpoints: str,
    prefix: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    messages = [
        Message(
            f"{prefix}/room/{i % 4}/{'temp' if i % 3 else 'co2'}",
            b"x" * (i % 17),
            sender=f"{prefix}-dev-{i % 5}",
            qos=i % 3,
            retain=i % 11 == 0,
        )
        for i in range(400)
    ]
    with Client(cluster.addresses, timeout_s=30) as client:
        stored = client.store_batch(messages)
    since = format_time_us(min(m.timestamp_us or 0 for m in stored))
    until = format_time_us(max(m.timestamp_us or 0 for m in stored) + 1)
    out = tmp_path / "stats"
    args = ["--endpoints", endpoints, "spark-job", "--since", since, "--until", until, "--out", str(out)]
    assert main([*args, "--topic-filter", f"{prefix}/#", "--top", "3"]) == 0
    report = capsys.readouterr().out

    assert written(spark, out / "topics", "topic", "senders") == expected(stored, "topic", "sender")
    assert written(spark, out / "senders", "sender", "topics") == expected(stored, "sender", "topic")
    days = sorted({k[0] for k in expected(stored, "topic", "sender")})
    assert sorted(p.name for p in (out / "topics").glob("date=*")) == [f"date={d}" for d in days]
    # The report: what was read and written, and the top rows of each table.
    assert f"read 400 messages matching '{prefix}/#'" in report
    assert "top 3 topics by messages:" in report and "top 3 senders by messages:" in report
    busiest = min(expected(stored, "sender", "topic").items(), key=lambda kv: (-kv[1]["messages"], kv[0][1]))
    assert busiest[0][1] in report.split("top 3 senders by messages:")[1]
    token = (out / "_mqds_snapshot.json").read_text()
    assert Snapshot.from_token(token).vnodes

    # Rerun on the saved snapshot after more writes: the same figures, the date partitions replaced, not added to.
    with Client(cluster.addresses, timeout_s=30) as client:
        client.store_batch(messages[:50])
    again = [*args, "--topic-filter", f"{prefix}/#", "--snapshot", str(out / "_mqds_snapshot.json"), "--until", "now"]
    assert main(again) == 0
    assert written(spark, out / "topics", "topic", "senders") == expected(stored, "topic", "sender")


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--since", "last week"], "is not a time"),
        (["--since", "1h", "--until", "2h"], "--until must be after --since"),
        (["--topic-filter", "a/#/b"], "--topic-filter: invalid topic filter"),
        (["--snapshot", "{not json"], "--snapshot: not a snapshot token"),
        (["--top", "0"], "--top and --max-records-per-partition must be at least 1"),
    ],
)
def test_the_command_refuses_bad_arguments_before_starting_spark(
    extra: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["spark-job", "--out", str(tmp_path / "o"), *extra]) == 2
    assert says in capsys.readouterr().err
