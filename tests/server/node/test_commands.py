"""The replicated store command and the StoreBatch response, built from bytes without protobuf objects."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.wire import positions_bytes, store_command
from mqds.v1 import storage_pb2 as pb


def test_store_messages_is_wire_compatible_with_store_batch_request() -> None:
    request = pb.StoreBatchRequest.DESCRIPTOR
    command = cpb.StoreMessages.DESCRIPTOR
    for name in ("messages", "producer_id", "sequence"):
        theirs, ours = request.fields_by_name[name], command.fields_by_name[name]
        assert (ours.number, ours.type, ours.message_type) == (theirs.number, theirs.type, theirs.message_type), name
    assert request.fields_by_name["sync"].number not in command.fields_by_number
    assert command.fields_by_name["now_us"].number not in request.fields_by_number


@given(
    st.lists(st.tuples(st.text(min_size=1, max_size=20), st.binary(max_size=40), st.integers(0, 2)), max_size=20),
    st.text(max_size=10),
    st.integers(1, 2**63),
    st.booleans(),
    st.integers(0, 2**62),
)
def test_a_request_plus_now_is_the_command(
    messages: list[tuple[str, bytes, int]], producer: str, sequence: int, sync: bool, now: int
) -> None:
    request = pb.StoreBatchRequest(
        messages=[pb.Message(topic=t, payload=p, qos=q, sender="s") for t, p, q in messages],
        producer_id=producer,
        sequence=sequence,
        sync=sync,
    )
    raw = store_command(request.SerializeToString(), now)
    command = cpb.VnodeCommand.FromString(raw)
    assert command.WhichOneof("kind") == "store"
    assert list(command.store.messages) == list(request.messages)
    assert (command.store.producer_id, command.store.sequence, command.store.now_us) == (producer, sequence, now)
    # The view replicas apply a store through: each message as the bytes it was logged as.
    encoded = cpb.VnodeCommandEncoded.FromString(raw).store.messages
    assert list(encoded) == [m.SerializeToString() for m in request.messages]


def test_the_encoded_view_matches_the_command() -> None:
    view, command = cpb.VnodeCommandEncoded.DESCRIPTOR, cpb.VnodeCommand.DESCRIPTOR
    ours, theirs = view.fields_by_name["store"], command.fields_by_name["store"]
    assert ours.number == theirs.number
    messages = cpb.StoreMessagesEncoded.DESCRIPTOR.fields_by_name["messages"]
    assert messages.number == cpb.StoreMessages.DESCRIPTOR.fields_by_name["messages"].number
    assert messages.is_repeated and messages.type == messages.TYPE_BYTES


@pytest.mark.parametrize(
    ("shard", "first", "count"),
    [(0, 1, 0), (0, 1, 300), (3, 100, 60), (15, 127, 2), (7, 1_763_000_000_000_000, 1000), (4095, 2**63 - 10, 10)],
)
def test_positions_bytes_equal_the_protobuf_encoding(shard: int, first: int, count: int) -> None:
    expected = pb.StoreBatchResponse(
        positions=[pb.MessagePosition(shard=shard, timestamp_us=first + i) for i in range(count)]
    )
    raw = positions_bytes(shard, first, count)
    assert raw == expected.SerializeToString()
    assert pb.StoreBatchResponse.FromString(raw) == expected


@given(st.integers(0, 4095), st.integers(1, 2**63 - 2000), st.integers(0, 1000))
def test_positions_bytes_property(shard: int, first: int, count: int) -> None:
    parsed = pb.StoreBatchResponse.FromString(positions_bytes(shard, first, count))
    assert [(p.shard, p.timestamp_us) for p in parsed.positions] == [(shard, first + i) for i in range(count)]
