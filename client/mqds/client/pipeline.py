"""Pipelined writes (``store_async`` / ``publish``): batches, the window, acks and resends; no I/O.

Both clients share this bookkeeping; they only run the streams
(:mod:`mqds.client.pipeline_sync` with threads, :mod:`mqds.client.pipeline_aio`
with tasks). A :class:`PendingCall` is one ``store_async`` call; its messages
wait per shard until :meth:`Pipeline.plan` seals them into :class:`Batch` es
(everything queued for a shard goes out together, up to the batch limits),
each with a new sequence of the client's counter, and says on which
``StoreStream`` (one per leader node, a :class:`StreamState`) to send them.

Rules that keep writes exactly once and in order per shard:

- A shard's sent batches are all on one stream, acknowledged in send order.
  New batches follow the shard's in-flight ones on that stream; a shard
  without batches in flight goes to its leader's stream.
- A batch keeps its sequence and messages forever, so resending it (after a
  broken stream or a leader change) is deduplicated by the node.
- A stream only takes increasing sequences, and refuses a shard after one of
  its batches failed there: a resend that cannot be appended restarts the
  node's stream (cancels it and resends everything it had in flight, in
  sequence order, on a new one).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from mqds.client.pipeline_calls import PendingCall, PipelineLimits, check_message, check_messages, resolve_limits
from mqds.client.retry import Backoff
from mqds.client.routing_table import RoutingTable
from mqds.protocol import errors
from mqds.protocol.errors import BUSY, MqdsError, Reason
from mqds.protocol.wire import encode_message, store_stream_frame
from mqds.v1 import storage_pb2 as pb

__all__ = [
    "Batch",
    "PendingCall",
    "Pipeline",
    "PipelineLimits",
    "Plan",
    "StreamState",
    "check_message",
    "check_messages",
    "resolve_limits",
]

_REDIRECTS = (Reason.NOT_LEADER, Reason.NOT_HOSTED)
# Per-message framing in a request, on top of the message's own size.
_FRAME_BYTES = 16


@dataclass(eq=False)
class Batch:
    """One shard's batch on a stream: its sequence, messages, and which call each message belongs to."""

    shard: int
    sequence: int
    entries: list[tuple[PendingCall, int]]
    request: bytes
    """The encoded ``StoreStreamRequest`` (see :func:`mqds.protocol.wire.store_stream_frame`)."""
    stream: StreamState | None = None

    @property
    def settled(self) -> bool:
        return all(call.done for call, _ in self.entries)


@dataclass(eq=False)
class StreamState:
    """One StoreStream call to a node: what it has in flight, its last sequence, the shards it refuses."""

    address: str
    in_flight: dict[int, Batch] = field(default_factory=dict)
    last_sequence: int = 0
    poisoned: set[int] = field(default_factory=set)
    closed: bool = False
    handle: object = None
    """The transport's call object."""


@dataclass
class Plan:
    """What the transport does next: open, cancel and send on streams; then wake at ``wake_at`` at the latest."""

    opened: list[StreamState] = field(default_factory=list)
    cancelled: list[StreamState] = field(default_factory=list)
    sends: list[tuple[StreamState, Batch]] = field(default_factory=list)
    settled: list[PendingCall] = field(default_factory=list)
    refresh_map: bool = False
    wake_at: float | None = None


class _Shard:
    def __init__(self, backoff: Backoff) -> None:
        self.queued: deque[tuple[PendingCall, int, bytes, int]] = deque()
        self.batches: deque[Batch] = deque()  # sealed, not acknowledged, in sequence order
        self.not_before = 0.0
        self.backoff = backoff
        self.delays: Iterator[float] = backoff.delays()

    def stream(self) -> StreamState | None:
        return self.batches[0].stream if self.batches else None


