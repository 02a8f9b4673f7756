"""MQTT 5 Message Expiry Interval on retained messages (issue 24), on a real 3-node cluster.

A retained message with ``message_expiry_s`` is returned until that long
after it was retained; then no longer, and the vnode's leader logs its
removal (with its own clock, so every replica removes the same keys) in
bounded steps. Across a leader kill: the new leader removes it, and the
killed replica, once back, ends with the same content as the others.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from mqds.client import Client, Message
from mqds.protocol.sharding import shard_of
from mqds.tools.localproc import LocalCluster, wait_until

pytestmark = pytest.mark.integration

N_SHARDS = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("retained-expiry") / "c", 3, n_shards=N_SHARDS) as c:
        c.start()
        yield c


def _keys(cluster: LocalCluster, shard: int) -> dict[str, int]:
    return {node: d.keys for node, d in cluster.digests(shard).items()}


def test_an_expired_retained_message_is_hidden_then_removed_from_every_replica(cluster: LocalCluster) -> None:
    topic = "expiry/a"
    shard = shard_of(topic, N_SHARDS)
    with Client(cluster.addresses, timeout_s=30) as c:
        c.retain(Message(topic="expiry/kept", payload=b"stays", sender="p"))
        before = _keys(cluster, shard)
        stored = c.retain(Message(topic=topic, payload=b"short-lived", sender="p", message_expiry_s=2))
        assert stored is not None and stored.message_expiry_s == 2
        (found,) = [m for m in c.retained("expiry/#") if m.topic == topic]
        assert found.payload == b"short-lived" and found.message_expiry_s == 2
        # The message and its expiry entry, on every replica.
        wait_until(
            "the retained message on every replica",
            lambda: _keys(cluster, shard) == {n: k + 2 for n, k in before.items()},
            30,
        )
        deadline = (stored.timestamp_us or 0) / 1e6 + 2
        time.sleep(max(0.0, deadline - time.time()) + 0.2)
        assert [m.topic for m in c.retained("expiry/#")] == ["expiry/kept"]
        wait_until("the expired message removed on every replica", lambda: _keys(cluster, shard) == before, 30)
    cluster.assert_replicas_identical(shards=[shard])


def test_a_new_leader_removes_what_expired_and_the_old_one_catches_up(cluster: LocalCluster) -> None:
    topic = "expiry/b"
    shard = shard_of(topic, N_SHARDS)
    with Client(cluster.addresses, timeout_s=30) as c:
        before = _keys(cluster, shard)
        c.retain(Message(topic=topic, payload=b"gone soon", sender="p", message_expiry_s=3))
        wait_until(
            "the retained message on every replica",
            lambda: _keys(cluster, shard) == {n: k + 2 for n, k in before.items()},
            30,
        )
        leader = cluster.leader(shard)
        assert leader is not None
        cluster.kill(leader)
        try:
            wait_until(
                "the message hidden by the new leader",
                lambda: topic not in {m.topic for m in c.retained("expiry/#")},
                30,
            )
            wait_until(
                "the expired message removed on the live replicas",
                lambda: all(k == before[n] for n, k in _keys(cluster, shard).items()),
                30,
            )
        finally:
            cluster.start_node(leader)
    cluster.assert_replicas_identical(shards=[shard])
    assert _keys(cluster, shard) == before
