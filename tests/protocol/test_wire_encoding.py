"""The client's hand-written protobuf encoding (mqds.protocol.wire) against protobuf's own."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from storage_support import msg

from mqds.protocol.wire import encode_message, store_stream_frame, varint
from mqds.v1 import storage_pb2 as pb

texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
properties = st.lists(st.tuples(texts, texts), max_size=4)
messages = st.builds(
    lambda topic, payload, sender, qos, retain, props: (topic, payload, sender, qos, retain, tuple(props)),
    texts,
    st.binary(max_size=20_000),  # lengths over 16,383 take a three-byte varint
    texts,
    st.integers(0, 2),
    st.booleans(),
    properties,
)


def as_pb(m: tuple) -> pb.Message:
    return msg(*m)


@given(messages)
def test_a_message_encodes_to_the_bytes_protobuf_writes(m: tuple) -> None:
    assert encode_message(*m) == as_pb(m).SerializeToString()


@given(messages, st.integers(0, 2**32 - 1))
def test_a_message_with_an_expiry_interval_encodes_to_the_bytes_protobuf_writes(m: tuple, expiry_s: int) -> None:
    expected = as_pb(m)
    expected.message_expiry_s = expiry_s
    assert encode_message(*m, expiry_s) == expected.SerializeToString()


@given(st.lists(messages, max_size=5), st.text(max_size=200), st.integers(0, 2**64 - 1))
def test_a_stream_frame_parses_as_the_batch_it_carries(batch: list, producer: str, sequence: int) -> None:
    frame = pb.StoreStreamRequest.FromString(
        store_stream_frame([encode_message(*m) for m in batch], producer, sequence)
    )
    expected = pb.StoreBatchRequest(
        messages=[as_pb(m) for m in batch], sync=True, producer_id=producer, sequence=sequence
    )
    assert frame.batch == expected
    assert frame.SerializeToString() == pb.StoreStreamRequest(batch=expected).SerializeToString()


def test_varints_of_every_width() -> None:
    for value in (0, 1, 127, 128, 16_383, 16_384, 2**35, 2**64 - 1):
        parsed = pb.StoreBatchRequest.FromString(b"\x20" + varint(value))
        assert parsed.sequence == value
