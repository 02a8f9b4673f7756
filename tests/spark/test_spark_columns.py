"""The Arrow columns the source builds from a node's answers: the same rows as the messages themselves.

No Spark session: ``to_record_batch`` is plain pyarrow over the answers'
bytes (read by the client's C extension) or over protobuf messages (batches
that are not whole answers), checked against each message read field by
field.
"""

from __future__ import annotations

import datetime
import struct
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqds.client import MessageBatch
from mqds.client.batch import wire_times
from mqds.client.core.next_answer import next_result, parsed_next_result
from mqds.spark import arrow_schema, reading
from mqds.spark.columns import to_record_batch
from mqds.spark.plan import Slice
from mqds.v1 import storage_pb2 as pb

pytestmark = pytest.mark.spark

_text = st.text(st.characters(codec="utf-8"), max_size=12)
_message: st.SearchStrategy[dict[str, Any]] = st.builds(
    dict,
    topic=_text,
    payload=st.binary(max_size=20),
    sender=_text,
    qos=st.integers(0, 2),
    retain=st.booleans(),
    properties=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), _text), max_size=3),
    timestamp_us=st.integers(0, 4_000_000_000_000_000),  # up to the year 2096
)


def _batch(rows: list[dict[str, Any]], packed: bool, answer: bool = False) -> MessageBatch:
    """The rows as a batch of parsed messages, or (``answer``) as one read whole from a node's answer."""
    items = [
        pb.Message(
            topic=r["topic"],
            payload=r["payload"],
            sender=r["sender"],
            qos=r["qos"],
            retain=r["retain"],
            properties=[pb.UserProperty(key=k, value=v) for k, v in r["properties"]],
            timestamp_us=r["timestamp_us"],
        )
        for r in rows
    ]
    stamps = b"".join(struct.pack("<Q", r["timestamp_us"]) for r in rows) if packed else b""
    if answer:
        batch = next_result(pb.NextResponse(messages=items, timestamps=stamps).SerializeToString()).messages
        assert batch.answer is not None
        return batch
    return MessageBatch(items, wire_times(stamps) if packed else None)


_batches = st.lists(st.tuples(st.lists(_message, max_size=6), st.booleans(), st.booleans()), min_size=1, max_size=4)
"""Batches of messages; each with packed timestamps or not, read whole from an answer or not."""


@settings(max_examples=80, deadline=None)
@given(_batches)
def test_record_batch_rows_equal_the_messages(batches: list[tuple[list[dict[str, Any]], bool, bool]]) -> None:
    """Every field of every message lands in its row, over several batches, packed timestamps or not,
    from the answers' bytes (all batches whole answers) or from protobuf messages (any that is not)."""
    schema = arrow_schema()
    record = to_record_batch([_batch(*batch) for batch in batches], 5, 7, schema)
    assert record.schema == schema
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
    expected = [
        {
            "topic": r["topic"],
            "payload": r["payload"],
            "sender": r["sender"],
            "qos": r["qos"],
            "retain": r["retain"],
            # A name that repeats keeps its last value, in the place it first had.
            "properties": list(dict(r["properties"]).items()),
            "timestamp": epoch + datetime.timedelta(microseconds=r["timestamp_us"]),
            "shard": 5,
            "generation": 7,
        }
        for rows, _, _ in batches
        for r in rows
    ]
    assert record.to_pylist() == expected


_COLUMNS = [field.name for field in arrow_schema()]


@settings(max_examples=60, deadline=None)
@given(_batches, st.lists(st.sampled_from(_COLUMNS), min_size=1, max_size=len(_COLUMNS), unique=True))
def test_a_schema_of_some_columns_gets_those_columns_of_the_same_rows(
    batches: list[tuple[list[dict[str, Any]], bool, bool]], names: list[str]
) -> None:
    full = arrow_schema()
    some = pa.schema([full.field(name) for name in names])
    made = [_batch(*batch) for batch in batches]
    record = to_record_batch(made, 5, 7, some)
    assert record.schema == some
    everything = to_record_batch(made, 5, 7, full).to_pylist()
    assert record.to_pylist() == [{name: row[name] for name in names} for row in everything]


