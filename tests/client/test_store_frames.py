"""Pipelined writes' wire work in C (mqds.client.core._store_frames) against the Python encoder, rules and protobuf."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mqds.client import Message
from mqds.client import errors as E
from mqds.client.core import store_frames
from mqds.protocol import messages as rules
from mqds.protocol.wire import encode_message, store_stream_frame
from mqds.v1 import storage_pb2 as pb

native = store_frames.native
needs_native = pytest.mark.skipif(native is None, reason="the C extension mqds.client.core._store_frames is not built")

texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
# Topics and senders as callers write them, and the ones the rules refuse: empty, a wildcard, NUL, a surrogate.
topics = st.one_of(texts, st.sampled_from(["", "a/+", "#", "a\x00b", "\ud800", "x" * 65_536, "é" * 9_000]))
senders = st.one_of(texts, st.sampled_from(["\udfff", "s" * 65_536]))
properties = st.one_of(
    st.lists(st.tuples(texts, texts), max_size=4),
    st.just([("k", "v")] * 1_025),
    st.just([("k", "v" * 70_000)]),
    st.just([("\ud800", "v")]),
)
messages = st.builds(
    Message,
    topic=topics,
    payload=st.binary(max_size=20_000),
    sender=senders,
    qos=st.integers(-1, 3),
    retain=st.booleans(),
    properties=properties,
    # MQTT 5's Message Expiry Interval: mostly none, any four-byte value, and ones out of its range.
    message_expiry_s=st.one_of(st.just(0), st.integers(0, 2**32 - 1), st.sampled_from([-1, 2**32, 2**64])),
)


def python_encoding(m: Message) -> bytes:
    return encode_message(m.topic, m.payload, m.sender, m.qos, m.retain, m.properties, m.message_expiry_s)


def problem(m: Message) -> rules.Problem | None:
    found = rules.message_problem(m.topic, m.payload, m.sender, m.qos, m.properties)
    if found is None and not 0 <= m.message_expiry_s <= 2**32 - 1:
        return (
            E.Reason.INVALID_MESSAGE,
            f"message_expiry_s must be 0 to 4,294,967,295 seconds, got {m.message_expiry_s}",
        )
    return found


@needs_native
@given(messages)
def test_a_message_is_sized_in_c_as_python_encodes_it_or_left_to_python_when_the_rules_refuse_it(m: Message) -> None:
    assert native is not None
    size = native.message_size(m)
    if problem(m) is not None:
        assert size == -1
    else:
        assert size == len(python_encoding(m))


@given(messages)
def test_message_size_raises_the_rules_error_with_its_index_or_sizes_the_message(m: Message) -> None:
    found = problem(m)
    if found is None:
        assert store_frames.message_size(3, m) == len(python_encoding(m))
    else:
        with pytest.raises(E.MqdsError) as raised:
            store_frames.message_size(3, m)
        assert str(raised.value) == str(rules.problem_error("message 3", found))


@given(st.lists(messages, max_size=6), st.text(max_size=50), st.integers(0, 2**64 - 1))
def test_a_frame_is_the_bytes_of_the_python_encoder_and_parses_as_the_batch(
    batch: list[Message], producer: str, sequence: int
) -> None:
    good = [m for m in batch if problem(m) is None]
    frame = store_frames.store_frame(good, producer, sequence)
    assert frame == store_stream_frame([python_encoding(m) for m in good], producer, sequence)
    parsed = pb.StoreStreamRequest.FromString(frame).batch
    assert [m.payload for m in parsed.messages] == [m.payload for m in good]
    assert [m.message_expiry_s for m in parsed.messages] == [m.message_expiry_s for m in good]
    assert (parsed.producer_id, parsed.sequence, parsed.sync) == (producer, sequence, True)


def test_a_message_the_c_part_does_not_take_is_encoded_in_python() -> None:
    odd = Message("a/b", b"x", "s", qos=1)
    odd.payload = bytearray(b"xy")  # type: ignore[assignment]  # set after the dataclass normalised it
    assert store_frames.message_size(0, odd) == len(python_encoding(odd))
    frame = store_frames.store_frame([Message("t", b"1"), odd], "p", 5)
    assert [m.payload for m in pb.StoreStreamRequest.FromString(frame).batch.messages] == [b"1", b"xy"]


def answer(sequence: int, stamps: list[int], **result: object) -> pb.StoreStreamResponse:
    positions = [pb.MessagePosition(shard=3, timestamp_us=t) for t in stamps]
    return pb.StoreStreamResponse(sequence=sequence, result=pb.StoreBatchResponse(positions=positions, **result))  # type: ignore[arg-type]


@given(st.integers(0, 2**64 - 1), st.lists(st.integers(0, 2**64 - 1), max_size=50))
def test_an_answer_that_stored_everything_is_read_as_its_sequence_and_timestamps(
    sequence: int, stamps: list[int]
) -> None:
    read = store_frames.read_answer(answer(sequence, stamps).SerializeToString())
    if native is not None:
        assert read == (sequence, stamps)
    else:
        assert read.sequence == sequence and [p.timestamp_us for p in read.result.positions] == stamps


def test_any_other_answer_is_left_to_protobuf() -> None:
    refused = answer(4, [1, 0], message_failures=[pb.MessageFailure(index=1, reason="PAYLOAD_TOO_LARGE")])
    failed = answer(5, [], failures=[pb.ShardFailure(shard=3, reason="NOT_LEADER")])
    for response in (refused, failed):
        read = store_frames.read_answer(response.SerializeToString())
        assert isinstance(read, pb.StoreStreamResponse) and read == response
    with pytest.raises(Exception):  # noqa: B017 - protobuf's DecodeError: damaged bytes end the stream
        store_frames.read_answer(b"\x0a\xff")
