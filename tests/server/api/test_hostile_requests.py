"""Well-formed but hostile requests: each gets a clear refusal or a bounded answer, never INTERNAL.

Every request goes over raw gRPC (stubs built from ``mqds.v1``), so the
client library's own checks cannot hide what the node does. After each test
the nodes answer a liveness check within a second, a normal store and read
still work, and the nodes' memory (VmRSS) grew by a bounded amount.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import message as protobuf_message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import rss_bytes

from mqds.client import Client, Message
from mqds.protocol.errors import Reason, from_rpc_error
from mqds.protocol.sharding import shard_of
from mqds.server.raft.cluster_auth import SECRET_HEADER
from mqds.server.storage import IteratorState
from mqds.tools.local_cluster import LocalCluster
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb

pytestmark = [pytest.mark.integration]

MiB = 1024 * 1024
N_SHARDS = 4
# The node's default max_answer_bytes, plus one message of up to 1 MiB (an
# answer always carries at least one) and its envelope.
ANSWER_BOUND = 16 * MiB + 2 * MiB
U32 = 2**32 - 1
U64 = 2**64 - 1
_OPTIONS = [("grpc.max_send_message_length", 512 * MiB), ("grpc.max_receive_message_length", 512 * MiB)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("hostile") / "c", 3, n_shards=N_SHARDS) as c:
        c.start()
        with Client(c.addresses, timeout_s=30) as client:
            client.store_batch([Message(f"seed/{i}", b"s", sender=f"seed{i}") for i in range(8)])
        yield c


@pytest.fixture(scope="module")
def channels(cluster: LocalCluster) -> Iterator[list[grpc.Channel]]:
    # The cluster secret lets the admin calls (AddGeneration) in.
    interceptor = _Secret(cluster.secret)
    opened = [
        grpc.intercept_channel(grpc.insecure_channel(address, options=_OPTIONS), interceptor)
        for address in cluster.addresses
    ]
    yield opened
    for channel in opened:
        channel.close()


class _Secret(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, secret: str) -> None:
        self.secret = secret

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        metadata = [*(details.metadata or ()), (SECRET_HEADER, self.secret)]
        return continuation(details._replace(metadata=metadata), request)


# While a shard elects (or the balancer hands its leadership back), every
# replica answers NO_LEADER: a retriable answer that any caller waits out, as
# the client library does. Once failed CI: GetStreams right after a 24 MiB
# batch found all three replicas between leaders.
LEADER_WAIT_S = 15.0


def call(channels: list[grpc.Channel], service: str, method: str, request: protobuf_message.Message) -> bytes:
    """The answer's bytes from the shard's leader; raises the RpcError of any other refusal.

    Redirects and "no leader now" are tried again on every node for up to
    ``LEADER_WAIT_S``, then the last one is raised.
    """
    raw = request.SerializeToString()
    deadline = time.monotonic() + LEADER_WAIT_S
    while True:
        last: grpc.RpcError | None = None
        for channel in channels:
            stub = channel.unary_unary(f"/mqds.v1.{service}/{method}")
            try:
                return bytes(stub(raw, timeout=30))
            except grpc.RpcError as err:
                last = err
                if from_rpc_error(err).reason not in (Reason.NOT_LEADER, Reason.NO_LEADER, Reason.NOT_HOSTED):
                    raise
        assert last is not None
        if time.monotonic() >= deadline:
            raise last
        time.sleep(0.1)


def refused(
    channels: list[grpc.Channel], service: str, method: str, request: protobuf_message.Message
) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        call(channels, service, method, request)
    err = exc.value
    assert err.code() != grpc.StatusCode.INTERNAL, err.details()
    return err


def nodes_rss_bytes(cluster: LocalCluster) -> int:
    """The nodes' resident memory, summed."""
    pids = [node.pid for node in cluster.nodes.values()]
    assert None not in pids
    return sum(rss_bytes(pid) for pid in pids if pid is not None)


