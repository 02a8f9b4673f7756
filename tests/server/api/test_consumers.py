"""Inspecting consumers (issue 47) on a real 3-node cluster: sessions, read positions, share groups and push
subscriptions with their lag (Sessions.ListConsumers, Sessions.ConsumerLag), the client call, `mqds consumers`
and the lag metrics.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mqds.cli import main as cli_main
from mqds.client import Client, ConnectionSettings, Message, SharedSubscription
from mqds.client.aio import Client as AsyncClient
from mqds.client.core import consumers as consumer_calls
from mqds.client.core.consumers import Consumers
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.waiting import wait_until
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import sessions_pb2_grpc as spb_grpc

pytestmark = pytest.mark.integration

N_SHARDS = 4
ANSWER_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(
        tmp_path_factory.mktemp("consumers") / "c",
        3,
        n_shards=N_SHARDS,
        metrics=True,
        # Small answers, so that a page of a few large sessions is cut at the node's bound.
        args=["--consumer-lag-metric-top", "2", "--max-answer-bytes", str(ANSWER_BYTES)],
    ) as c:
        c.start()
        yield c


@pytest.fixture(scope="module")
def admin(cluster: LocalCluster) -> Iterator[Client]:
    with cluster.admin_client() as c:
        yield c


def publish(c: Client, topic: str, count: int, qos: int = 1, senders: int = 8) -> None:
    c.store_batch(
        [Message(topic=topic, payload=b"%d" % i, sender=f"pub-{i % senders}", qos=qos) for i in range(count)],
        sync=True,
    )


def the_position(found: Consumers, clientid: str, topic_filter: str) -> consumer_calls.PositionInfo:
    (position,) = [p for p in found.read_positions or [] if (p.clientid, p.topic_filter) == (clientid, topic_filter)]
    return position


def test_a_read_position_behind_shows_its_lag_and_none_once_acknowledged(admin: Client) -> None:
    admin.client_connected("reader-1", "broker-a")
    admin.subscribe("reader-1", "lag/#", 1)
    admin.start_read_position("reader-1", "lag/#")
    time.sleep(0.01)
    publish(admin, "lag/a", 7)  # from 8 senders: spread over the shards
    publish(admin, "lag/b", 3, qos=0)  # offline delivery skips QoS 0: not behind by them
    publish(admin, "other/x", 5)  # another filter's
    time.sleep(0.2)
    found = admin.consumers(["sessions", "read_positions"], clientid="reader-1")
    (session,) = found.sessions or []
    assert session.clientid == "reader-1" and session.state is not None and session.state.online
    assert session.state.node == "broker-a" and session.subscriptions == {"lag/#": 1}
    behind = the_position(found, "reader-1", "lag/#").lag
    assert (behind.messages, behind.at_least) == (7, False)
    assert 0.2 <= behind.seconds < 60  # the oldest unread message waited since it was stored
    assert found.share_groups is None and found.push_subscriptions is None  # not asked for

    # Counting stops at the cap and says so.
    capped = the_position(admin.consumers(["read_positions"], clientid="reader-1", lag_cap=1), "reader-1", "lag/#")
    assert capped.lag.at_least and 1 <= capped.lag.messages < 7

    messages = admin.fetch_offline("reader-1", "lag/#", max_count=100)
    assert len(messages) == 7
    for m in messages[:4]:
        admin.ack("reader-1", "lag/#", m)
    half = the_position(admin.consumers(["read_positions"], clientid="reader-1"), "reader-1", "lag/#").lag
    # Acknowledging moves the position per shard up to the message: what is behind it in its shard is read.
    assert 0 < half.messages < 7
    for m in messages:
        admin.ack("reader-1", "lag/#", m)
    done = the_position(admin.consumers(["read_positions"], clientid="reader-1"), "reader-1", "lag/#").lag
    assert (done.messages, done.at_least, done.seconds) == (0, False, 0.0)


def test_a_share_group_shows_its_members_and_lag(admin: Client) -> None:
    a = SharedSubscription(admin, "lagging", "jobs/#", "m-a")
    b = SharedSubscription(admin, "lagging", "jobs/#", "m-b")
    for member in (a, b, a):
        member.join()
    publish(admin, "jobs/x", 12)
    found = admin.consumers(["share_groups"], group="lagging")
    (group,) = found.share_groups or []
    assert (group.group, group.topic_filter, group.members) == ("lagging", "jobs/#", ["m-a", "m-b"])
    assert group.position_clientid == "$share/lagging"
    assert (group.lag.messages, group.lag.at_least) == (12, False) and group.lag.seconds > 0
    seen: Counter[bytes] = Counter()
    deadline = time.monotonic() + 30
    while len(seen) < 12 and time.monotonic() < deadline:
        for member in (a, b):
            for m in member.fetch(25):
                seen[m.payload] += 1
                member.ack(m)
    assert len(seen) == 12
    (drained,) = admin.consumers(["share_groups"], group="lagging").share_groups or []
    assert drained.lag.messages == 0
    # The group's position is a read position too, under its pseudo-client.
    positions = admin.consumers(["read_positions"], group="lagging").read_positions or []
    assert [(p.clientid, p.topic_filter) for p in positions] == [("$share/lagging", "jobs/#")]


def test_a_push_subscription_shows_while_open_with_its_lag_and_goes_when_closed(
    cluster: LocalCluster, admin: Client
) -> None:
    sender = "push-sender"
    shard = shard_of(sender, N_SHARDS)
    admin.store_batch([Message(topic="push/t", payload=b"%d" % i, sender=sender, qos=1) for i in range(30)], sync=True)

    def mine(found: Consumers) -> list[consumer_calls.PushInfo]:
        return [p for p in found.push_subscriptions or [] if p.topic_filter == "push/#"]

    with cluster.client(timeout_s=30) as reader:
        # A window of 5: the node sends 5 of the shard's 30 messages, then waits for credit (the batch is not read).
        with reader.follow("push/#", window=5, shards=[shard]) as sub:
            wait_until("the push subscription listed", lambda: mine(admin.consumers(["push_subscriptions"])), 20)
            time.sleep(0.5)
            (place,) = mine(admin.consumers(["push_subscriptions"]))
            assert place.shard == shard and place.subscriptions == 1 and place.node in cluster.nodes
            assert place.lag.messages + 5 >= 30 and place.lag.messages <= 30 and not place.lag.at_least
            assert place.lag.seconds > 0 and place.peer and sub is not None
            # The serving node's metrics have it too: one series for the filter on that shard.
            url = cluster.nodes[place.node].metrics_url
            assert url is not None
            key = ("mqds_consumer_lag_messages", (("consumer", "push/#"), ("kind", "push"), ("shard", str(shard))))
            assert _scrape(url)[key] + 5 >= 30
        wait_until("the push subscription gone", lambda: not mine(admin.consumers(["push_subscriptions"])), 20)


def test_push_subscriptions_come_page_by_page_each_once(
    cluster: LocalCluster, admin: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    with cluster.client(timeout_s=30) as reader:
        subs = [reader.follow(f"paged/{i}/#", window=1) for i in range(3)]  # each on every shard: 12 places
        try:

            def listed() -> list[tuple[str, int, int, str]]:
                found = admin.consumers(["push_subscriptions"]).push_subscriptions or []
                return [(p.node, p.call, p.shard, p.topic_filter) for p in found if p.topic_filter.startswith("paged/")]

            wait_until("every paged subscription listed", lambda: len(listed()) == 3 * N_SHARDS or None, 20)
            whole = sorted(listed())
            monkeypatch.setattr(consumer_calls, "PAGE", 1)  # a page per place: each node's list goes on page by page
            paged = listed()
            assert sorted(paged) == whole and len(set(paged)) == len(paged)
        finally:
            for sub in subs:
                sub.close()


def test_the_asyncio_client_lists_consumers_too(cluster: LocalCluster, admin: Client) -> None:
    admin.client_connected("aio-reader", "broker-z")

    async def listing() -> Consumers:
        async with AsyncClient(
            cluster.addresses, settings=ConnectionSettings(timeout_s=30, cluster_secret=cluster.secret)
        ) as c:
            return await c.consumers(["sessions"], clientid="aio-reader")

    found = asyncio.run(listing())
    assert [(s.clientid, s.state.node if s.state else None) for s in found.sessions or []] == [
        ("aio-reader", "broker-z")
    ]


def _leader_stub(cluster: LocalCluster, shard: int) -> spb_grpc.SessionsStub:
    leader = cluster.wait_for_leader(shard)
    return spb_grpc.SessionsStub(cluster._channel(leader))


def test_pages_list_every_consumer_exactly_once(
    cluster: LocalCluster, admin: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    connected = {f"page-{i:02d}" for i in range(23)}
    for clientid in sorted(connected):
        admin.client_connected(clientid, "broker-p")
        admin.subscribe(clientid, f"pages/{clientid}/#", 1)
        admin.start_read_position(clientid, f"pages/{clientid}/#")
    only_subscribed = {f"page-sub-{i}" for i in range(4)}  # subscriptions but no client state
    for clientid in sorted(only_subscribed):
        admin.subscribe(clientid, "pages/#", 0)
    monkeypatch.setattr(consumer_calls, "PAGE", 3)  # pages of 3: many rounds, each shard in several pages
    found = admin.consumers(["sessions", "read_positions"], clientid_prefix="page-")
    sessions = [s.clientid for s in found.sessions or []]
    assert sorted(sessions) == sorted(connected | only_subscribed) and len(set(sessions)) == len(sessions)
    assert all((s.state is None) == (s.clientid in only_subscribed) for s in found.sessions or [])
    pairs = [(p.clientid, p.topic_filter) for p in found.read_positions or []]
    assert sorted(pairs) == sorted((c, f"pages/{c}/#") for c in connected)

    # One shard through the raw call, two entries a page: each start goes on where the last page stopped.
    shard = shard_of("page-00", N_SHARDS)
    stub = _leader_stub(cluster, shard)
    secret = [("x-mqds-cluster-secret", cluster.secret)]
    listed: list[str] = []
    starts: list[spb.ConsumerPageStart] = []
    for _ in range(100):
        answer = stub.ListConsumers(
            spb.ListConsumersRequest(
                kind=spb.SESSIONS, shards=[shard], starts=starts, max_count=2, clientid_prefix="page-"
            ),
            timeout=10,
            metadata=secret,
        )
        assert len(answer.sessions) <= 2
        listed += [s.clientid for s in answer.sessions]
        if not answer.unfinished:
            break
        starts = list(answer.unfinished)
    expected = {c for c in connected | only_subscribed if shard_of(c, N_SHARDS) == shard}
    assert sorted(listed) == sorted(expected) and len(listed) == len(set(listed))


def test_a_page_is_cut_at_the_nodes_answer_bound_and_goes_on_from_there(cluster: LocalCluster, admin: Client) -> None:
    # Sessions of about 30 KiB each (ten subscriptions with 3,000-byte filters): two fit in an answer.
    big = [c for c in (f"big-{i}" for i in range(40)) if shard_of(c, N_SHARDS) == 1][:5]
    for clientid in big:
        admin.client_connected(clientid, "broker-b")
        for j in range(10):
            admin.subscribe(clientid, f"{clientid}/{j}/" + "x" * 3000, 1)
    stub = _leader_stub(cluster, 1)
    secret = [("x-mqds-cluster-secret", cluster.secret)]
    listed: list[str] = []
    starts: list[spb.ConsumerPageStart] = []
    pages = 0
    for _ in range(20):
        pages += 1
        request = spb.ListConsumersRequest(
            kind=spb.SESSIONS, shards=[1], starts=starts, max_count=1000, clientid_prefix="big-"
        )
        answer = stub.ListConsumers(request, timeout=10, metadata=secret)
        assert answer.ByteSize() <= ANSWER_BYTES and len(answer.sessions) >= 1
        listed += [s.clientid for s in answer.sessions]
        if not answer.unfinished:
            break
        starts = list(answer.unfinished)
    assert listed == sorted(big) and pages >= 3  # every one, once, in order, over several pages
    found = admin.consumers(["sessions"], clientid_prefix="big-").sessions or []
    assert [s.clientid for s in found] == sorted(big) and all(len(s.subscriptions) == 10 for s in found)
    # One session larger than an answer cannot be listed: refused with what to do, not cut or dropped.
    for j in range(20):
        admin.subscribe(big[0], f"{big[0]}/more/{j}/" + "y" * 3000, 1)
    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.ListConsumers(
                spb.ListConsumersRequest(kind=spb.SESSIONS, shards=[1], max_count=5, clientid=big[0]),
                timeout=10,
                metadata=secret,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "one consumer's entry would take more than" in (err.value.details() or "")
    finally:
        for clientid in big:
            admin.forget_session(clientid)


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (spb.ListConsumersRequest(kind=spb.SESSIONS, max_count=0), "max_count is 0"),
        (spb.ListConsumersRequest(kind=spb.SESSIONS, max_count=1_000_000), "max_count is 1,000,000"),
        (spb.ListConsumersRequest(kind=spb.SHARE_GROUPS, max_count=5, group="a/b"), "group 'a/b'"),
        (spb.ListConsumersRequest(kind=17, max_count=5), "kind 17"),  # type: ignore[arg-type]
        (spb.ListConsumersRequest(kind=spb.SESSIONS, max_count=5, clientid="a\x00b"), "without NUL"),
        (spb.ListConsumersRequest(kind=spb.PUSH_SUBSCRIPTIONS, max_count=5, lag_cap=10**9), "lag_cap"),
        (
            spb.ListConsumersRequest(kind=spb.PUSH_SUBSCRIPTIONS, max_count=5, starts=[{"shard": 0, "start": b"x"}]),
            "not one a ListConsumers answer gave",
        ),
    ],
)
def test_bad_listings_are_refused_with_what_was_wrong(
    cluster: LocalCluster, request_: spb.ListConsumersRequest, words: str
) -> None:
    stub = spb_grpc.SessionsStub(cluster._channel("n1"))
    secret = [("x-mqds-cluster-secret", cluster.secret)]
    if request_.kind != spb.PUSH_SUBSCRIPTIONS and request_.kind in spb.ConsumerKind.values():
        request_.shards.extend([s for s, leader in cluster.leaders().items() if leader == "n1"][:1] or [0])
    with pytest.raises(grpc.RpcError) as err:
        stub.ListConsumers(request_, timeout=10, metadata=secret)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert words in (err.value.details() or "")


def test_a_bad_start_and_bad_lag_requests_are_refused(cluster: LocalCluster) -> None:
    stub = _leader_stub(cluster, 0)
    secret = [("x-mqds-cluster-secret", cluster.secret)]
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        (
            "ListConsumers",
            spb.ListConsumersRequest(kind=spb.SESSIONS, shards=[0], max_count=5, starts=[{"shard": 0, "start": b"zz"}]),
            "not one a ListConsumers answer gave",
            invalid,
        ),
        (
            "ListConsumers",
            spb.ListConsumersRequest(kind=spb.SESSIONS, shards=[0], max_count=5, starts=[{"shard": 1, "start": b""}]),
            "do not list",
            invalid,
        ),
        ("ConsumerLag", spb.ConsumerLagRequest(shards=[0]), "items is empty", invalid),
        ("ConsumerLag", spb.ConsumerLagRequest(shards=[0], items=[{"topic_filter": "a/#/b"}]), "items[0]", invalid),
        (
            "ConsumerLag",
            spb.ConsumerLagRequest(shards=[0], items=[{"topic_filter": "a/#"}], cap=200_000),
            "cap is 200,000",
            invalid,
        ),
        (  # as every call naming a shard the cluster does not have (UNKNOWN_SHARD)
            "ConsumerLag",
            spb.ConsumerLagRequest(shards=[0], items=[{"topic_filter": "a/#", "after_us": {99: 1}}]),
            "shard 99 does not exist",
            grpc.StatusCode.NOT_FOUND,
        ),
    ]
    for method, request, words, code in cases:
        with pytest.raises(grpc.RpcError) as err:
            getattr(stub, method)(request, timeout=10, metadata=secret)
        assert err.value.code() == code, (method, err.value.details())
        assert words in (err.value.details() or ""), (method, err.value.details())


def test_listing_consumers_needs_the_admin_role(cluster: LocalCluster) -> None:
    stub = spb_grpc.SessionsStub(grpc.insecure_channel(cluster.addresses[0]))
    with pytest.raises(grpc.RpcError) as err:
        stub.ListConsumers(spb.ListConsumersRequest(kind=spb.SESSIONS, max_count=5), timeout=10)
    assert err.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def test_the_command_prints_tables_and_json(
    cluster: LocalCluster, admin: Client, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    admin.client_connected("cli-reader", "broker-c")
    admin.subscribe("cli-reader", "cli/#", 1)
    admin.start_read_position("cli-reader", "cli/#")
    publish(admin, "cli/x", 4)
    monkeypatch.setenv("MQDS_CLUSTER_SECRET", cluster.secret)
    endpoints = ",".join(cluster.addresses)
    assert cli_main(["consumers", "--endpoints", endpoints, "--clientid", "cli-reader"]) == 0
    out = capsys.readouterr().out
    assert "SESSIONS (1)" in out and "READ POSITIONS (1)" in out
    row = next(line for line in out.splitlines() if line.startswith("cli-reader") and "cli/#" in line and "4" in line)
    assert "online" not in row  # the read positions' row: clientid, filter, behind
    assert cli_main(["consumers", "--endpoints", endpoints, "--clientid", "cli-reader", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["sessions"][0]["clientid"] == "cli-reader" and data["sessions"][0]["state"]["node"] == "broker-c"
    assert data["read_positions"][0]["lag"]["messages"] == 4 and data["share_groups"] is None
    assert cli_main(["status", "--endpoints", endpoints, "--consumers"]) in (0, 3)
    assert "consumers:" in capsys.readouterr().out
    # Without the secret the nodes refuse it, and the command says so.
    monkeypatch.delenv("MQDS_CLUSTER_SECRET")
    monkeypatch.setenv("MQDS_CLUSTER_DIR", str(cluster.base_dir / "nowhere"))
    assert cli_main(["consumers", "--endpoints", endpoints]) != 0


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("mqds_consumer")
    }


def test_the_lag_metrics_have_bounded_labels(cluster: LocalCluster, admin: Client) -> None:
    groups = [f"metric-{i}" for i in range(5)]
    for i, name in enumerate(groups):  # group i is behind by i + 1 messages, on a filter of its own
        SharedSubscription(admin, name, f"metered/{i}/#", "m").join()
        publish(admin, f"metered/{i}/x", i + 1)

    def share_group_series() -> dict[tuple[str, str], float]:
        """(node, consumer) -> messages behind, of every node's share_group series."""
        out = {}
        for node in cluster.nodes.values():
            assert node.metrics_url is not None
            for (name, labels), value in _scrape(node.metrics_url).items():
                if name == "mqds_consumer_lag_messages" and dict(labels)["kind"] == "share_group":
                    out[(node.node_id, dict(labels)["consumer"])] = value
        return out

    # Measured from the replicas of the node that keeps each group, once they applied the last writes.
    top = "$share/metric-4/metered/4/#"

    def settled() -> dict[tuple[str, str], float] | None:
        found = share_group_series()
        return found if 5 in [v for (_, c), v in found.items() if c == top] else None

    series = wait_until("the furthest behind group's own series at 5", settled, 20)
    # At most consumer_lag_metric_top (2) groups of each node have series of their own, plus one _other.
    assert max(Counter(node for node, _ in series).values()) <= 3
    named = sum(v for (_, c), v in series.items() if c.startswith("$share/metric-"))
    others = sum(v for (_, c), v in series.items() if c == "_other")
    assert named + others >= sum(range(1, 6))
    counted = 0.0
    for node in cluster.nodes.values():
        assert node.metrics_url is not None
        counted += sum(
            v
            for (name, labels), v in _scrape(node.metrics_url).items()
            if name == "mqds_consumers" and dict(labels)["kind"] == "share_group"
        )
    assert counted >= len(groups)
