"""Storage.StoreStream over raw gRPC: pipelined batches answered in order, its rules, flow control, group commit.

Raw stubs (no client library), so what is tested is what the node does with
whatever a client sends: acknowledgements in order with their positions,
clear statuses for a stream that breaks its rules (the node keeps serving
others), a stream left idle ended, a client that never reads its answers
held back instead of buffered for, and concurrent writes to one shard
sharing log entries (group commit).
"""

from __future__ import annotations

import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator

import grpc
import pytest

from mqds.client import Client, Message
from mqds.protocol.errors import Reason, from_rpc_error
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster
from mqds.v1 import storage_pb2 as pb
from mqds.v1 import storage_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration]

N_SHARDS = 2
WINDOW = 8
IDLE_S = 3.0
MAX_BATCH = 200
MiB = 1024 * 1024
SENDER = "stream-sender"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    args = [
        f"--store-stream-window={WINDOW}",
        f"--store-stream-idle-s={IDLE_S}",
        f"--max-batch-messages={MAX_BATCH}",
        f"--max-request-bytes={2 * MiB}",
        f"--max-answer-bytes={2 * MiB}",
        f"--max-payload-bytes={MiB}",
    ]
    with LocalCluster(tmp_path_factory.mktemp("stream") / "c", 3, n_shards=N_SHARDS, args=args, metrics=True) as c:
        c.start()
        yield c


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster.addresses, timeout_s=30) as c:
        yield c


def leader_stub(
    cluster: LocalCluster, client: Client, sender: str = SENDER, options: list[tuple[str, int]] | None = None
) -> pb_grpc.StorageStub:
    shard = shard_of(sender, N_SHARDS)
    leader = cluster.wait_for_leader(shard)
    channel = grpc.insecure_channel(cluster.nodes[leader].address, options=options or [])
    return pb_grpc.StorageStub(channel)


def frame(
    producer: str, sequence: int, n: int = 1, sender: str = SENDER, payload: bytes = b"p"
) -> pb.StoreStreamRequest:
    messages = [pb.Message(topic=f"stream/{sender}/{sequence}", payload=payload, sender=sender) for _ in range(n)]
    return pb.StoreStreamRequest(batch=pb.StoreBatchRequest(producer_id=producer, sequence=sequence, messages=messages))


def still_serving(client: Client) -> None:
    stored = client.store_batch([Message("stream/alive", b"x", sender="alive")], timeout_s=10)
    assert stored[0].timestamp_us > 0


def refused_with(stub: pb_grpc.StorageStub, frames: list[pb.StoreStreamRequest]) -> tuple[list[int], Reason, str]:
    """The sequences acknowledged before the stream ended, and the reason and message it ended with."""
    acked: list[int] = []
    with pytest.raises(grpc.RpcError) as exc:
        for answer in stub.StoreStream(iter(frames), timeout=30):
            acked.append(answer.sequence)
    err = exc.value
    assert err.code() != grpc.StatusCode.INTERNAL, err.details()
    mqds_err = from_rpc_error(err)
    return acked, mqds_err.reason, mqds_err.message


def test_acknowledgements_come_in_order_with_positions(cluster: LocalCluster, client: Client) -> None:
    stub = leader_stub(cluster, client)
    producer = uuid.uuid4().hex
    frames = [frame(producer, 10 + 3 * i, n=1 + i % 4) for i in range(300)]  # gaps in sequences are allowed
    answers = list(stub.StoreStream(iter(frames), timeout=60))
    assert [a.sequence for a in answers] == [f.batch.sequence for f in frames]
    stamps = []
    for f, answer in zip(frames, answers, strict=True):
        assert not answer.result.failures
        assert len(answer.result.positions) == len(f.batch.messages)
        stamps.extend(p.timestamp_us for p in answer.result.positions)
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    stored = {m.timestamp_us for m in client.replay(f"stream/{SENDER}/#", min(stamps))}
    assert set(stamps) <= stored


