"""Deleting stored messages (issue 24) on a real 3-node cluster: a sender's, a filter's in a time range.

Each shard's leader logs a delete in bounded steps that every replica
applies; readers and iterators see the messages gone as soon as the call
answered, every replica holds the same content after, and a delete
interrupted by a leader kill goes on from its cursor on the new leader (and
the killed node, restarted, replays the steps it missed).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc
import pytest

from mqds.cli import main
from mqds.client import Client, ConnectionSettings, Message, aio
from mqds.client.errors import InvalidArgumentError, MqdsError
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.waiting import wait_until
from mqds.v1 import storage_pb2 as pb
from mqds.v1 import storage_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

N_SHARDS = 4
T = TypeVar("T")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("delete") / "c", 3, n_shards=N_SHARDS) as c:
        c.start()
        c.wait_leaders_settled()  # the balancer's first moves: a test below calls a vnode's leader directly
        yield c


def admin(cluster: LocalCluster) -> Client:
    return Client(cluster.addresses, settings=ConnectionSettings(timeout_s=30, cluster_secret=cluster.secret))


def stored(c: Client, topic_filter: str) -> list[tuple[str, str, bytes]]:
    return sorted((m.topic, m.sender, m.payload) for m in c.replay(topic_filter))


def test_deleting_a_senders_messages_removes_them_from_every_replica_and_reader(cluster: LocalCluster) -> None:
    with admin(cluster) as c:
        for i in range(40):
            sender = ("erase-me", "keep-a", "keep-b")[i % 3]
            c.store_batch([Message(topic=f"del1/{i % 4}/t", payload=str(i).encode(), sender=sender)])
        before = stored(c, "del1/#")
        shard = shard_of("erase-me", N_SHARDS)
        # An iterator made before the delete, read part-way.
        (stream, *_) = [s for _, s in c.get_streams("del1/#", shards=[shard])]
        iterator = c.make_iterator(stream, "del1/#")
        first = c.next(iterator, 1)
        report = c.delete_messages("del1/#", sender="erase-me")
        assert [s.shard for s in report.shards] == [shard]  # a sender's messages live in its shard only
        assert report.messages == 14 and report.by_shard == {shard: 14}
        assert stored(c, "del1/#") == [row for row in before if row[1] != "erase-me"]
        rest = c.next(first.iterator, 1000)
        assert all(m.sender != "erase-me" for m in rest.messages)
        # Again: nothing more to delete.
        assert c.delete_messages("del1/#", sender="erase-me").messages == 0
    cluster.assert_replicas_identical(shards=[shard])


def test_deleting_a_filters_messages_in_a_time_range_keeps_the_rest(cluster: LocalCluster) -> None:
    with admin(cluster) as c:
        early = c.store_batch([Message(topic=f"del2/a/{i}", payload=b"early", sender=f"p{i}") for i in range(20)])
        middle = c.store_batch(
            [Message(topic=f"del2/{k}/{i}", payload=b"mid", sender=f"p{i}") for i in range(20) for k in "ab"]
        )
        late = c.store_batch([Message(topic=f"del2/a/{i}", payload=b"late", sender=f"p{i}") for i in range(20)])
        # A time range per shard would be exact; one range over all shards must hold only the middle batch.
        since = min(m.timestamp_us or 0 for m in middle)
        until = max(m.timestamp_us or 0 for m in middle) + 1
        assert max(m.timestamp_us or 0 for m in early) < since and min(m.timestamp_us or 0 for m in late) >= until
        report = c.delete_messages("del2/a/#", since_us=since, until_us=until)
        assert report.messages == 20 and len(report.shards) == N_SHARDS
        left = [(m.topic.split("/")[1], m.payload) for m in c.replay("del2/#")]
        assert sorted(set(left)) == [("a", b"early"), ("a", b"late"), ("b", b"mid")]
        assert len(left) == 60
    cluster.assert_replicas_identical()


def test_bad_deletes_are_refused_clearly(cluster: LocalCluster) -> None:
    with admin(cluster) as c:
        with pytest.raises(InvalidArgumentError, match="every stored message"):
            c.delete_messages("#")
        with pytest.raises(InvalidArgumentError, match="time range is empty"):
            c.delete_messages("x/#", since_us=10, until_us=10)
        with pytest.raises(InvalidArgumentError, match="invalid topic filter"):
            c.delete_messages("a/#/b")
    # The nodes check too (a client that skips the library's checks), and admin rights are needed.
    channel = grpc.insecure_channel(cluster.addresses[0])
    stub = pb_grpc.StorageStub(channel)
    secret = [("x-mqds-cluster-secret", cluster.secret)]
    try:
        with pytest.raises(grpc.RpcError) as refused:
            stub.DeleteMessages(pb.DeleteMessagesRequest(shard=0, topic_filter="#"), timeout=10, metadata=secret)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "every stored message" in (refused.value.details() or "")
        with pytest.raises(grpc.RpcError) as anonymous:
            stub.DeleteMessages(pb.DeleteMessagesRequest(shard=0, topic_filter="x/#"), timeout=10)
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
        wrong = next(s for s in range(N_SHARDS) if s != shard_of("someone", N_SHARDS))
        with pytest.raises(grpc.RpcError) as misrouted:
            stub.DeleteMessages(
                pb.DeleteMessagesRequest(shard=wrong, topic_filter="#", sender="someone"), timeout=10, metadata=secret
            )
        assert misrouted.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"shard {shard_of('someone', N_SHARDS)}" in (misrouted.value.details() or "")
    finally:
        channel.close()


def test_a_delete_half_way_goes_on_after_its_leader_is_killed(cluster: LocalCluster) -> None:
    """Steps of 5,000 keys: 12,000 messages of one sender take three. One step is applied, the leader is
    killed, the delete goes on from its cursor on the new leader; the old leader, restarted, replays the
    steps it missed. Messages stored after the delete began are kept."""
    sender = next(s for s in (f"bulk-{i}" for i in itertools.count()) if shard_of(s, N_SHARDS) == 1)
    shard = 1
    with admin(cluster) as c:
        for _ in range(12):
            c.store_batch([Message(topic="del3/x", payload=b"%d" % i, sender=sender) for i in range(1000)])
        assert sum(1 for _ in c.replay("del3/#")) == 12_000
        cluster.wait_leaders_settled()  # a leader read while the balancer moves it refuses the call (not the leader)
        leader = cluster.leader(shard)
        assert leader is not None
        stub = pb_grpc.StorageStub(grpc.insecure_channel(cluster.nodes[leader].address))
        secret = [("x-mqds-cluster-secret", cluster.secret)]
        first = stub.DeleteMessages(
            pb.DeleteMessagesRequest(shard=shard, topic_filter="del3/#", sender=sender, max_steps=1),
            timeout=30,
            metadata=secret,
        )
        assert first.steps == 1 and first.deleted_messages == 5_000 and first.HasField("cursor")
        c.store_batch([Message(topic="del3/x", payload=b"after", sender=sender)])  # stored after the delete began
        cluster.kill(leader)
        try:
            new_leader = cluster.wait_for_leader(shard, 30, exclude=[leader])
            stub = pb_grpc.StorageStub(grpc.insecure_channel(cluster.nodes[new_leader].address))
            request = pb.DeleteMessagesRequest(shard=shard, topic_filter="del3/#", sender=sender, cursor=first.cursor)
            rest = wait_until(
                "the delete going on at the new leader",
                lambda: _try(lambda: stub.DeleteMessages(request, timeout=10, metadata=secret)),
                30,
            )
            assert not rest.HasField("cursor") and rest.deleted_messages == 7_000
            assert [m.payload for m in c.replay("del3/#")] == [b"after"]
        finally:
            cluster.start_node(leader)
    wait_until("the restarted node applying the steps it missed", lambda: _same_digests(cluster, shard), 60)
    cluster.assert_replicas_identical(shards=[shard])


def _try(call: Callable[[], T]) -> T | None:
    try:
        return call()
    except (grpc.RpcError, MqdsError):
        return None


def _same_digests(cluster: LocalCluster, shard: int) -> bool:
    digests = cluster.digests(shard)
    return len(digests) == 3 and len({(d.applied_index, d.sha256) for d in digests.values()}) == 1


def test_the_asyncio_client_deletes_a_senders_messages(cluster: LocalCluster) -> None:
    async def scenario() -> tuple[int, list[str]]:
        settings = ConnectionSettings(timeout_s=30, cluster_secret=cluster.secret)
        async with aio.Client(cluster.addresses, settings=settings) as c:
            await c.store_batch([Message(topic="del4/t", payload=b"x", sender=s) for s in ("gone", "kept") * 5])
            report = await c.delete_messages("del4/#", sender="gone")
            left = [m.sender async for m in c.replay("del4/#")]
            return report.messages, left

    deleted, left = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert deleted == 5 and left == ["kept"] * 5


def test_the_command_line_deletes_and_reports_per_shard(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with admin(cluster) as c:
        c.store_batch([Message(topic=f"del5/{i % 3}", payload=b"x", sender=f"p{i}") for i in range(30)])
    endpoints = ",".join(cluster.addresses)
    monkeypatch.delenv("MQDS_CLUSTER_SECRET", raising=False)
    assert main(["--endpoints", endpoints, "delete", "del5/1"]) == 1  # no proof: refused
    assert "cluster secret" in capsys.readouterr().err
    assert main(["--endpoints", endpoints, "delete", "#"]) == 2  # everything, unconfirmed
    assert "--all" in capsys.readouterr().err
    monkeypatch.setenv("MQDS_CLUSTER_SECRET", cluster.secret)
    assert main(["--endpoints", endpoints, "delete", "del5/1"]) == 0
    out = capsys.readouterr()
    assert "deleted 10 messages" in out.out and "SHARD" in out.out and "shard 0:" in out.err
    with admin(cluster) as c:
        assert sorted({m.topic for m in c.replay("del5/#")}) == ["del5/0", "del5/2"]
