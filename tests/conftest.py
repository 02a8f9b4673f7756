"""Fixtures shared by the test suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import ServerProcess

from mqds.client import Client, ConnectionSettings

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