def test_a_resent_window_is_stored_once(cluster: LocalCluster, client: Client) -> None:
    """What a client does after a broken stream: the unacknowledged batches again, same sequences, new stream."""
    stub = leader_stub(cluster, client)
    producer = uuid.uuid4().hex
    frames = [frame(producer, i, n=2) for i in range(1, 51)]
    first = list(stub.StoreStream(iter(frames), timeout=60))
    again = list(stub.StoreStream(iter(frames[20:]), timeout=60))
    assert [a.result.positions for a in again] == [a.result.positions for a in first[20:]]
    since = min(p.timestamp_us for p in first[0].result.positions)
    topics = [
        m.topic
        for m in client.replay(f"stream/{SENDER}/#", since)
        if m.timestamp_us <= max(p.timestamp_us for p in first[-1].result.positions)
    ]
    assert sorted(topics) == sorted(m.topic for f in frames for m in f.batch.messages)


def test_a_sequence_out_of_order_ends_the_stream(cluster: LocalCluster, client: Client) -> None:
    stub = leader_stub(cluster, client)
    producer = uuid.uuid4().hex
    acked, reason, message = refused_with(stub, [frame(producer, 5), frame(producer, 6), frame(producer, 6)])
    assert acked == [5, 6]
    assert reason is Reason.OUT_OF_ORDER and "sequence 6 after 6" in message
    acked, reason, _ = refused_with(stub, [frame(producer, 9), frame(uuid.uuid4().hex, 10)])
    assert acked == [9] and reason is Reason.OUT_OF_ORDER
    still_serving(client)


def test_a_batch_without_producer_or_over_the_limits_ends_the_stream(cluster: LocalCluster, client: Client) -> None:
    stub = leader_stub(cluster, client)
    producer = uuid.uuid4().hex
    _, reason, message = refused_with(stub, [frame("", 1)])
    assert reason is Reason.INVALID_REQUEST and "producer_id" in message
    acked, reason, message = refused_with(stub, [frame(producer, 1), frame(producer, 2, n=MAX_BATCH + 1)])
    assert acked == [1] and reason is Reason.BATCH_TOO_LARGE and "max_batch_messages" in message
    big = frame(producer, 3, n=3, payload=b"x" * (MiB - 100))
    acked, reason, message = refused_with(stub, [big])
    assert reason is Reason.INVALID_REQUEST and "max_request_bytes" in message
    still_serving(client)