class Watch:
    """The nodes' memory from a baseline on, and how much it may grow."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.bound = 64 * MiB
        self.before = nodes_rss_bytes(cluster)

    def allow(self, bound: int) -> None:
        self.bound = bound

    def rebase(self) -> None:
        """Measure from now: what the test set up (stored) is not what it checks."""
        self.before = nodes_rss_bytes(self.cluster)


@pytest.fixture
def stays_well(cluster: LocalCluster) -> Iterator[Watch]:
    """Checks after the test that the nodes live, serve, and grew by at most the bound the test set."""
    watch = Watch(cluster)
    yield watch
    grown = nodes_rss_bytes(cluster) - watch.before
    assert grown <= watch.bound, f"the nodes grew by {grown / MiB:.0f} MiB"
    for address in cluster.addresses:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
        started = time.monotonic()
        assert stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == 1
        assert time.monotonic() - started < 1
    with Client(cluster.addresses, timeout_s=30) as client:
        (stored,) = client.store_batch([Message("after/check", b"ok", sender="after")])
        assert any(m.timestamp_us == stored.timestamp_us for m in client.replay("after/check"))


# -- repeated fields: de-duplicated and capped --------------------------------------------

CAPPED = [
    ("Storage", "GetStreams", pb.GetStreamsRequest(topic_filter="#", shards=[1] * 2000), "shards"),
    ("Storage", "GetFences", pb.GetFencesRequest(shards=[0] * 200_000), "shards"),
    ("Storage", "ListGenerations", pb.ListGenerationsRequest(shards=[1] * 2000), "shards"),
    ("Storage", "AddGeneration", pb.AddGenerationRequest(shards=[3] * 100), "shards"),
    ("Sessions", "ClientsOnNode", spb.ClientsOnNodeRequest(node="b1", shards=[1] * 2000), "shards"),
    ("Sessions", "GetRetained", spb.GetRetainedRequest(topic_filter="#", shards=[1] * 2000), "shards"),
    ("Sessions", "FetchMessages", spb.FetchMessagesRequest(topic_filter="#", max_count=5, shards=[1] * 2000), "shards"),
    (
        "Sessions",
        "FetchMessages",
        spb.FetchMessagesRequest(topic_filter="#", max_count=5, shards=[0], after_us={i: 1 for i in range(2000)}),
        "after_us",
    ),
]


@pytest.mark.parametrize(("service", "method", "request_", "field"), CAPPED, ids=[f"{c[1]}-{c[3]}" for c in CAPPED])
def test_repeated_fields_are_capped(
    channels: list[grpc.Channel],
    stays_well: Watch,
    service: str,
    method: str,
    request_: protobuf_message.Message,
    field: str,
) -> None:
    started = time.monotonic()
    err = refused(channels, service, method, request_)
    assert time.monotonic() - started < 5
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert field in err.details() and f"at most {N_SHARDS}" in err.details(), err.details()


def test_duplicate_shards_are_answered_once(channels: list[grpc.Channel], stays_well: Watch) -> None:
    fences = pb.GetFencesResponse.FromString(
        call(channels, "Storage", "GetFences", pb.GetFencesRequest(shards=[2, 1, 2, 1], stale_ok=True))
    )
    assert [f.shard for f in fences.fences] == [1, 2]
    listed = pb.ListGenerationsResponse.FromString(
        call(channels, "Storage", "ListGenerations", pb.ListGenerationsRequest(shards=[2, 2, 2], stale_ok=True))
    )
    assert len({(g.shard, g.generation) for g in listed.generations}) == len(listed.generations)


# -- a request over max_request_bytes ------------------------------------------------------


def test_request_over_max_request_bytes_is_refused_before_anything_is_proposed(
    cluster: LocalCluster, channels: list[grpc.Channel], stays_well: Watch
) -> None:
    # The receive limit was twice max_request_bytes: the batch passed it, was
    # proposed, could not be sent to the followers and cost two elections.
    stays_well.allow(320 * MiB)  # the 70 MiB the nodes received, and gRPC's copies of it
    with Client(cluster.addresses, timeout_s=30) as client:
        terms_before = {v.shard: v.term for v in client.cluster_map().vnodes}
    payload = b"p" * (MiB - 1024)
    request = pb.StoreBatchRequest(messages=[pb.Message(topic="big/t", payload=payload, sender="big")] * 70)
    assert request.ByteSize() > 64 * MiB
    started = time.monotonic()
    err = refused(channels, "Storage", "StoreBatch", request)
    assert time.monotonic() - started < 5
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert from_rpc_error(err).retriable is False
    assert "max_request_bytes" in err.details(), err.details()
    with Client(cluster.addresses, timeout_s=30) as client:
        terms_after = {v.shard: v.term for v in client.cluster_map().vnodes}
    # No election (the balancer handing a leader back may add one term).
    assert all(terms_after[shard] - terms_before[shard] <= 1 for shard in terms_before), (terms_before, terms_after)


# -- answers bounded in bytes --------------------------------------------------------------


def test_next_and_fetch_answers_are_bounded_and_continue(
    cluster: LocalCluster, channels: list[grpc.Channel], stays_well: Watch
) -> None:
    payload = b"n" * (MiB - 1024)
    with Client(cluster.addresses, timeout_s=60) as client:
        stored = client.store_batch([Message("large/n", payload, sender="large", qos=1) for _ in range(24)])
    stays_well.rebase()
    # Reading 24 MiB three ways fills the block caches (64 MiB a node) and
    # gRPC's buffers: the three nodes grew by 210-280 MiB in all over
    # 2026-11-26's runs, and by 236-312 MiB alone and 320 MiB once in the
    # whole suite on 2026-11-27 (the code of the day before and the new alike:
    # the allocator's spread, and the file's earlier tests leave their share).
    # A 24 MiB answer built whole took as much again, well over this bound.
    stays_well.allow(384 * MiB)
    shard = shard_of("large", N_SHARDS)
    want = [m.timestamp_us for m in stored]

    streams = pb.GetStreamsResponse.FromString(
        call(channels, "Storage", "GetStreams", pb.GetStreamsRequest(topic_filter="large/n", shards=[shard]))
    )
    (ranked,) = streams.streams
    made = pb.MakeIteratorResponse.FromString(
        call(channels, "Storage", "MakeIterator", pb.MakeIteratorRequest(stream=ranked.stream, topic_filter="large/n"))
    )
    iterator, got, answers = made.iterator, [], 0
    while True:
        raw = call(channels, "Storage", "Next", pb.NextRequest(iterator=iterator, batch_size=1000))
        assert len(raw) <= ANSWER_BOUND, f"Next answered {len(raw)} bytes"
        answer = pb.NextResponse.FromString(raw)
        if not answer.messages:
            break
        answers += 1
        got.extend(m.timestamp_us for m in answer.messages)
        iterator = answer.iterator
    assert got == want and answers >= 2

    after: dict[int, int] = {}
    fetched: list[int] = []
    while True:
        request = spb.FetchMessagesRequest(topic_filter="large/#", shards=[shard], after_us=after, max_count=1000)
        raw = call(channels, "Sessions", "FetchMessages", request)
        assert len(raw) <= ANSWER_BOUND, f"FetchMessages answered {len(raw)} bytes"
        messages = spb.FetchMessagesResponse.FromString(raw).messages
        if not messages:
            break
        fetched.extend(m.timestamp_us for m in messages)
        after = {shard: messages[-1].timestamp_us}
    assert fetched == want

    with Client(cluster.addresses, timeout_s=60) as client:  # the client's replay just continues
        assert [m.timestamp_us for m in client.replay("large/n", batch_size=1000)] == want


def test_an_answer_that_cannot_be_bounded_is_refused_clearly(
    cluster: LocalCluster, channels: list[grpc.Channel], stays_well: Watch
) -> None:
    # Retained messages live in their topic's shard: all of these in one, so
    # its leader answers for all of them.
    topics = [t for t in (f"retained/{i}" for i in range(400)) if shard_of(t, N_SHARDS) == 0][:20]
    payload = b"r" * (MiB - 1024)
    with Client(cluster.addresses, timeout_s=60) as client:
        for topic in topics:
            client.retain(Message(topic, payload, sender="r"))
    stays_well.rebase()
    err = refused(channels, "Sessions", "GetRetained", spb.GetRetainedRequest(topic_filter="retained/#", shards=[0]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "max_answer_bytes" in err.details(), err.details()
    # A narrower filter fits.
    request = spb.GetRetainedRequest(topic_filter=topics[0], shards=[0])
    assert len(spb.GetRetainedResponse.FromString(call(channels, "Sessions", "GetRetained", request)).messages) == 1


# -- odd values: a clear status, never INTERNAL ----------------------------------------------


def _forged_iterator(topic_filter: str) -> pb.IteratorToken:
    # The checksum is not a signature: anyone can build a token that decodes.
    state = IteratorState(0, 1, 1, topic_filter, 0)
    return pb.IteratorToken(shard=0, generation=1, state=state.encode())


_MANY_PROPERTIES = [pb.UserProperty(key="k", value="v")] * 100_000
_HUGE_PROPERTY = [pb.UserProperty(key="k", value="v" * 200_000)]

ODD: list[tuple[str, str, str, protobuf_message.Message, grpc.StatusCode, str]] = [
    ("empty batch", "Storage", "StoreBatch", pb.StoreBatchRequest(), grpc.StatusCode.OK, ""),
    (
        "empty batch with producer",
        "Storage",
        "StoreBatch",
        pb.StoreBatchRequest(producer_id="p", sequence=U64),
        grpc.StatusCode.OK,
        "",
    ),
    (
        "many properties",
        "Storage",
        "StoreBatch",
        pb.StoreBatchRequest(messages=[pb.Message(topic="t", sender="s", properties=_MANY_PROPERTIES)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "properties",
    ),
    (
        "huge property",
        "Storage",
        "StoreBatch",
        pb.StoreBatchRequest(messages=[pb.Message(topic="t", sender="s", properties=_HUGE_PROPERTY)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "properties",
    ),
    (
        "retained with many properties",
        "Sessions",
        "Retain",
        spb.RetainRequest(message=pb.Message(topic="r/p", payload=b"x", properties=_MANY_PROPERTIES)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "properties",
    ),
    (
        "fetch after the last timestamp",
        "Sessions",
        "FetchMessages",
        spb.FetchMessagesRequest(topic_filter="#", max_count=U32, shards=[0], after_us={0: U64}),
        grpc.StatusCode.OK,
        "",
    ),
    (
        "forged iterator with a bad filter",
        "Storage",
        "Next",
        pb.NextRequest(iterator=_forged_iterator("a/#/b"), batch_size=U32),
        grpc.StatusCode.INVALID_ARGUMENT,
        "filter",
    ),
    (
        "fence in the far future",
        "Storage",
        "Next",
        pb.NextRequest(iterator=_forged_iterator("#"), batch_size=1, fence_us=U64),
        grpc.StatusCode.INVALID_ARGUMENT,
        "fence_us",
    ),
]


@pytest.mark.parametrize(("what", "service", "method", "request_", "code", "words"), ODD, ids=[o[0] for o in ODD])
def test_odd_requests_get_a_clear_status(
    channels: list[grpc.Channel],
    stays_well: Watch,
    what: str,
    service: str,
    method: str,
    request_: protobuf_message.Message,
    code: grpc.StatusCode,
    words: str,
) -> None:
    if code == grpc.StatusCode.OK:
        assert len(call(channels, service, method, request_)) < 1024
        return
    err = refused(channels, service, method, request_)
    assert err.code() == code, (what, err.code(), err.details())
    assert words in err.details(), err.details()


# -- depth: nothing recursive runs on the depth of a topic or filter ---------------------


def test_a_queue_acknowledgement_of_a_deep_topic_leaves_its_shard_serving(
    cluster: LocalCluster, channels: list[grpc.Channel], stays_well: Watch
) -> None:
    """A 1,500-level topic, then Ack(mode=QUEUE) with it as the filter: applying the entry raised
    RecursionError on every replica, the group retried that committed entry forever (after restarts
    too), and every write and linearizable read of the shard timed out while status said OK."""
    stays_well.allow(128 * MiB)
    topic = "/".join(f"l{i}" for i in range(1_500))
    sender = "deep-sender"
    answer = pb.StoreBatchResponse.FromString(
        call(
            channels,
            "Storage",
            "StoreBatch",
            pb.StoreBatchRequest(messages=[pb.Message(topic=topic, payload=b"d", sender=sender)]),
        )
    )
    (position,) = answer.positions
    shard = shard_of(sender, N_SHARDS)
    ack = spb.AckRequest(
        clientid="q", topic_filter=topic, mode=spb.QUEUE, shard=shard, timestamp_us=position.timestamp_us
    )
    call(channels, "Sessions", "Ack", ack)
    # Filters of that depth: answered, not INTERNAL.
    for deep_filter in (topic, "/".join(["+"] * 1_500), "/".join(["+"] * 1_200) + "/#"):
        streams = pb.GetStreamsResponse.FromString(
            call(channels, "Storage", "GetStreams", pb.GetStreamsRequest(topic_filter=deep_filter, shards=[shard]))
        )
        assert streams.streams, deep_filter[:20]
    # The shard still takes writes and linearizable reads, on every replica's watch.
    with Client(cluster.addresses, timeout_s=15) as client:
        (stored,) = client.store_batch([Message("deep/after", b"x", sender=sender)])
        assert stored.shard == shard
        assert [m.payload for m in client.replay(topic)] == [b"d"]
    cluster.wait_ready(30)
    cluster.assert_replicas_identical(timeout_s=60, shards=[shard])
