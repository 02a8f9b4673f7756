"""The calls of pipelined writes: limits, what the client checks before queueing, one call's outcome; no I/O.

Part of :mod:`mqds.client.pipeline` (which re-exports these names).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from mqds.client.model import Message
from mqds.protocol import errors, messages
from mqds.protocol.errors import MqdsError, PartialBatchError, Reason
from mqds.protocol.sharding import shard_of
from mqds.v1 import storage_pb2 as pb

__all__ = [
    "PendingCall",
    "PipelineLimits",
    "check_message",
    "check_messages",
    "closed_error",
    "open_failed",
    "read_failed",
    "resolve",
    "resolve_limits",
    "store_stream",
]


@dataclass(frozen=True)
class PipelineLimits:
    """How much a client keeps in flight: messages in all (the window), batch sizes, batches per shard.

    ``max_batches_per_shard`` is what makes calls share batches: a shard
    sends a new batch only while fewer than that are unacknowledged, so the
    calls made meanwhile wait and go out together in the next one (like a
    Kafka producer's ``max.in.flight``). Two keep a shard's Raft pipeline
    busy (one batch travels while the next gathers calls); in a trial of
    one-message calls, 64 in flight from each of 8 processes, 1, 2 and 4
    gave 14,710, 15,698 and 12,436 msg/s, and 64 (no coalescing while
    slots were free) about 11,500.
    """

    max_in_flight_messages: int = 10_000
    max_batch_messages: int = 1_000
    max_batch_bytes: int = 4 * 1024 * 1024
    max_batches_per_shard: int = 2

    def __post_init__(self) -> None:
        for name in ("max_in_flight_messages", "max_batch_messages", "max_batch_bytes", "max_batches_per_shard"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def resolve_limits(
    limits: PipelineLimits | None, max_in_flight_messages: int | None, max_send_message_bytes: int
) -> PipelineLimits:
    """A client's limits: ``limits`` (or the defaults) with the window given, batches under the send limit."""
    resolved = limits or PipelineLimits()
    if max_in_flight_messages is not None:
        resolved = dataclasses.replace(resolved, max_in_flight_messages=max_in_flight_messages)
    cap = max(1, max_send_message_bytes // 2)
    if resolved.max_batch_bytes > cap:
        resolved = dataclasses.replace(resolved, max_batch_bytes=cap)
    return resolved


def check_message(index: int, message: Message) -> None:
    """Raise what a node would for a message it can never store (the rules of :mod:`mqds.protocol.messages`:
    a bad topic, qos or sender, too many or too large user properties; not the payload's size, which is the
    node's limit)."""
    m = message
    messages.check_message(f"message {index}", m.topic, m.payload, m.sender, m.qos, m.properties)


def check_messages(batch: Sequence[Message]) -> dict[int, MqdsError]:
    """The messages of a call a node can never store, each with its error (:func:`check_message`); {} when
    there are none, the common case. They fail alone: the call's other messages are sent."""
    refused: dict[int, MqdsError] = {}
    for index, message in enumerate(batch):
        try:
            check_message(index, message)
        except MqdsError as err:
            refused[index] = err
    return refused


class PendingCall:
    """One ``store_async`` call: its messages, deadline, the positions acknowledged so far, its outcome.

    Built once per call on the write path, so it keeps to slots and fills
    ``positions`` (a list, one entry per message) instead of dictionaries.
    """

    __slots__ = (
        "deadline",
        "done",
        "error",
        "failed",
        "handle",
        "id",
        "last_error",
        "messages",
        "parts_left",
        "positions",
        "sequence",
        "shards",
    )
    _ids = itertools.count()

    def __init__(
        self, messages: Sequence[Message], n_shards: int, deadline: float, refused: dict[int, MqdsError] | None = None
    ) -> None:
        """``refused``: messages that fail at once (not sent), each with its error (:func:`check_messages`)."""
        self.id = next(self._ids)
        self.messages = messages if type(messages) is list else list(messages)
        self.deadline = deadline
        if len(self.messages) == 1:
            self.shards = [shard_of(self.messages[0].sender, n_shards)]
            self.parts_left = 0 if refused else 1
        else:
            self.shards = [shard_of(m.sender, n_shards) for m in self.messages]
            sent = self.shards if not refused else [s for i, s in enumerate(self.shards) if i not in refused]
            self.parts_left = len(set(sent))
        self.positions: list[tuple[int, int] | None] = [None] * len(self.messages)
        self.failed: dict[int, MqdsError] = dict(refused) if refused else {}  # index -> error
        self.last_error: MqdsError | None = None
        self.sequence = 0
        self.done = False
        self.error: MqdsError | None = None
        self.handle: object = None
        """The transport's future for this call."""

    def part_settled(self) -> bool:
        """One shard's part is acknowledged or failed for good; True when that settles the call."""
        self.parts_left -= 1
        return self.parts_left <= 0 and not self.done

    def fail(self, err: MqdsError) -> None:
        self.done, self.error = True, err

    def outcome(self) -> list[Message]:
        """The messages with ``timestamp_us`` and ``shard`` set; raises the call's error."""
        if self.error is not None:
            raise self.error
        if not self.failed:
            return [
                Message(m.topic, m.payload, m.sender, m.qos, m.retain, m.properties, *at)
                if at is not None
                else Message(m.topic, m.payload, m.sender, m.qos, m.retain, m.properties, None, self.shards[i])
                for i, (m, at) in enumerate(zip(self.messages, self.positions, strict=True))
            ]
        stored: list[Message] = []
        failed: list[tuple[Message, MqdsError]] = []
        for index, m in enumerate(self.messages):
            ts, shard = self.positions[index] or (None, self.shards[index])
            copy = Message(m.topic, m.payload, m.sender, m.qos, m.retain, m.properties, ts, shard)
            if index in self.failed:
                failed.append((copy, self.failed[index]))
            else:
                stored.append(copy)
        if not stored:
            raise failed[0][1]
        raise PartialBatchError(stored, failed, self.sequence)


_ALREADY_DONE = (futures.InvalidStateError, asyncio.InvalidStateError)


def resolve(call: PendingCall) -> None:
    """Complete a settled call's future (a ``concurrent.futures`` or an asyncio one) with its messages or error.

    A future the caller cancelled meanwhile is left as it is.
    """
    future: Any = call.handle
    try:
        result = call.outcome()
    except MqdsError as err:
        with contextlib.suppress(*_ALREADY_DONE):
            future.set_exception(err)
        return
    with contextlib.suppress(*_ALREADY_DONE):
        future.set_result(result)


STORE_STREAM_METHOD = "/mqds.v1.Storage/StoreStream"


def store_stream(channel: Any) -> Any:
    """``Storage.StoreStream`` on a channel (sync or ``grpc.aio``), taking requests already encoded (bytes)."""
    return channel.stream_stream(
        STORE_STREAM_METHOD,
        request_serializer=None,
        response_deserializer=pb.StoreStreamResponse.FromString,
        _registered_method=True,
    )


def closed_error() -> MqdsError:
    """What the calls a client had not had acknowledged when it was closed fail with."""
    return errors.error(
        Reason.UNAVAILABLE,
        "the client was closed before the write was acknowledged; it may or may not have been stored",
    )


def open_failed(cause: Exception) -> MqdsError:
    """What a stream that could not be opened (a closed channel) ends with."""
    return errors.error(Reason.UNAVAILABLE, f"cannot open a stream: {cause}")


def read_failed(cause: Exception) -> MqdsError:
    """What a stream whose reading failed unexpectedly (not with a gRPC status) ends with."""
    return errors.error(Reason.INTERNAL, f"the store stream failed: {cause}")
