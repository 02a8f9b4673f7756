"""Fixtures the storage unit tests share: one RocksDB engine per test module, a fresh shard per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mqds.server.storage.shard import Engine, ShardStorage


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
