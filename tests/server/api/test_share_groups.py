"""Shared subscriptions (issue 24) on a real 3-node cluster: a group's members share one read position per shard.

Each shard is read by one member at a time; each stored message goes to one
member; members joining, leaving and losing their lease move shards between
the others without losing anything (what a moved shard's old reader fetched
and did not acknowledge may come again: at least once).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator

import grpc
import pytest

from mqds.client import Client, Message, SharedSubscription
from mqds.client.errors import InvalidArgumentError
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import sessions_pb2_grpc as spb_grpc

pytestmark = pytest.mark.integration

N_SHARDS = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("share") / "c", 3, n_shards=N_SHARDS) as c:
        c.start()
        yield c


def publish(c: Client, topic: str, count: int, start: int = 0) -> set[bytes]:
    payloads = [b"%d" % i for i in range(start, start + count)]
    c.store_batch([Message(topic=topic, payload=p, sender=f"s{i % 16}", qos=1) for i, p in enumerate(payloads)])
    return set(payloads)


def drain(members: list[SharedSubscription], want: set[bytes], seen: Counter[bytes], timeout_s: float = 30) -> None:
    """Each member fetches and acknowledges in turn until every wanted payload was delivered."""
    deadline = time.monotonic() + timeout_s
    while not want <= set(seen) and time.monotonic() < deadline:
        for member in members:
            for m in member.fetch(25):
                seen[m.payload] += 1
                member.ack(m)
    assert want <= set(seen), f"missing {len(want - set(seen))}"


def test_members_share_the_shards_and_each_message_goes_to_one(cluster: LocalCluster) -> None:
    with Client(cluster.addresses, timeout_s=30) as c:
        a = SharedSubscription(c, "workers", "jobs/#", "m-a")
        b = SharedSubscription(c, "workers", "jobs/#", "m-b")
        assert a.join().shards == [0, 1, 2, 3]  # alone: every shard
        joined = b.join()
        assert joined.members == ["m-a", "m-b"] and joined.position_clientid == "$share/workers"
        a.join()  # a renews: it learns that b took half
        assert sorted(a.shards + b.shards) == [0, 1, 2, 3] and not set(a.shards) & set(b.shards)
        want = publish(c, "jobs/x", 400)
        seen: Counter[bytes] = Counter()
        drain([a, b], want, seen)
        assert set(seen) == want and max(seen.values()) == 1  # each message to one member, once
        # Another group on the same filter has a position of its own: it gets everything too.
        other = SharedSubscription(c, "auditors", "jobs/#", "m-z", start="earliest")
        theirs: Counter[bytes] = Counter()
        drain([other], want, theirs)
        assert set(theirs) == want


def test_joining_leaving_and_an_ended_lease_move_shards_without_losing_anything(cluster: LocalCluster) -> None:
    with Client(cluster.addresses, timeout_s=30) as c:
        a = SharedSubscription(c, "movers", "work/#", "m-a")
        b = SharedSubscription(c, "movers", "work/#", "m-b")
        for member in (a, b, a):
            member.join()
        want = publish(c, "work/x", 300)
        seen: Counter[bytes] = Counter()
        # a fetches a page and acknowledges none of it; then a third member joins and the shards move.
        unacked = a.fetch(25)
        seen.update(m.payload for m in unacked)
        d = SharedSubscription(c, "movers", "work/#", "m-d", lease_s=2)
        for member in (d, a, b):
            member.join()
        assert sorted(a.shards + b.shards + d.shards) == [0, 1, 2, 3]
        want |= publish(c, "work/x", 300, start=300)
        drain([a, b, d], want, seen)
        # b leaves; d stops renewing and its lease (2 s) ends: a is left with every shard.
        b.leave()
        time.sleep(2.5)
        assert a.join().members == ["m-a"] and a.shards == [0, 1, 2, 3]
        want |= publish(c, "work/x", 200, start=600)
        drain([a], want, seen)
        assert set(seen) == want  # nothing lost across the moves
        # Only what a had fetched and not acknowledged when its shards moved could come twice.
        twice = {p for p, n in seen.items() if n > 1}
        assert twice <= {m.payload for m in unacked}
        # The leader of the shard that keeps the group (and its read positions) dies: the group goes on
        # on the new leader, and so does its position (nothing delivered again, nothing skipped).
        home = shard_of("$share/movers", N_SHARDS)
        leader = cluster.leader(home)
        assert leader is not None
        cluster.kill(leader)
        try:
            e = SharedSubscription(c, "movers", "work/#", "m-e")
            assert e.join().members == ["m-a", "m-e"]
            a.join()
            more = publish(c, "work/x", 100, start=800)
            after: Counter[bytes] = Counter()
            drain([a, e], more, after)
            assert set(after) == more and max(after.values()) == 1
        finally:
            cluster.start_node(leader)
    cluster.assert_replicas_identical()


def test_bad_share_group_requests_are_refused_clearly(cluster: LocalCluster) -> None:
    with Client(cluster.addresses, timeout_s=30) as c:
        with pytest.raises(InvalidArgumentError, match="share group name"):
            c.join_share_group("a/b", "jobs/#", "m")
        with pytest.raises(InvalidArgumentError, match="lease"):
            c.join_share_group("g", "jobs/#", "m", lease_s=0)
        with pytest.raises(InvalidArgumentError, match="filter"):
            c.join_share_group("g", "jobs/#/x", "m")
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        stub = spb_grpc.SessionsStub(channel)
        for request, words in (
            (spb.ShareGroupRequest(group="g", topic_filter="jobs/#", member="m"), "lease_s is 0"),
            (spb.ShareGroupRequest(group="", topic_filter="jobs/#", member="m", lease_s=5), "share group name"),
            (spb.ShareGroupRequest(group="g", topic_filter="jobs/#", member="", lease_s=5), "member name"),
        ):
            refused = _refusal(lambda: stub.JoinShareGroup(request, timeout=10))  # noqa: B023
            assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and words in (refused.details() or "")


def _refusal(call: Callable[[], object]) -> grpc.RpcError:
    try:
        call()
    except grpc.RpcError as err:
        return err
    raise AssertionError("the request was not refused")
