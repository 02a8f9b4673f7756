"""A bad message fails alone, and nothing stored can break a reader (a real 3-node cluster).

One publish with 1,025 user properties used to fail every message batched
with it, other callers' included (the node refused the whole batch); a
message whose ``qos`` came as a length-delimited field was stored with the
field as protobuf keeps an unknown one, and the client's C column reader (the
Spark source's) then refused every answer holding it. Here each bad message
fails by itself with its reason, the rest of its batch is stored, and what
is stored reads back, as messages and as columns.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from harness import sender_on

from mqds.client import Client, Message, aio
from mqds.client import errors as E
from mqds.client.core import wire_columns as wc
from mqds.client.core.pipeline import PipelineLimits
from mqds.protocol.errors import Reason, from_rpc_error
from mqds.protocol.sharding import shard_of
from mqds.protocol.wire import encode_message, length_delimited
from mqds.tools.local_cluster import LocalCluster
from mqds.v1 import storage_pb2 as pb

pytestmark = [pytest.mark.integration]

N_SHARDS = 2
MAX_PAYLOAD = 64 * 1024
TOO_MANY = [(f"k{i}", "v") for i in range(1025)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    args = [f"--max-payload-bytes={MAX_PAYLOAD}"]
    with LocalCluster(tmp_path_factory.mktemp("bad") / "c", 3, n_shards=N_SHARDS, args=args) as c:
        c.start()
        c.wait_leaders_settled()
        yield c


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster.addresses, timeout_s=30) as c:
        yield c


def leader_channel(cluster: LocalCluster, sender: str) -> grpc.Channel:
    leader = cluster.wait_for_leader(shard_of(sender, N_SHARDS))
    return grpc.insecure_channel(cluster.nodes[leader].address)


def raw_store(channel: grpc.Channel, request: bytes) -> pb.StoreBatchResponse:
    """StoreBatch with the request's bytes as given (a client's own encoding, or a forged one)."""
    call = channel.unary_unary(
        "/mqds.v1.Storage/StoreBatch", request_serializer=None, response_deserializer=pb.StoreBatchResponse.FromString
    )
    response: pb.StoreBatchResponse = call(request, timeout=30)
    return response


def batch_bytes(*messages: bytes, producer: str = "", sequence: int = 0) -> bytes:
    """A StoreBatchRequest of encoded messages (field 1 each), as a client sends it."""
    out = b"".join(length_delimited(b"\x0a", m) for m in messages)
    if producer:
        out += pb.StoreBatchRequest(producer_id=producer, sequence=sequence).SerializeToString()
    return out


def qos_as_bytes(topic: str, sender: str) -> bytes:
    """A message whose qos (field 4, a varint) came length-delimited: protobuf keeps it as an unknown field."""
    return encode_message(topic, b"forged", sender, 0, False) + b"\x22\x01\x01"


def replayed(client: Client, topic_filter: str) -> list[Message]:
    return list(client.replay(topic_filter))


def next_answers(cluster: LocalCluster, client: Client, topic_filter: str) -> list[bytes]:
    """Every Next answer of the filter's streams, as the shard's leader sent it (the bytes the column reader reads)."""
    answers = []
    for _, stream in client.get_streams(topic_filter):
        leader = cluster.nodes[cluster.wait_for_leader(stream.shard)].address
        with grpc.insecure_channel(leader) as channel:
            next_call = channel.unary_unary(
                "/mqds.v1.Storage/Next", request_serializer=pb.NextRequest.SerializeToString, response_deserializer=None
            )
            start = pb.IteratorStart(stream=stream.to_pb(), topic_filter=topic_filter)
            answers.append(next_call(pb.NextRequest(start=start, batch_size=1000), timeout=30))
    return answers


def test_a_pipelined_publish_with_too_many_user_properties_fails_alone(client: Client) -> None:
    """Concurrent calls share a batch; the one with 1,025 user properties fails, every other one is stored."""
    sender = "bad-pipe"
    tag = uuid.uuid4().hex[:8]
    with Client(client.endpoints, timeout_s=30, pipeline=PipelineLimits(max_batches_per_shard=1)) as writer:
        pending = [
            writer.store_async(
                Message(f"bad/pipe/{tag}", str(i).encode(), sender, qos=1, properties=TOO_MANY if i == 20 else ())
            )
            for i in range(60)
        ]
        futures.wait(pending, timeout=60)
        failed = [i for i, f in enumerate(pending) if f.exception() is not None]
        assert failed == [20], f"calls {failed} failed: one bad publish failed the calls batched with it"
        with pytest.raises(E.InvalidArgumentError) as refused:
            pending[20].result()
        assert refused.value.reason is Reason.INVALID_MESSAGE and "1,025 user properties" in str(refused.value)
        # A call of several messages: its bad one fails, its good ones are stored.
        with pytest.raises(E.PartialBatchError) as partial:
            writer.publish(
                [
                    Message(f"bad/pipe/{tag}", b"m0", sender),
                    Message(f"bad/pipe/{tag}", b"m1", sender, properties=TOO_MANY),
                    Message(f"bad/pipe/{tag}", b"m2", "bad-pipe-other"),
                ]
            )
    assert sorted(m.payload for m in partial.value.stored) == [b"m0", b"m2"]
    ((message, err),) = partial.value.failed
    assert message.payload == b"m1" and err.reason is Reason.INVALID_MESSAGE and not err.retriable
    stored = replayed(client, f"bad/pipe/{tag}")
    assert sorted(m.payload for m in stored) == sorted([str(i).encode() for i in range(60) if i != 20] + [b"m0", b"m2"])


def test_the_asyncio_pipeline_fails_a_bad_publish_alone(cluster: LocalCluster, client: Client) -> None:
    tag = uuid.uuid4().hex[:8]

    async def scenario() -> list[asyncio.Future[list[Message]]]:
        async with aio.Client(cluster.addresses, timeout_s=30) as writer:
            pending = [
                await writer.store_async(
                    Message(f"bad/aio/{tag}", str(i).encode(), "bad-aio", properties=TOO_MANY if i == 5 else ())
                )
                for i in range(20)
            ]
            await asyncio.wait(pending, timeout=60)
            return pending

    pending = asyncio.run(scenario())
    failed = [i for i, f in enumerate(pending) if f.exception() is not None]
    assert failed == [5], f"calls {failed} failed: one bad publish failed the calls batched with it"
    assert isinstance(pending[5].exception(), E.InvalidArgumentError)
    assert len(replayed(client, f"bad/aio/{tag}")) == 19


def test_a_store_batch_with_bad_messages_stores_the_good_ones_and_names_the_bad(
    cluster: LocalCluster, client: Client
) -> None:
    """One shard's batch from the request's own bytes: the bad messages are dropped from the logged command."""
    sender = sender_on(0, "bad-batch", N_SHARDS)
    tag = uuid.uuid4().hex[:8]
    topic = f"bad/batch/{tag}"
    messages = [
        encode_message(topic, b"good-0", sender, 1, False),
        encode_message(topic, b"props", sender, 1, False, TOO_MANY),
        encode_message(topic, b"good-1", sender, 1, False),
        encode_message(topic, b"x" * (MAX_PAYLOAD + 1), sender, 1, False),
        encode_message(f"{topic}/+", b"wildcard", sender, 1, False),
        encode_message(topic, b"good-2", sender, 2, False),
    ]
    with leader_channel(cluster, sender) as channel:
        answer = raw_store(channel, batch_bytes(*messages, producer=uuid.uuid4().hex, sequence=1))
    assert [p.timestamp_us > 0 for p in answer.positions] == [True, False, True, False, False, True]
    assert {p.shard for p in answer.positions} == {0}
    assert not answer.failures
    failures = {f.index: f for f in answer.message_failures}
    assert sorted(failures) == [1, 3, 4]
    assert failures[1].reason == Reason.INVALID_MESSAGE.value and "1,025 user properties" in failures[1].message
    assert failures[3].reason == Reason.PAYLOAD_TOO_LARGE.value and "max_payload_bytes" in failures[3].message
    assert failures[4].reason == Reason.INVALID_TOPIC.value and "wildcard" in failures[4].message
    assert [m.payload for m in replayed(client, f"{topic}/#")] == [b"good-0", b"good-1", b"good-2"]


def test_a_batch_of_only_bad_messages_is_refused_with_the_first_ones_status(cluster: LocalCluster) -> None:
    sender = sender_on(1, "bad-all", N_SHARDS)
    messages = [encode_message("bad/all/+", b"", sender, 0, False), encode_message("bad/all", b"", sender, 3, False)]
    with leader_channel(cluster, sender) as channel, pytest.raises(grpc.RpcError) as exc:
        raw_store(channel, batch_bytes(*messages))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    err = from_rpc_error(exc.value)
    assert err.reason is Reason.INVALID_TOPIC and err.message.startswith("message 0:")


def test_a_message_with_a_mistyped_field_is_refused_and_what_is_stored_reads_as_columns(
    cluster: LocalCluster, client: Client
) -> None:
    """qos sent length-delimited (and a field Message does not have): refused alone, naming index and field."""
    sender = sender_on(1, "bad-wire", N_SHARDS)
    tag = uuid.uuid4().hex[:8]
    topic = f"bad/wire/{tag}"
    unknown = encode_message(topic, b"unknown", sender, 1, False) + b"\xa0\x06\x01"  # field 100, a varint
    property_field = encode_message(topic, b"in-a-property", sender, 1, False) + b"\x32\x05\x0a\x01k\x18\x01"
    messages = [
        encode_message(topic, b"before", sender, 1, False),
        qos_as_bytes(topic, sender),
        unknown,
        property_field,
        encode_message(topic, b"after", sender, 2, False, [("k", "v")]),
    ]
    with leader_channel(cluster, sender) as channel:
        answer = raw_store(channel, batch_bytes(*messages))
    # What is stored reads as columns (the forged qos, stored, made the C reader refuse the whole answer).
    cols = wc.columns(next_answers(cluster, client, f"{topic}/#"))
    assert (cols.n, cols.skipped) == (2, 0)
    assert [m.payload for m in replayed(client, f"{topic}/#")] == [b"before", b"after"]
    failures = {f.index: f for f in answer.message_failures}
    assert sorted(failures) == [1, 2, 3]
    assert all(f.reason == Reason.INVALID_MESSAGE.value for f in failures.values())
    assert "field 4 (qos)" in failures[1].message and "length-delimited" in failures[1].message
    assert "field 100" in failures[2].message and "not a field of mqds.v1.Message" in failures[2].message
    assert "user property 1" in failures[3].message and "field 3" in failures[3].message


def test_a_store_stream_batch_with_a_bad_message_stores_the_rest(cluster: LocalCluster, client: Client) -> None:
    sender = sender_on(0, "bad-stream", N_SHARDS)
    tag = uuid.uuid4().hex[:8]
    topic = f"bad/stream/{tag}"
    producer = uuid.uuid4().hex

    def frame(sequence: int, *messages: bytes) -> bytes:
        batch = batch_bytes(*messages, producer=producer, sequence=sequence)
        return length_delimited(b"\x0a", batch)

    frames = [
        frame(1, encode_message(topic, b"a", sender, 1, False)),
        frame(
            2,
            encode_message(topic, b"b", sender, 1, False),
            encode_message(topic, b"props", sender, 1, False, TOO_MANY),
            qos_as_bytes(topic, sender),
            encode_message(topic, b"c", sender, 1, False),
        ),
        frame(3, qos_as_bytes(topic, sender)),  # nothing valid: answered all the same, the stream goes on
        frame(4, encode_message(topic, b"d", sender, 1, False)),
    ]
    with leader_channel(cluster, sender) as channel:
        call = channel.stream_stream(
            "/mqds.v1.Storage/StoreStream",
            request_serializer=None,
            response_deserializer=pb.StoreStreamResponse.FromString,
        )
        answers = list(call(iter(frames), timeout=30))
    assert [a.sequence for a in answers] == [1, 2, 3, 4]
    assert all(not a.result.failures for a in answers)
    second, third = answers[1].result, answers[2].result
    assert [p.timestamp_us > 0 for p in second.positions] == [True, False, False, True]
    assert [(f.index, f.reason) for f in second.message_failures] == [
        (1, Reason.INVALID_MESSAGE.value),
        (2, Reason.INVALID_MESSAGE.value),
    ]
    assert "user properties" in second.message_failures[0].message
    assert "field 4 (qos)" in second.message_failures[1].message
    assert [p.timestamp_us for p in third.positions] == [0] and [f.index for f in third.message_failures] == [0]
    assert [m.payload for m in replayed(client, f"{topic}/#")] == [b"a", b"b", b"c", b"d"]


def test_a_retained_message_with_a_mistyped_field_is_refused(cluster: LocalCluster, client: Client) -> None:
    topic = f"bad/retained/{uuid.uuid4().hex[:8]}"
    message = qos_as_bytes(topic, "bad-retain")
    request = length_delimited(b"\x0a", message)  # RetainRequest.message
    call = grpc.insecure_channel(cluster.nodes[cluster.wait_for_leader(shard_of(topic, N_SHARDS))].address).unary_unary(
        "/mqds.v1.Sessions/Retain", request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.RpcError) as exc:
        call(request, timeout=30)
    err = from_rpc_error(exc.value)
    assert err.reason is Reason.INVALID_MESSAGE and "field 4 (qos)" in err.message
