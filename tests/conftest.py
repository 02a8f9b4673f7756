"""Fixtures shared by the test suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import ServerProcess

from mqds.client import Client


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """With ``-n 2 --dist loadgroup`` (make test), keep each module on one worker.

    Most integration modules start one cluster for all their tests, and the
    Spark modules share one Spark session: splitting a module across workers
    would start them twice. Most of what the tests wait for is elections,
    fsyncs and timeouts, so two modules at a time fit on two cores.
    """
    for item in items:
        path = Path(str(item.fspath))
        group = "spark" if path.parent.name == "spark" else f"{path.parent.name}/{path.stem}"
        item.add_marker(pytest.mark.xdist_group(group))


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
