"""``Storage.Next`` answers as :class:`NextResult` s, for the clients' stubs (sync and asyncio).

The stubs' deserializer of ``Next`` builds the result itself, from the
answer's bytes:

- with the C extension (:mod:`mqds.client.core.wire_columns`), only the envelope
  is read (the count, iterator, ``end_of_stream``, packed timestamps and
  ``streams_done``);
  the messages stay as the bytes they came in, parsed by protobuf only if a
  caller reads them one by one, and read as columns straight from the bytes
  by one that wants columns (the Spark source);
- without it, protobuf parses the whole answer, as before.

Either way the result knows its size on the wire: reading ahead holds
answers until the caller takes them and bounds them in bytes
(``replay.read_ahead``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mqds.client.batch import MessageBatch, NextResult, wire_times
from mqds.client.core.answer_rows import parse_answer
from mqds.client.core.wire_columns import envelope, native
from mqds.client.model import Iterator
from mqds.v1 import storage_pb2 as pb

NEXT_METHOD = "/mqds.v1.Storage/Next"


def next_result(raw: bytes) -> NextResult:
    """The deserializer of ``Storage.Next`` in the clients' stubs: the answer as a :class:`NextResult`."""
    if native is None:
        return parsed_next_result(raw)
    answer = envelope(raw)
    messages = MessageBatch.of_answer(raw, answer.n, _times(answer.timestamps, answer.n))
    position = Iterator.from_pb(pb.IteratorToken.FromString(answer.iterator))
    return NextResult(messages, position, answer.end_of_stream, answer.streams_done)


def parsed_next_result(raw: bytes) -> NextResult:
    """:func:`next_result` by protobuf alone: every message parsed (where the C extension is not built).

    A message that does not parse is left out (``MessageBatch.skipped``
    counts it), not the whole answer refused.
    """
    response, skipped = parse_answer(raw)
    batch = MessageBatch(response.messages, _times(response.timestamps, len(response.messages)), len(raw))
    batch.skipped = len(skipped)
    return NextResult(batch, Iterator.from_pb(response.iterator), response.end_of_stream, response.streams_done)


def _times(stamps: bytes, count: int) -> Sequence[int] | None:
    """The packed timestamps the node sent beside ``count`` messages (None from a node that sent none)."""
    return wire_times(stamps) if stamps and len(stamps) == 8 * count else None


def with_next_results(stub: Any, channel: Any) -> Any:
    """``stub`` (a StorageStub, sync or asyncio) with ``Next`` answering :func:`next_result`'s results."""
    stub.Next = channel.unary_unary(
        NEXT_METHOD, request_serializer=pb.NextRequest.SerializeToString, response_deserializer=next_result
    )
    return stub