def test_a_frame_that_does_not_parse_ends_the_stream(cluster: LocalCluster, client: Client) -> None:
    shard = shard_of(SENDER, N_SHARDS)
    channel = grpc.insecure_channel(cluster.nodes[cluster.wait_for_leader(shard)].address)
    call = channel.stream_stream("/mqds.v1.Storage/StoreStream", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as exc:
        list(call(iter([b"\x0a\x05\xff\xff"]), timeout=30))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert from_rpc_error(exc.value).reason is Reason.MALFORMED_REQUEST
    still_serving(client)


def test_an_invalid_message_fails_alone_and_the_stream_goes_on(cluster: LocalCluster, client: Client) -> None:
    stub = leader_stub(cluster, client)
    producer = uuid.uuid4().hex
    bad = frame(producer, 2, n=3)
    bad.batch.messages[1].topic = "a/+/b"
    answers = list(stub.StoreStream(iter([frame(producer, 1), bad, frame(producer, 3)]), timeout=30))
    assert [a.sequence for a in answers] == [1, 2, 3]
    assert not any(a.result.failures for a in answers)
    (failure,) = answers[1].result.message_failures
    assert failure.index == 1
    assert failure.reason == Reason.INVALID_TOPIC.value and "wildcard" in failure.message.lower()
    assert [p.timestamp_us > 0 for p in answers[1].result.positions] == [True, False, True]


def test_an_idle_stream_is_ended(cluster: LocalCluster, client: Client) -> None:
    stub = leader_stub(cluster, client)
    producer = uuid.uuid4().hex
    release = threading.Event()

    def frames() -> Iterator[pb.StoreStreamRequest]:
        yield frame(producer, 1)
        release.wait(30)  # then sends nothing

    started = time.monotonic()
    acked = []
    try:
        with pytest.raises(grpc.RpcError) as exc:
            for answer in stub.StoreStream(frames(), timeout=30):
                acked.append(answer.sequence)
    finally:
        release.set()
    waited = time.monotonic() - started
    assert acked == [1]
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert from_rpc_error(exc.value).reason is Reason.STREAM_IDLE
    assert IDLE_S <= waited < IDLE_S + 10
    still_serving(client)


def test_a_client_that_does_not_read_its_acknowledgements_is_held_back(cluster: LocalCluster, client: Client) -> None:
    """The node reads at most its window ahead of its answers: the sender blocks, the node buffers a bounded amount.

    The client's own receive window is kept at HTTP/2's 64 KiB (no BDP
    probing), so the answers it does not read fill it within seconds; past
    that the node's sends wait, its window of unanswered batches fills, it
    stops reading, and the sender is held by flow control.
    """
    stub = leader_stub(cluster, client, options=[("grpc.http2.bdp_probe", 0)])
    producer = uuid.uuid4().hex
    total = 200_000
    pulled = 0

    def frames() -> Iterator[pb.StoreStreamRequest]:
        nonlocal pulled
        for sequence in range(1, total + 1):
            pulled += 1
            yield frame(producer, sequence, payload=b"z" * 200)

    answers = stub.StoreStream(frames(), timeout=120)
    # Nobody reads the answers: the sender must come to a stop.
    deadline = time.monotonic() + 30
    last = -1
    while pulled != last and time.monotonic() < deadline:
        last = pulled
        time.sleep(1.5)
    assert pulled == last, f"the sender was not held back: {pulled:,} batches sent and counting"
    assert pulled < 30_000, f"the client sent {pulled:,} batches though nothing was read"
    first = next(answers)
    assert first.sequence == 1
    answers.cancel()
    still_serving(client)


def test_concurrent_writes_to_one_shard_share_log_entries(cluster: LocalCluster, client: Client) -> None:
    """Group commit: one-message calls from many threads at once are logged several to an entry."""
    sender = "group-commit"
    shard = shard_of(sender, N_SHARDS)
    entries_before, commands_before = grouped(cluster, shard)
    concurrently(16, lambda n, i: client.store_batch([Message(f"gc/{n}/{i}", b"g", sender=sender)], timeout_s=30))
    entries, commands = grouped(cluster, shard)
    assert commands - commands_before >= 100, "concurrent writes to one shard were not grouped"
    assert entries - entries_before < commands - commands_before
    assert len(list(client.replay("gc/#"))) == 16 * 40


def test_concurrent_session_writes_share_log_entries_too(cluster: LocalCluster, client: Client) -> None:
    """Subscriptions and read positions of one client, written from many threads, are grouped and all kept."""
    clientid = "gc-session"
    shard = shard_of(clientid, N_SHARDS)
    (stored,) = client.store_batch([Message("gcs/topic", b"m", sender="gcs-pub")])
    entries_before, commands_before = grouped(cluster, shard)

    def write(n: int, i: int) -> None:
        client.subscribe(clientid, f"gcs/{n}/{i}/#", qos=1, timeout_s=30)
        client.ack(clientid, f"gcs/{n}/#", stored, timeout_s=30)

    concurrently(16, write)
    entries, commands = grouped(cluster, shard)
    assert commands - commands_before >= 100, "concurrent session writes were not grouped"
    assert entries - entries_before < commands - commands_before
    assert len(client.subscriptions(clientid)) == 16 * 40
    assert client.read_position(clientid, "gcs/3/#").found


def grouped(cluster: LocalCluster, shard: int) -> tuple[float, float]:
    """The shard leader's group-commit counters: entries that held several commands, and those commands."""
    url = cluster.nodes[cluster.wait_for_leader(shard)].metrics_url
    assert url is not None
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        for name in ("mqds_raft_group_commit_entries_total", "mqds_raft_group_commit_commands_total"):
            if line.startswith(f'{name}{{shard="{shard}"}}'):
                values[name] = float(line.split()[-1])
    return values.get("mqds_raft_group_commit_entries_total", 0.0), values.get(
        "mqds_raft_group_commit_commands_total", 0.0
    )


def concurrently(threads: int, work: Callable[[int, int], object], calls: int = 40) -> None:
    """``work(thread, i)`` for ``calls`` values of i in each of ``threads`` threads at once; re-raises a failure."""
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            for i in range(calls):
                work(n, i)
        except BaseException as err:  # reported below
            errors.append(err)

    started = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join(120)
    assert not errors, errors