class Pipeline:
    """The state of a client's pipelined writes. Not thread-safe: the transport holds a lock around every call."""

    def __init__(
        self,
        table: RoutingTable,
        producer_id: str,
        sequences: Iterator[int],
        limits: PipelineLimits | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.table = table
        self.producer_id = producer_id
        self.sequences = sequences
        self.limits = limits or PipelineLimits()
        self.backoff = backoff or Backoff()
        self.shards: dict[int, _Shard] = {}
        self.streams: dict[str, StreamState] = {}
        self.unsettled_messages = 0
        self.stats = {"calls": 0, "batches": 0, "messages": 0}
        """Calls taken, and batches (with their messages) built from them; resends not counted."""
        self._deadlines: list[tuple[float, int, PendingCall]] = []
        self._refresh = False

    # -- calls -----------------------------------------------------------------

    def has_room(self, count: int) -> bool:
        """Whether a call of ``count`` messages fits the window now (one larger than it fits an empty one)."""
        return self.unsettled_messages == 0 or self.unsettled_messages + count <= self.limits.max_in_flight_messages

    def add(self, call: PendingCall) -> list[PendingCall]:
        """Queue a call's messages per shard (not those it refused); the calls settled at once (nothing to send)."""
        self.stats["calls"] += 1
        if not call.parts_left:
            call.done = True
            return [call]
        self.unsettled_messages += len(call.messages)
        heapq.heappush(self._deadlines, (call.deadline, call.id, call))
        shards = self.shards
        refused = call.failed
        for index, (m, shard) in enumerate(zip(call.messages, call.shards, strict=True)):
            if refused and index in refused:
                continue
            encoded = encode_message(m.topic, m.payload, m.sender, m.qos, m.retain, m.properties)
            state = shards.get(shard) or shards.setdefault(shard, _Shard(self.backoff))
            state.queued.append((call, index, encoded, len(encoded) + _FRAME_BYTES))
        return []

    def unsettled(self) -> list[object]:
        """The transport handles (futures) of every call taken and not settled yet (``flush`` waits for them)."""
        return [call.handle for _, _, call in self._deadlines if not call.done]

    def _settle(self, call: PendingCall, out: list[PendingCall]) -> None:
        call.done = True
        self.unsettled_messages -= len(call.messages)
        out.append(call)

    def close(self, err: MqdsError) -> list[PendingCall]:
        """Fail every call not settled yet with ``err``; the streams to cancel are ``self.streams``."""
        out: list[PendingCall] = []
        for _, _, call in self._deadlines:
            if not call.done:
                call.fail(err)
                self._settle(call, out)
        self._deadlines.clear()
        self.shards.clear()
        for stream in self.streams.values():
            stream.closed = True
        return out

    # -- planning --------------------------------------------------------------

    def plan(self, now: float | None = None) -> Plan:
        """Expire calls past their deadline, seal queued messages into batches, and say where to send them."""
        now = time.monotonic() if now is None else now
        plan = Plan(refresh_map=self._refresh)
        self._refresh = False
        self._expire(now, plan.settled)
        for shard, state in self.shards.items():
            if state.not_before <= now:
                self._seal(shard, state)
        while True:
            sends = self._ready(now)
            stuck = [a for a, batches in sends.items() if not self._appendable(self.streams.get(a), batches)]
            if not stuck:
                break
            for address in stuck:  # restart: resend everything it had in flight on a new stream
                old = self.streams.pop(address)
                plan.cancelled.append(old)
                self._requeue_stream(old)
        for address, batches in sends.items():
            stream = self.streams.get(address)
            if stream is None:
                stream = self.streams[address] = StreamState(address)
                plan.opened.append(stream)
            for batch in batches:
                batch.stream = stream
                stream.in_flight[batch.sequence] = batch
                stream.last_sequence = batch.sequence
                plan.sends.append((stream, batch))
        waits = [s.not_before for s in self.shards.values() if s.not_before > now and (s.batches or s.queued)]
        while self._deadlines and self._deadlines[0][2].done:
            heapq.heappop(self._deadlines)
        if self._deadlines:
            waits.append(self._deadlines[0][0])
        plan.wake_at = min(waits) if waits else None
        return plan

    def _expire(self, now: float, out: list[PendingCall]) -> None:
        while self._deadlines and (self._deadlines[0][0] <= now or self._deadlines[0][2].done):
            _, _, call = heapq.heappop(self._deadlines)
            if not call.done:
                call.fail(call.last_error or errors.error(Reason.DEADLINE_EXCEEDED, "not acknowledged in time"))
                self._settle(call, out)

    def _seal(self, shard: int, state: _Shard) -> None:
        limits = self.limits
        while state.queued and len(state.batches) < limits.max_batches_per_shard:
            entries: list[tuple[PendingCall, int]] = []
            messages: list[bytes] = []
            size = 0
            while state.queued and len(messages) < limits.max_batch_messages:
                call, index, encoded, nbytes = state.queued[0]
                if messages and size + nbytes > limits.max_batch_bytes:
                    break
                state.queued.popleft()
                if call.done:
                    continue
                entries.append((call, index))
                messages.append(encoded)
                size += nbytes
            if not entries:
                continue
            sequence = next(self.sequences)
            self.stats["batches"] += 1
            self.stats["messages"] += len(messages)
            for call, _ in entries:
                call.sequence = call.sequence or sequence
            request = store_stream_frame(messages, self.producer_id, sequence)
            state.batches.append(Batch(shard, sequence, entries, request))

    def _ready(self, now: float) -> dict[str, list[Batch]]:
        """The unsent batches of every shard that may send now, by the address they go to, in sequence order."""
        sends: dict[str, list[Batch]] = {}
        for shard, state in self.shards.items():
            if state.not_before > now:
                continue
            # Drop unsent batches whose calls all settled (their deadline passed).
            kept = deque(b for b in state.batches if b.stream is not None or not b.settled)
            state.batches = kept
            unsent = [b for b in kept if b.stream is None]
            if not unsent:
                continue
            sticky = state.stream()
            address = sticky.address if sticky is not None else self._route(shard)
            sends.setdefault(address, []).extend(unsent)
        for batches in sends.values():
            batches.sort(key=lambda b: b.sequence)
        return sends

    def _route(self, shard: int) -> str:
        return self.table.leader_of(shard) or self.table.known_addresses()[0]

    @staticmethod
    def _appendable(stream: StreamState | None, batches: list[Batch]) -> bool:
        if stream is None:
            return True
        return batches[0].sequence > stream.last_sequence and not any(b.shard in stream.poisoned for b in batches)

    def _requeue_stream(self, stream: StreamState) -> None:
        stream.closed = True
        for batch in stream.in_flight.values():
            batch.stream = None
        stream.in_flight.clear()

    def _requeue_shard(self, stream: StreamState, shard: int) -> None:
        for batch in self.shards[shard].batches:
            if batch.stream is stream:
                batch.stream = None
                stream.in_flight.pop(batch.sequence, None)

    # -- answers ---------------------------------------------------------------

    def acked(self, stream: StreamState, response: pb.StoreStreamResponse) -> list[PendingCall]:
        """A batch's answer on ``stream``; the calls it settled. Answers of batches moved elsewhere are ignored."""
        out: list[PendingCall] = []
        batch = stream.in_flight.pop(response.sequence, None) if not stream.closed else None
        if batch is None:
            return out
        result = response.result
        failure = next((f for f in result.failures if f.shard == batch.shard), None)
        if failure is not None or len(result.positions) != len(batch.entries):
            err = (
                errors.from_failure(failure)
                if failure is not None
                else errors.error(Reason.INTERNAL, "the node answered a batch with the wrong number of positions")
            )
            self._batch_failed(stream, batch, err, out)
            return out
        state = self.shards[batch.shard]
        if state.batches and state.batches[0] is batch:
            state.batches.popleft()
        else:
            state.batches.remove(batch)
        state.delays = state.backoff.delays()
        entries = batch.entries
        for (call, index), position in zip(entries, result.positions, strict=True):
            call.positions[index] = (position.timestamp_us, position.shard)
        # Messages the node refused alone (the rest of the batch is stored): each fails its own call.
        for refused in result.message_failures:
            if refused.index < len(entries):
                call, index = entries[refused.index]
                call.positions[index] = None
                call.failed[index] = errors.from_message_failure(refused, f"message {index}")
        self._parts_done(batch, out)
        return out

    def _parts_done(self, batch: Batch, out: list[PendingCall]) -> None:
        """Settle, in call order, the calls whose part on ``batch``'s shard this batch completed."""
        checked: set[int] = set()
        for call, _ in batch.entries:
            if call.done:
                continue
            if len(call.messages) == 1:  # the common case: its one message is answered
                call.parts_left = 0
                self._settle(call, out)
            elif call.id not in checked:
                checked.add(call.id)
                positions, failed = call.positions, call.failed
                if (
                    all(positions[i] is not None or i in failed for i, s in enumerate(call.shards) if s == batch.shard)
                    and call.part_settled()
                ):
                    self._settle(call, out)

    def _batch_failed(self, stream: StreamState, batch: Batch, err: MqdsError, out: list[PendingCall]) -> None:
        stream.poisoned.add(batch.shard)
        self._requeue_shard(stream, batch.shard)
        batch.stream = None
        if err.retriable:
            for call, _ in batch.entries:
                call.last_error = err
            self._retry_later(batch.shard, err)
            return
        self.shards[batch.shard].batches.remove(batch)
        for call, index in batch.entries:
            call.failed[index] = err
        self._parts_done(batch, out)

    def _retry_later(self, shard: int, err: MqdsError) -> None:
        state = self.shards[shard]
        if err.reason in _REDIRECTS and self.table.learn(err, shard):
            return  # the hinted leader, at once
        if err.reason not in BUSY and err.reason is not Reason.STREAM_IDLE:
            self.table.forget_leader(shard)
            self._refresh = True
        if err.reason is not Reason.STREAM_IDLE:
            state.not_before = time.monotonic() + next(state.delays)

    def stream_ended(self, stream: StreamState, err: MqdsError | None) -> list[PendingCall]:
        """``stream`` ended (``err`` None: closed by the node without a status); the calls that settles."""
        out: list[PendingCall] = []
        if stream.closed:
            return out
        if self.streams.get(stream.address) is stream:
            del self.streams[stream.address]
        batches = sorted(stream.in_flight.values(), key=lambda b: b.sequence)
        self._requeue_stream(stream)
        if not batches:
            return out
        err = err or errors.error(Reason.UNAVAILABLE, f"the node at {stream.address} ended the stream")
        for shard in sorted({b.shard for b in batches}):
            if err.retriable:
                for batch in batches:
                    for call, _ in batch.entries:
                        call.last_error = err
                self._retry_later(shard, err)
        if not err.retriable:
            for batch in batches:
                self.shards[batch.shard].batches.remove(batch)
                for call, index in batch.entries:
                    call.failed[index] = err
                self._parts_done(batch, out)
        return out
