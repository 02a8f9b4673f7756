"""A real mqds-server process on loopback, driven through the client and raw gRPC."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from harness import ServerProcess

from mqds.client import Client, Iterator, Message, Rank, Stream
from mqds.client import errors as E
from mqds.protocol.errors import from_rpc_error
from mqds.protocol.sharding import shard_of
from mqds.v1 import storage_pb2 as pb
from mqds.v1 import storage_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration


def sensor_messages(n_sensors: int, per_sensor: int, senders: int = 4) -> list[Message]:
    out = []
    for round_ in range(per_sensor):
        for sensor in range(n_sensors):
            out.append(
                Message(
                    topic=f"sensor/{sensor}/temp",
                    payload=f"{sensor}:{round_}".encode(),
                    sender=f"dev-{sensor % senders}",
                    qos=1,
                )
            )
    return out


def replayed(client: Client, topic_filter: str, start_time_us: int = 0) -> list[Message]:
    return list(client.replay(topic_filter, start_time_us=start_time_us, batch_size=57))


def test_store_and_replay_with_wildcards(client: Client) -> None:
    stored = client.store_batch(sensor_messages(30, 5), sync=True)
    stored += client.store_batch(
        [
            Message(topic="status/7", payload=b"on", sender="dev-7", retain=True, properties=[("a", "1"), ("a", "2")]),
            Message(topic="$SYS/uptime", payload=b"42", sender="broker"),
            Message(topic="a//b", payload=b"empty level", sender="x", qos=2),
        ]
    )
    assert all(m.timestamp_us and m.shard == shard_of(m.sender, 16) for m in stored)

    everything = replayed(client, "#")
    assert len(everything) == len(stored) - 1  # '#' does not match $SYS
    assert {m.topic for m in everything} == {m.topic for m in stored if not m.topic.startswith("$")}

    temps = replayed(client, "sensor/+/temp")
    assert sorted((m.topic, m.payload) for m in temps) == sorted(
        (m.topic, m.payload) for m in stored if m.topic.startswith("sensor/")
    )
    one = replayed(client, "sensor/17/#")
    assert [m.payload for m in one] == [f"17:{r}".encode() for r in range(5)]
    assert [m.topic for m in replayed(client, "$SYS/#")] == ["$SYS/uptime"]
    assert [m.payload for m in replayed(client, "a/+/b")] == [b"empty level"]
    assert replayed(client, "nothing/here") == []

    status = replayed(client, "status/7")[0]
    assert status.retain is True
    assert status.properties == (("a", "1"), ("a", "2"))
    assert status.sender == "dev-7"

    # Per sender, replay returns messages in the order they were stored.
    by_sender = collections.defaultdict(list)
    for m in everything:
        by_sender[m.sender].append(m.timestamp_us)
    assert all(ts == sorted(ts) for ts in by_sender.values())
    stored_order = collections.defaultdict(list)
    for m in stored:
        stored_order[m.sender].append(m.payload)
    for sender, payloads in stored_order.items():
        if sender != "broker":
            assert [m.payload for m in everything if m.sender == sender] == payloads


def test_iterator_is_serialisable_and_resumes(client: Client) -> None:
    client.store_batch(sensor_messages(3, 40, senders=1))
    ((rank, stream),) = [(r, s) for r, s in client.get_streams("sensor/1/temp")]
    assert rank == Rank(stream.shard, stream.generation)
    it = client.make_iterator(stream, "sensor/1/temp")
    first = client.next(it, batch_size=15)
    assert len(first.messages) == 15 and not first.end_of_stream
    saved = first.iterator.to_bytes()
    resumed = Iterator.from_bytes(saved)
    assert resumed == first.iterator
    rest = client.next(resumed, batch_size=100)
    payloads = [m.payload for m in first.messages + rest.messages]
    assert payloads == [f"1:{r}".encode() for r in range(40)]
    # The current generation never ends: an empty batch means "nothing yet".
    again = client.next(rest.iterator, batch_size=100)
    assert again.messages == [] and again.end_of_stream is False
    client.store_batch([Message(topic="sensor/1/temp", payload=b"late", sender="dev-0")])
    assert [m.payload for m in client.next(again.iterator, 10).messages] == [b"late"]


def test_generations_end_of_stream_and_drop(client: Client) -> None:
    stored = client.store_batch([Message(topic="g/1", payload=b"old", sender="s")])
    shard = stored[0].shard
    assert shard is not None
    ((_, old_stream),) = client.get_streams("g/1")
    it = client.make_iterator(old_stream, "g/#")

    new = client.add_generation(shard)
    assert [g.generation for g in new] == [2] and new[0].current
    client.store_batch([Message(topic="g/1", payload=b"new", sender="s")])
    gens = client.list_generations(shard)
    assert [(g.generation, g.current) for g in gens] == [(1, False), (2, True)]
    assert gens[0].until_us == gens[1].since_us

    res = client.next(it, 10)
    assert [m.payload for m in res.messages] == [b"old"] and res.end_of_stream is True
    assert [m.payload for m in replayed(client, "g/1")] == [b"old", b"new"]
    # A start time after generation 1 ended skips it.
    assert [r.generation for r, _ in client.get_streams("g/1", start_time_us=gens[1].since_us)] == [2]

    with pytest.raises(E.FailedPreconditionError) as cur:
        client.drop_generation(shard, 2)
    assert cur.value.reason is E.Reason.CURRENT_GENERATION
    assert "current" in cur.value.message

    dropped = client.drop_generation(shard, 1)
    assert dropped.generation == 1 and dropped.until_us == gens[0].until_us
    with pytest.raises(E.GenerationDroppedError) as gone:
        client.next(it, 10)
    assert gone.value.code == grpc.StatusCode.NOT_FOUND
    assert "GetStreams" in gone.value.message
    with pytest.raises(E.GenerationDroppedError):
        client.make_iterator(old_stream, "g/#")
    # A fresh get_streams sees only what is left.
    assert [m.payload for m in replayed(client, "g/#")] == [b"new"]


def test_all_shards_generation_calls(client: Client) -> None:
    assert len(client.list_generations()) == 16
    assert sorted(g.shard for g in client.add_generation()) == list(range(16))
    assert len(client.list_generations()) == 32


BAD_CALLS = [
    ("wildcard in topic", lambda c: c.store_batch([Message(topic="a/+/b")]), E.Reason.INVALID_TOPIC, "wildcard"),
    ("hash in topic", lambda c: c.store_batch([Message(topic="a/#")]), E.Reason.INVALID_TOPIC, "wildcard"),
    ("empty topic", lambda c: c.store_batch([Message(topic="")]), E.Reason.INVALID_TOPIC, "empty"),
    ("NUL in topic", lambda c: c.store_batch([Message(topic="a\x00b")]), E.Reason.INVALID_TOPIC, "NUL"),
    ("bad filter", lambda c: c.get_streams("a/#/b"), E.Reason.INVALID_TOPIC_FILTER, "last level"),
    ("partial wildcard", lambda c: c.get_streams("a/b+"), E.Reason.INVALID_TOPIC_FILTER, "whole level"),
    (
        "oversize payload",
        lambda c: c.store_batch([Message(topic="t", payload=b"x" * (1024 * 1024 + 1))]),
        E.Reason.PAYLOAD_TOO_LARGE,
        "max_payload_bytes",
    ),
    ("qos 3", lambda c: c.store_batch([Message(topic="t", qos=3)]), E.Reason.INVALID_MESSAGE, "qos"),
    (
        "garbage iterator",
        lambda c: c.next(Iterator(0, 1, b"not an iterator at all, really"), 10),
        E.Reason.INVALID_ITERATOR,
        "magic",
    ),
    ("short iterator", lambda c: c.next(Iterator(0, 1, b"xx"), 10), E.Reason.INVALID_ITERATOR, "too short"),
    ("unknown shard", lambda c: c.list_generations(99), E.Reason.UNKNOWN_SHARD, "shard 99"),
    ("unknown shard drop", lambda c: c.drop_generation(16, 1), E.Reason.UNKNOWN_SHARD, "0 to 15"),
    ("unknown generation", lambda c: c.drop_generation(0, 7), E.Reason.UNKNOWN_GENERATION, "no generation 7"),
    (
        "unknown stream",
        lambda c: c.make_iterator(Stream(0, 1, 999_999, "x"), "#"),
        E.Reason.UNKNOWN_STREAM,
        "no stream",
    ),
]


@pytest.mark.parametrize(("what", "call", "reason", "words"), BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_input_gets_a_clear_error_and_the_node_keeps_serving(client, what, call, reason, words) -> None:
    with pytest.raises(E.MqdsError) as exc:
        call(client)
    err = exc.value
    assert err.reason is reason, err
    assert words in err.message
    assert err.retriable is False
    assert err.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED)
    # The node is still there and still stores.
    assert client.store_batch([Message(topic="after/bad", payload=b"ok", sender="s")])[0].timestamp_us


def test_batch_size_and_empty_stream_filter(client: Client) -> None:
    client.store_batch([Message(topic="x/1", payload=b"1", sender="s")])
    ((_, stream),) = client.get_streams("x/1")
    with pytest.raises(E.InvalidArgumentError) as exc:
        client.next(client.make_iterator(stream, "x/1"), batch_size=0)
    assert exc.value.reason is E.Reason.INVALID_REQUEST
    with pytest.raises(E.InvalidArgumentError) as exc:
        client.make_iterator(stream, "y/#")
    assert "cannot match" in exc.value.message


def test_non_utf8_topic_is_rejected_not_crashing(server: ServerProcess, client: Client) -> None:
    # A StoreBatchRequest whose one message has topic bytes ff fe fd: a
    # protobuf string field that is not UTF-8, as a buggy client might send.
    bad = b"\x0a\x05" + b"\x0a\x03\xff\xfe\xfd"
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary("/mqds.v1.Storage/StoreBatch")
        with pytest.raises(grpc.RpcError) as exc:
            call(bad, timeout=10)
        mapped = from_rpc_error(exc.value)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert mapped.reason is E.Reason.MALFORMED_REQUEST
        assert "UTF-8" in mapped.message
        # Plain garbage bytes, too.
        with pytest.raises(grpc.RpcError) as exc2:
            channel.unary_unary("/mqds.v1.Storage/Next")(b"\xff\xff\xff\xff", timeout=10)
        assert exc2.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert client.store_batch([Message(topic="still/alive", sender="s")])[0].timestamp_us


def test_kill_9_restart_keeps_acknowledged_writes_and_iterators(server: ServerProcess) -> None:
    with Client(server.address) as c:
        acked = []
        for i in range(20):
            acked += c.store_batch(
                [Message(topic=f"k/{j % 7}", payload=f"{i}-{j}".encode(), sender=f"p{j % 3}") for j in range(50)],
                sync=True,
            )
        stream = c.get_streams("k/3")[0][1]
        it = c.make_iterator(stream, "k/3")
        part = c.next(it, 30)
        saved = part.iterator.to_bytes()
    server.kill()
    server.start()
    with Client(server.address) as c:
        after = {(m.topic, m.payload, m.timestamp_us) for m in c.replay("k/#")}
        assert after == {(m.topic, m.payload, m.timestamp_us) for m in acked}
        rest = c.next(Iterator.from_bytes(saved), 1000)
        expected = sorted((m.timestamp_us, m.payload) for m in acked if m.topic == "k/3" and m.shard == stream.shard)
        got = [(m.timestamp_us, m.payload) for m in part.messages + rest.messages]
        assert got == expected
        # New writes get later timestamps than everything before the crash.
        new = c.store_batch([Message(topic="k/3", payload=b"post", sender="p1")])[0]
        assert new.timestamp_us is not None
        assert new.timestamp_us > max(m.timestamp_us or 0 for m in acked if m.shard == new.shard)


def test_health_and_reflection(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "mqds.v1.Storage"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert {"mqds.v1.Storage", "grpc.health.v1.Health"} <= names


def test_time_based_rotation_and_retention(tmp_path: Path) -> None:
    proc = ServerProcess(
        tmp_path / "n1",
        args=[
            "--n-shards",
            "2",
            "--generation-interval-s",
            "1",
            "--retention-period-s",
            "1.5",
            "--maintenance-interval-s",
            "0.1",
        ],
    ).start()
    try:
        with Client(proc.address) as c:
            c.store_batch([Message(topic="r/1", payload=b"first", sender="s")])
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                gens = c.list_generations()
                if all(g.generation >= 4 for g in gens):
                    break
                time.sleep(0.2)
            gens = c.list_generations()
            assert gens and all(g.generation >= 4 for g in gens), gens
            # Generation 1 ended more than 1.5 s ago: retention dropped it.
            assert all(g.generation > 1 for g in gens)
            assert len(gens) <= 2 * 3
            assert replayed(c, "r/#") == []
    finally:
        proc.stop()


def test_a_repeated_producer_sequence_is_stored_once(server: ServerProcess, client: Client) -> None:
    """The same request sent twice (a retry after a lost answer) stores once and answers the same."""
    request = pb.StoreBatchRequest(
        messages=[pb.Message(topic=f"once/{i}", payload=b"x", sender=f"s{i}") for i in range(40)],
        producer_id="producer-a",
        sequence=1,
    )
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.StorageStub(channel)
        first = stub.StoreBatch(request, timeout=10)
        second = stub.StoreBatch(request, timeout=10)
        assert list(second.positions) == list(first.positions)
        assert not first.failures and not second.failures
        request.sequence = 2
        third = stub.StoreBatch(request, timeout=10)
        assert all(t.timestamp_us > f.timestamp_us for t, f in zip(third.positions, first.positions, strict=True))
        for producer, sequence, words in [("p" * 129, 1, "over 128 bytes"), ("p", 0, "1 or more")]:
            bad = pb.StoreBatchRequest(messages=request.messages[:1], producer_id=producer, sequence=sequence)
            with pytest.raises(grpc.RpcError) as exc:
                stub.StoreBatch(bad, timeout=10)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in (exc.value.details() or "")
    assert len(replayed(client, "once/#")) == 80
