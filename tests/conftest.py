"""Fixtures shared by the test suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import ServerProcess

from mqds.client import Client, ConnectionSettings
from mqds.server.storage.shard import Engine, ShardStorage
from mqds.tools import ports

# Each parallel worker (pytest-xdist) picks local nodes' ports from a slice of the range of its own, so two
# workers never hand the same port to two nodes (see mqds.tools.ports.SHARE_ENV).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw"):
    os.environ.setdefault(ports.SHARE_ENV, f"{int(_WORKER[2:])}/{os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1')}")

# The single node's cluster secret: the proof its admin calls (generations) need.
SECRET = "test-cluster-secret-0123456789"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A running single node with default settings (and a cluster secret), stopped after the test."""
    proc = ServerProcess(tmp_path / "n1", env={"MQDS_CLUSTER_SECRET": SECRET}).start()
    yield proc
    proc.kill()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client([server.address], settings=ConnectionSettings(timeout_s=20, cluster_secret=SECRET)) as c:
        yield c


# The storage tests' fixtures: one RocksDB engine per test module, a fresh shard per test.


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine()


@pytest.fixture
def shard(request: pytest.FixtureRequest, tmp_path: Path, engine: Engine) -> Iterator[ShardStorage]:
    """A shard, initialised: number 0, or the test module's ``SHARD_NUMBER``."""
    storage = ShardStorage(str(tmp_path / "shard"), getattr(request.module, "SHARD_NUMBER", 0), engine)
    storage.initialize(1)
    yield storage
    storage.close()
