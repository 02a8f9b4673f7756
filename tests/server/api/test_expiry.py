"""Broker state that ends (issue 24), on a real 3-node cluster: retained messages and sessions that expire.

A retained message with ``message_expiry_s`` (MQTT 5's Message Expiry
Interval) is returned until that long after it was retained; a client's
session (state, proxy subscriptions, read positions) lasts its Session
Expiry Interval after it disconnects (the node's
``session_expiry_default_s`` for a client that reported none). Then the
vnode's leader logs their removal with its own clock, in bounded steps, so
every replica removes the same keys. Across a leader kill: the new leader
removes them, and the killed replica, once back, ends with the same content.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest

from mqds.client import SESSION_NEVER_EXPIRES, Client, Message
from mqds.client.errors import InvalidArgumentError
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.waiting import wait_until

pytestmark = pytest.mark.integration

N_SHARDS = 4
DEFAULT_EXPIRY_S = 2  # for clients that report no session expiry interval (MQTT 3.1.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(
        tmp_path_factory.mktemp("expiry") / "c",
        3,
        n_shards=N_SHARDS,
        args=["--session-expiry-default-s", str(DEFAULT_EXPIRY_S)],
    ) as c:
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


def _session_gone(c: Client, clientid: str) -> bool:
    return c.client_state(clientid) is None and c.subscriptions(clientid) == {}


def test_sessions_end_their_expiry_interval_after_the_client_left(cluster: LocalCluster) -> None:
    with Client(cluster.addresses, timeout_s=30) as c:
        shards = {shard_of(cid, N_SHARDS) for cid in ("s-mqtt5", "s-311", "s-never", "s-zero")}
        before = {shard: _keys(cluster, shard) for shard in shards}
        clients = {"s-mqtt5": 1, "s-311": None, "s-never": SESSION_NEVER_EXPIRES, "s-zero": 0}
        for clientid, expiry in clients.items():
            state = c.client_connected(clientid, "broker-a", session_expiry_s=expiry)
            assert state.session_expiry_s == (DEFAULT_EXPIRY_S if expiry is None else expiry)
            c.subscribe(clientid, "t/#", 1)
            c.start_read_position(clientid, "t/#")
        for clientid in clients:
            left = c.client_disconnected(clientid, "broker-a")
            assert left is not None and not left.online
            if clients[clientid] == SESSION_NEVER_EXPIRES:
                assert left.expires_at_us == 0
            else:
                assert left.expires_at_us == left.offline_at_us + left.session_expiry_s * 1_000_000
        wait_until(
            "the ended sessions removed",
            lambda: all(_session_gone(c, cid) for cid in ("s-mqtt5", "s-311", "s-zero")),
            30,
        )
        assert c.client_state("s-never") is not None and c.subscriptions("s-never") == {"t/#": 1}
        c.forget_session("s-never")
    cluster.assert_replicas_identical(shards=sorted(shards))
    # Every replica holds only what was there before, but for s-never's client record.
    for shard in shards:
        extra = 1 if shard == shard_of("s-never", N_SHARDS) else 0
        assert all(k == before[shard][n] + extra for n, k in _keys(cluster, shard).items())


def test_a_session_interval_out_of_range_is_refused_clearly(cluster: LocalCluster) -> None:
    with Client(cluster.addresses, timeout_s=30) as c:
        for bad in (-1, SESSION_NEVER_EXPIRES + 1):
            with pytest.raises(InvalidArgumentError, match=r"session_expiry_s .* out of range"):
                c.client_connected("s-bad", "broker-a", session_expiry_s=bad)
        with pytest.raises(InvalidArgumentError, match="whole number of seconds"):
            c.client_disconnected("s-bad", "broker-a", session_expiry_s=1.5)  # type: ignore[arg-type]
        assert c.client_state("s-bad") is None


def test_a_new_leader_removes_what_ended_while_its_old_leader_was_dead(cluster: LocalCluster) -> None:
    """A retained message and a session that end in a vnode whose leader is killed: the new leader removes both,
    and the old leader, back, ends with the same content."""
    topic = "expiry/b"
    shard = shard_of(topic, N_SHARDS)
    clientid = next(c for c in (f"s-failover-{i}" for i in itertools.count()) if shard_of(c, N_SHARDS) == shard)
    with Client(cluster.addresses, timeout_s=30) as c:
        before = _keys(cluster, shard)
        c.retain(Message(topic=topic, payload=b"gone soon", sender="p", message_expiry_s=3))
        c.client_connected(clientid, "broker-a", session_expiry_s=3)
        c.subscribe(clientid, "t/#", 1)
        c.client_disconnected(clientid, "broker-a")
        # Each with its expiry index entry; the client record, its subscription: on every replica.
        wait_until(
            "the retained message and the session on every replica",
            lambda: _keys(cluster, shard) == {n: k + 5 for n, k in before.items()},
            30,
        )
        leader = cluster.leader(shard)
        assert leader is not None
        cluster.kill(leader)
        try:
            wait_until(
                "both removed by the new leader",
                lambda: topic not in {m.topic for m in c.retained("expiry/#")} and _session_gone(c, clientid),
                30,
            )
            wait_until(
                "both removed on the live replicas",
                lambda: all(k == before[n] for n, k in _keys(cluster, shard).items()),
                30,
            )
        finally:
            cluster.start_node(leader)
    cluster.assert_replicas_identical(shards=[shard])
    assert _keys(cluster, shard) == before
