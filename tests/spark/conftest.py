"""Fixtures of the Spark connector tests: one local Spark session and one real 3-node cluster for all of them.

A local Spark session takes seconds to start (more on a busy machine), so
every test shares one, in ``local[2]`` mode with filter pushdown enabled and
the pushdown variant of the source registered. The cluster is shared too;
each test writes under a topic prefix of its own and reads only that.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from mqds.spark import register
from mqds.tools.local_cluster import LocalCluster

N_SHARDS = 4


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    # The Python workers must run this interpreter (the virtualenv with mqds and pyarrow).
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[2]")
        .appName("mqds-spark-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.python.filterPushdown.enabled", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()


@pytest.fixture(scope="session")
def cluster(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # After Spark: pyspark forks its JVM launcher with a preexec_fn, which can
    # fail in a process whose gRPC threads already run ("Java gateway process
    # exited"); started first, the JVM is up before any gRPC channel exists.
    with LocalCluster(tmp_path_factory.mktemp("spark") / "c", 3, n_shards=N_SHARDS) as c:
        c.start()
        yield c


@pytest.fixture
def endpoints(cluster: LocalCluster) -> str:
    return ",".join(cluster.addresses)


@pytest.fixture
def prefix() -> str:
    """A topic prefix no other test writes under."""
    return f"t{uuid.uuid4().hex[:8]}"
