"""The calls of pipelined writes: limits, what the client checks before queueing, one call's outcome; no I/O.

Part of :mod:`mqds.client.core.pipeline` (which re-exports these names).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from mqds.client.core import store_frames
from mqds.client.model import Message
from mqds.protocol import errors, messages
from mqds.protocol.errors import MqdsError, PartialBatchError, Reason
from mqds.protocol.sharding import shard_of

__all__ = [
    "CALL_SLOTS",
    "CallState",
    "PendingCall",
    "PipelineLimits",
    "check_message",
    "check_messages",
    "closed_error",
    "open_failed",
    "read_failed",
    "resolve_limits",
    "store_stream",
]


@dataclass(frozen=True)
class PipelineLimits:
    """How much a client keeps in flight: messages in all (the window), batch sizes, batches per shard.

    ``max_batches_per_shard`` is what makes calls share batches: a shard
    sends a new batch only while fewer than that are unacknowledged, so the
    calls made meanwhile wait and go out together in the next one (like a
    Kafka producer's ``max.in.flight``). One is the default: the calls made
    during a round go out as one batch when it ends, so a Raft round carries
    as many as it can, and a round's fixed cost on the nodes is what
    one-message calls are bound by. Alternated against two (2026-12-07, one
    message per call): 8 processes x 64 in flight 13,027 / 12,237, 14,266 /
    11,797, 11,380 / 8,770 and 13,044 / 11,321 msg/s (the nodes' CPU per
    1,000 messages 151 / 208 and 141 / 163); one process x 1,000 in flight
    39,944 / 41,633, 38,226 / 35,433, 42,019 / 33,095, 34,969 / 34,144 and
    31,192 / 38,051; ExHook 505 / 440 and 586 / 574. (A first trial, on
    2026-11-25 with a thread per Raft group, gave 14,710 for 1, 15,698 for
    2 and 12,436 for 4, and 64, no coalescing while slots were free, about
    11,500.)
    """

    max_in_flight_messages: int = 10_000
    max_batch_messages: int = 1_000
    max_batch_bytes: int = 4 * 1024 * 1024
    max_batches_per_shard: int = 1
    stall_s: float = 5.0
    """A stream with batches in flight that answers nothing for this long is given up: cancelled, its
    node's leaderships forgotten, the map refreshed, and its batches resent (same sequences) to the
    shards' leaders then. A stopped node (SIGSTOP, a frozen VM) or a connection that carries nothing
    no longer holds its calls until their deadlines; a slow answer costs a resend, deduplicated."""

    def __post_init__(self) -> None:
        for name in ("max_in_flight_messages", "max_batch_messages", "max_batch_bytes", "max_batches_per_shard"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.stall_s, (int, float)) or isinstance(self.stall_s, bool) or not self.stall_s > 0:
            raise ValueError(f"stall_s must be a positive number of seconds, got {self.stall_s!r}")


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


CALL_SLOTS = (
    "deadline",
    "error",
    "failed",
    "last_error",
    "message",
    "messages",
    "nbytes",
    "parts_left",
    "positions",
    "sequence",
    "settled",
    "shard",
    "shards",
    "timestamp_us",
)
"""What the pipeline keeps of a call: slots of the handle the caller gets, so that a call is one object."""


class CallState:
    """One ``store_async`` call as the pipeline sees it: messages, deadline, positions so far, outcome.

    A mixin without slots of its own: :class:`PendingCall` and the clients'
    handles (:class:`mqds.client.sync.handles.StoreFuture`, a
    ``concurrent.futures.Future``, and ``AsyncStoreFuture``, an
    ``asyncio.Future``) put :data:`CALL_SLOTS` on themselves. A call of one
    message (the common case) keeps it in ``message``, its shard in ``shard``,
    its wire size in ``nbytes`` and its timestamp in ``timestamp_us``: no list,
    no tuple. A call of several keeps lists (``messages``, ``shards``,
    ``positions``), the refused ones in ``failed`` and ``parts_left``, its
    shards not settled yet. ``settled`` is the pipeline's: the outcome is
    decided (the handle publishes it to its waiters a moment later).
    """

    if not TYPE_CHECKING:  # the classes that mix it in hold the slots (type checkers see the attributes)
        __slots__ = ()

    deadline: float
    error: MqdsError | None
    failed: dict[int, MqdsError] | None
    last_error: MqdsError | None
    message: Message | None
    messages: list[Message] | None
    nbytes: int
    parts_left: int
    positions: list[tuple[int, int] | None] | None
    sequence: int
    settled: bool
    shard: int
    shards: list[int] | None
    timestamp_us: int

    def setup(
        self,
        messages: Message | Sequence[Message],
        n_shards: int,
        deadline: float,
        refused: dict[int, MqdsError] | None = None,
    ) -> None:
        """Check the messages (one no node stores fails alone: :func:`check_messages`) and set the call's state.

        ``refused``: the messages already found bad, each with its error (checked here when None).
        """
        self.deadline = deadline
        self.error = self.last_error = None
        self.settled = False
        self.sequence = self.timestamp_us = 0
        if isinstance(messages, Message):
            m = messages
        elif len(messages) == 1:
            m = messages[0]
        else:
            self._setup_many(list(messages), n_shards, refused)
            return
        self.message, self.messages, self.positions, self.shards, self.failed = m, None, None, None, None
        self.shard = shard_of(m.sender, n_shards)
        self.parts_left = 1
        if refused:
            self.error, self.parts_left = refused[0], 0
            return
        try:
            self.nbytes = store_frames.message_size(0, m)
        except MqdsError as err:
            self.error, self.parts_left = err, 0

    def _setup_many(self, batch: list[Message], n_shards: int, refused: dict[int, MqdsError] | None) -> None:
        self.message, self.messages, self.nbytes, self.shard = None, batch, 0, -1
        self.shards = [shard_of(m.sender, n_shards) for m in batch]
        if refused is None:
            _, refused = store_frames.check_messages(batch)
        self.positions = [None] * len(batch)
        self.failed = dict(refused)
        sent = self.shards if not refused else [s for i, s in enumerate(self.shards) if i not in refused]
        self.parts_left = len(set(sent))
        if not sent and batch:  # every message refused: the first one's error
            self.error = refused[min(refused)]

    @property
    def count(self) -> int:
        """How many messages the call holds."""
        return 1 if self.messages is None else len(self.messages)

    def part_settled(self) -> bool:
        """One shard's part is acknowledged or failed for good; True when that settles the call."""
        self.parts_left -= 1
        return self.parts_left <= 0 and not self.settled

    def fail(self, err: MqdsError) -> None:
        self.settled, self.error = True, err

    def outcome(self) -> list[Message]:
        """The messages with ``timestamp_us`` and ``shard`` set; raises the call's error."""
        if self.error is not None:
            raise self.error
        m = self.message
        if m is not None:
            ts = self.timestamp_us or None
            return [m.at(ts, self.shard)]
        batch, positions, shards, failed = self.messages, self.positions, self.shards, self.failed
        assert batch is not None and positions is not None and shards is not None
        if not failed:
            return [
                m.at(*at) if at is not None else m.at(None, shards[i])
                for i, (m, at) in enumerate(zip(batch, positions, strict=True))
            ]
        stored: list[Message] = []
        lost: list[tuple[Message, MqdsError]] = []
        for index, m in enumerate(batch):
            ts, shard = positions[index] or (None, shards[index])
            copy = m.at(ts, shard)
            if index in failed:
                lost.append((copy, failed[index]))
            else:
                stored.append(copy)
        if not stored:
            raise lost[0][1]
        raise PartialBatchError(stored, lost, self.sequence)


class PendingCall(CallState):
    """A call's state without a handle to wait on (the pipeline's unit tests drive the rules with it)."""

    __slots__ = CALL_SLOTS

    def __init__(
        self,
        messages: Message | Sequence[Message],
        n_shards: int,
        deadline: float,
        refused: dict[int, MqdsError] | None = None,
    ) -> None:
        self.setup(messages, n_shards, deadline, refused)


STORE_STREAM_METHOD = "/mqds.v1.Storage/StoreStream"


def store_stream(channel: Any) -> Any:
    """``Storage.StoreStream`` on a channel (sync or ``grpc.aio``), taking requests already encoded (bytes).

    Its answers are ``(sequence, timestamps)`` pairs, or parsed ``StoreStreamResponse`` s where the C
    reader leaves them to protobuf (:func:`mqds.client.core.store_frames.read_answer`).
    """
    return channel.stream_stream(
        STORE_STREAM_METHOD,
        request_serializer=None,
        response_deserializer=store_frames.read_answer,
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


class StoreCall:
    """One StoreStream call of a driver's pipeline: its gRPC call, the requests queued for it, how it ends.

    A driver's stream sets ``call`` and defines ``_put`` (queue a request, or None to end the requests).
    """

    call: Any

    def __init__(self, state: Any) -> None:
        self.state = state
        """The stream's :class:`~mqds.client.core.pipeline.StreamState`."""

    def _put(self, request: bytes | None) -> None:
        raise NotImplementedError

    def send(self, request: bytes) -> None:
        self._put(request)

    def cancel(self) -> None:
        self._put(None)
        self.call.cancel()

    def failure(self, address: str, call_error: Callable[[grpc.RpcError], MqdsError], failure: Exception) -> MqdsError:
        """What the stream ends with when reading its answers failed: the call's status, or (a bug) an
        unexpected error, logged, after which the call is cancelled."""
        if isinstance(failure, grpc.RpcError):
            return call_error(failure)
        logging.getLogger(__name__).exception("store stream to %s failed", address)
        self.call.cancel()
        return read_failed(failure)
