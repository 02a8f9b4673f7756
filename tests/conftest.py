"""Fixtures shared by the test suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import ServerProcess

from mqds.client import Client


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A running single node with default settings, stopped after the test."""
    proc = ServerProcess(tmp_path / "n1").start()
    yield proc
    proc.kill()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client([server.address], timeout_s=20) as c:
        yield c