class _Unread(MessageBatch):
    """A batch whose messages must not be read (only its length and its packed timestamps)."""

    @property
    def wire(self) -> Any:
        raise AssertionError("the messages were read")


def test_timestamps_shards_and_generations_are_built_without_reading_the_messages() -> None:
    rows: list[dict[str, Any]] = [
        {"topic": "t", "payload": b"", "sender": "s", "qos": 0, "retain": False, "properties": [], "timestamp_us": t}
        for t in (5, 9, 12)
    ]
    packed = _batch(rows, True)
    unread = _Unread(packed.wire, packed.times)
    some = pa.schema([arrow_schema().field(name) for name in ("shard", "timestamp", "generation")])
    record = to_record_batch([unread], 3, 4, some)
    assert [(r["shard"], r["generation"]) for r in record.to_pylist()] == [(3, 4)] * 3
    assert record.column("timestamp").cast(pa.int64()).to_pylist() == [5, 9, 12]


@pytest.mark.parametrize("whole_answer", [True, False], ids=["answer", "messages"])
def test_a_message_that_does_not_parse_is_left_out_and_the_rest_is_read(
    whole_answer: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A topic that is not UTF-8 (protobuf refuses such a message): its row is left out, with a warning, and
    the other rows are read, from the answer's bytes (the C reader) and from protobuf's parse alike. It used
    to fail the whole answer, so a range holding one such message could not be read by Spark."""
    messages = [pb.Message(topic=f"t/{n}/é", sender="s", payload=bytes([n]), timestamp_us=n + 1) for n in range(3)]
    stamps = b"".join(struct.pack("<Q", m.timestamp_us) for m in messages)
    good = pb.NextResponse(messages=messages, timestamps=stamps).SerializeToString()
    damaged = good.replace("t/1/é".encode(), b"t/1/\xff\xfe", 1)
    batch = next_result(damaged).messages if whole_answer else parsed_next_result(damaged).messages
    assert (batch.answer is not None) is whole_answer
    with caplog.at_level("WARNING", logger="mqds.spark.columns"):
        record = to_record_batch([batch], 1, 2, arrow_schema())
    assert record.column("payload").to_pylist() == [b"\x00", b"\x02"]
    assert record.column("timestamp").cast(pa.int64()).to_pylist() == [1, 3]
    assert record.column("shard").to_pylist() == [1, 1]
    assert "vnode 1 generation 2: left out 1 messages that do not parse" in caplog.text


def test_record_batches_are_cut_by_the_answers_bytes_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small answers of large messages make record batches of at most ARROW_BYTES of answers (plus one answer),
    not ARROW_ROWS rows: 8,192 payloads of 1 MiB in one batch would pass the 2 GiB of a column's 32-bit offsets."""
    quarter = reading.ARROW_BYTES // 4
    answers = []
    for i in range(10):
        raw = pb.NextResponse(
            messages=[pb.Message(topic="t", payload=bytes([i]), timestamp_us=i + 1)]
        ).SerializeToString()
        batch = next_result(raw).messages
        batch._nbytes = quarter  # as if each answer held a 16 MiB payload
        answers.append(batch)
    monkeypatch.setattr(reading, "read_slice", lambda *args: iter(answers))
    part = Slice(shard=1, generation=2, streams=(), topic_filter="#", start_us=0, fence_us=100)
    records = list(reading.record_batches(None, part, 10, True, arrow_schema()))  # type: ignore[arg-type]
    assert [r.num_rows for r in records] == [4, 4, 2]
    assert [p for r in records for p in r.column("payload").to_pylist()] == [bytes([i]) for i in range(10)]
