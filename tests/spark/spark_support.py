"""Helpers of the Spark connector tests: load a DataFrame from the test cluster, collect rows comparably."""

from __future__ import annotations

from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from mqds.client import Message
from mqds.spark import FORMAT


def load(spark: SparkSession, endpoints: str, **options: Any) -> DataFrame:
    return spark.read.format(FORMAT).option("endpoints", endpoints).options(**options).load()


def rows_of(df: DataFrame) -> list[tuple[Any, ...]]:
    """Every row as (shard, timestamp_us, topic, payload, sender, qos, retain, properties, generation), sorted."""
    picked = df.select(
        "shard",
        F.expr("unix_micros(timestamp)").alias("ts"),
        "topic",
        "payload",
        "sender",
        "qos",
        "retain",
        "properties",
        "generation",
    ).collect()
    return sorted(
        (r.shard, r.ts, r.topic, bytes(r.payload), r.sender, r.qos, r.retain, dict(r.properties), r.generation)
        for r in picked
    )


def positions(df: DataFrame) -> list[tuple[int, int]]:
    """Every row's position (shard, timestamp_us), sorted: what identifies a stored message."""
    return sorted((r.shard, r.ts) for r in df.select("shard", F.expr("unix_micros(timestamp)").alias("ts")).collect())


def stored_rows(messages: list[Message], generation: int) -> list[tuple[Any, ...]]:
    """What :func:`rows_of` must return for ``messages`` as ``store_batch`` returned them."""
    return sorted(
        (m.shard, m.timestamp_us, m.topic, m.payload, m.sender, m.qos, m.retain, dict(m.properties), generation)
        for m in messages
    )
