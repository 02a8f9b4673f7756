"""The Spark connector of mqds: ``spark.read.format("mqds")`` and ``spark.readStream.format("mqds")``.

>>> from mqds.spark import MqdsDataSource, pin_snapshot  # doctest: +SKIP
>>> spark.dataSource.register(MqdsDataSource)  # doctest: +SKIP
>>> df = (spark.read.format("mqds").option("endpoints", "10.0.0.1:7101,10.0.0.2:7101")
...       .option("topicFilter", "sensor/+/temp").option("startTime", "2026-11-01T00:00:00Z").load())  # doctest: +SKIP

It reads the stored messages the way Spark's Kafka source reads topics: a
batch read pins a consistent snapshot (one read fence per vnode) and reads
it in parallel, one partition per (vnode, generation) or smaller; a stream
reads micro-batches between per-vnode positions kept in the query's
checkpoint. docs/spark.md has every option.
This package needs pyspark and pyarrow (``pip install mqds-spark``);
the rest of the client does not.
"""

from __future__ import annotations

try:
    import pyarrow as pa
    from pyspark.sql import SparkSession
    from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import (
        BinaryType,
        BooleanType,
        IntegerType,
        MapType,
        StringType,
        StructField,
        StructType,
        TimestampType,
    )
except ImportError as err:  # pragma: no cover - depends on the installation
    raise ImportError(f"mqds.spark needs pyspark (4.3 or later) and pyarrow: pip install mqds-spark ({err})") from err

from mqds.spark.batch import MqdsBatchReader, MqdsPushdownReader
from mqds.spark.options import OptionError, SourceOptions, parse_options
from mqds.spark.plan import DataLossError
from mqds.spark.snapshot import Snapshot, pin_snapshot
from mqds.spark.stream import MqdsStreamReader

FORMAT = "mqds"
PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"

SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("payload", BinaryType(), False),
        StructField("sender", StringType(), False),
        StructField("qos", IntegerType(), False),
        StructField("retain", BooleanType(), False),
        StructField("properties", MapType(StringType(), StringType(), False), False),
        StructField("timestamp", TimestampType(), False),
        StructField("shard", IntegerType(), False),
        StructField("generation", IntegerType(), False),
    ]
)
"""The rows of the source: one per stored message (docs/spark.md describes each column)."""


def arrow_schema(schema: StructType = SCHEMA) -> pa.Schema:
    """``schema`` (by default :data:`SCHEMA`) as the Arrow schema Spark expects a Python source's batches to have."""
    return to_arrow_schema(schema, timezone="UTC")


def _options(source: DataSource, streaming: bool | None) -> SourceOptions:
    return parse_options(source.options, streaming=streaming)


def _projection(schema: StructType) -> StructType:
    """The columns to read: :data:`SCHEMA`, or some of its columns (names and types as there), in any order.

    Spark prunes no columns for a Python source: a ``.schema(...)`` naming
    fewer columns is how a query that needs only some of them skips
    building (and Spark skips converting) the others.
    """
    if schema == SCHEMA:
        return schema
    known = {field.name: field.dataType.simpleString() for field in SCHEMA.fields}
    names = [field.name for field in schema.fields]
    problems = [
        f"{field.name!r} is not one of its columns"
        if field.name not in known
        else f"{field.name!r} is {known[field.name]}, not {field.dataType.simpleString()}"
        for field in schema.fields
        if known.get(field.name) != field.dataType.simpleString()
    ]
    if not names:
        problems.append("no column named")
    problems += [f"{name!r} named twice" for name in sorted({n for n in names if names.count(n) > 1})]
    if problems:
        raise OptionError(
            f"the mqds source reads {SCHEMA.simpleString()}, or some of those columns; the schema given "
            f"does not fit: {'; '.join(problems)}"
        )
    return schema


class MqdsDataSource(DataSource):
    """``format("mqds")``: batch and streaming reads of an mqds cluster's messages.

    Works whatever ``spark.sql.python.filterPushdown.enabled`` says; Spark
    filters the rows itself after the read. :class:`MqdsPushdownDataSource`
    (or :func:`register`) also hands it filters on topic and timestamp.
    """

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        # Checked here so a bad option fails at load(), before any action;
        # whether it is a batch or a streaming read is known only later.
        _options(self, streaming=None)
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return MqdsBatchReader(_options(self, streaming=False), arrow_schema(_projection(schema)))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return MqdsStreamReader(_options(self, streaming=True), arrow_schema(_projection(schema)))


class MqdsPushdownDataSource(MqdsDataSource):
    """``format("mqds")`` whose batch reader takes pushed-down filters.

    Needs ``spark.sql.python.filterPushdown.enabled=true``: Spark refuses a
    reader that implements ``pushFilters`` otherwise.
    """

    def reader(self, schema: StructType) -> DataSourceReader:
        return MqdsPushdownReader(_options(self, streaming=False), arrow_schema(_projection(schema)))


def register(spark: SparkSession, *, filter_pushdown: bool | None = None) -> type[MqdsDataSource]:
    """Register ``format("mqds")`` in ``spark`` and return the class registered.

    ``filter_pushdown`` None: with pushdown when the session has
    ``spark.sql.python.filterPushdown.enabled`` set to true. True: sets it
    and registers the pushdown variant. False: the plain source.
    """
    if filter_pushdown is None:
        filter_pushdown = str(spark.conf.get(PUSHDOWN_CONF, "false")).lower() == "true"
    elif filter_pushdown:
        spark.conf.set(PUSHDOWN_CONF, "true")
    source = MqdsPushdownDataSource if filter_pushdown else MqdsDataSource
    spark.dataSource.register(source)
    return source


__all__ = [
    "FORMAT",
    "SCHEMA",
    "DataLossError",
    "MqdsDataSource",
    "MqdsPushdownDataSource",
    "OptionError",
    "Snapshot",
    "arrow_schema",
    "pin_snapshot",
    "register",
]
