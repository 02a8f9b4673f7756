"""The examples in the docstrings of the protocol, client, settings and storage modules run and hold."""

from __future__ import annotations

import doctest
from types import ModuleType

import pytest

from mqds.chaos.faultfs import extents
from mqds.client.core import retry, routing_table
from mqds.protocol import delivery, messages, sharding, topics
from mqds.server import config
from mqds.server.cluster import placement
from mqds.server.config import units
from mqds.server.raft import codec, journal
from mqds.server.storage import iterators, keys, trie

MODULES = [
    topics,
    delivery,
    messages,
    sharding,
    keys,
    trie,
    iterators,
    placement,
    codec,
    journal,
    config,
    units,
    retry,
    routing_table,
    extents,
]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_doctests_pass(module: ModuleType) -> None:
    result = doctest.testmod(module, verbose=False, report=True)
    assert result.attempted > 0, f"{module.__name__} has no doctest examples"
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest examples failed in {module.__name__}"
