"""Pipelined writes (``store_async`` / ``publish``): batches, the window, acks, resends, deadlines; no I/O.

Both clients share this bookkeeping; they only run the streams
(:mod:`mqds.client.sync.pipeline` with threads, :mod:`mqds.client.aio.pipeline`
with tasks). A call (:class:`~mqds.client.core.pipeline_calls.CallState`: the
handle the caller holds) waits in its shard's queue until :meth:`Pipeline.plan`
seals what is queued into :class:`Batch` es (everything queued for a shard
goes out together, up to the batch limits), each with a new sequence of the
client's counter, and says on which ``StoreStream`` (one per leader node, a
:class:`StreamState`) to send them.

What a call costs: the call itself, one object. A call of one message is
queued as it is (no tuple, no encoded copy); the shard's batch is encoded
from the messages when it is sealed (:func:`mqds.client.core.store_frames.store_frame`)
and its answer sets the call's timestamp. ``plan`` looks only at the shards
that got something to do (``_ready``), not at every shard for every call.

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

And the rule that settles every call by its deadline: ``check_at`` is never
later than the earliest deadline of a call not settled, the end of a
shard's backoff, or the moment a stream with batches in flight has answered
nothing for ``stall_s``; the transport runs :meth:`Pipeline.plan` then (a
timer), which fails the calls past their deadlines, wherever they wait
(queued, sealed, sent), and gives up a stalled stream: its batches go to
the shards' leaders again, as after a broken stream.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from mqds.client.core import store_frames
from mqds.client.core.pipeline_calls import (
    CallState,
    PendingCall,
    PipelineLimits,
    StoreCall,
    check_message,
    check_messages,
    open_failed,
    resolve_limits,
)
from mqds.client.core.retry import Backoff
from mqds.client.core.routing_table import RoutingTable
from mqds.protocol import errors
from mqds.protocol.errors import BUSY, MqdsError, Reason

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
_NOTHING: tuple[CallState, ...] = ()

Entry = Any
"""A queued or sealed message: a one-message call itself, or ``(call, index)`` for a call of several."""


def _call_of(entry: Entry) -> CallState:
    return entry[0] if type(entry) is tuple else entry


class Batch:
    """One shard's batch on a stream: its sequence, its entries (one per message, in order), its frame."""

    __slots__ = ("entries", "request", "sequence", "shard", "stream")

    def __init__(self, shard: int, sequence: int, entries: list[Entry], request: bytes) -> None:
        self.shard = shard
        self.sequence = sequence
        self.entries = entries
        self.request = request
        """The encoded ``StoreStreamRequest`` (see :func:`mqds.client.core.store_frames.store_frame`)."""
        self.stream: StreamState | None = None

    @property
    def settled(self) -> bool:
        return all(_call_of(e).settled for e in self.entries)


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
    waiting_since: float = 0.0
    """When the stream last answered, or got its first batch in flight after answering all it had."""


@dataclass
class Plan:
    """What the transport does next: open, cancel and send on streams; then wake at ``wake_at`` at the latest."""

    opened: list[StreamState] = field(default_factory=list)
    cancelled: list[StreamState] = field(default_factory=list)
    sends: list[tuple[StreamState, Batch]] = field(default_factory=list)
    settled: list[CallState] = field(default_factory=list)
    refresh_map: bool = False
    wake_at: float | None = None


class _Shard:
    __slots__ = ("backoff", "batches", "delays", "earliest", "not_before", "queued")

    def __init__(self, backoff: Backoff) -> None:
        self.queued: deque[Entry] = deque()
        self.batches: deque[Batch] = deque()  # sealed, not acknowledged, in sequence order
        self.not_before = 0.0
        self.earliest = math.inf  # no later than the earliest deadline of a call queued or in a batch here
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
        self.check_at = math.inf
        """No later than the next moment :meth:`plan` has timed work: a deadline, a backoff's end, a stall."""
        self._ready: dict[int, _Shard] = {}
        self._refresh = False
        self._stalled: dict[str, float] = {}
        """Addresses whose stream stalled, avoided until then while their shards' leaders are unknown."""

    # -- calls -----------------------------------------------------------------

    def has_room(self, count: int) -> bool:
        """Whether a call of ``count`` messages fits the window now (one larger than it fits an empty one)."""
        return self.unsettled_messages == 0 or self.unsettled_messages + count <= self.limits.max_in_flight_messages

    @property
    def has_work(self) -> bool:
        """Some shard has something to seal or send (the transport calls :meth:`plan` then)."""
        return bool(self._ready)

    def _shard(self, shard: int) -> _Shard:
        state = self.shards.get(shard)
        if state is None:
            state = self.shards[shard] = _Shard(self.backoff)
        return state

    def add(self, call: CallState) -> Sequence[CallState]:
        """Queue a call's messages per shard (not those it refused); the calls settled at once (nothing to send)."""
        self.stats["calls"] += 1
        if not call.parts_left:
            call.settled = True
            return [call]
        deadline = call.deadline
        if deadline < self.check_at:
            self.check_at = deadline
        if call.messages is None:  # one message: the call is its own entry
            self.unsettled_messages += 1
            shard = call.shard
            state = self.shards.get(shard) or self._shard(shard)
            state.queued.append(call)
            if deadline < state.earliest:
                state.earliest = deadline
            if len(state.batches) < self.limits.max_batches_per_shard:
                self._ready[shard] = state
            return _NOTHING
        self.unsettled_messages += len(call.messages)
        refused = call.failed
        assert call.shards is not None
        for index, shard in enumerate(call.shards):
            if refused and index in refused:
                continue
            state = self._shard(shard)
            state.queued.append((call, index))
            if deadline < state.earliest:
                state.earliest = deadline
            self._ready[shard] = state
        return _NOTHING

    def unsettled(self) -> list[CallState]:
        """Every call taken and not settled yet, once each (``flush`` waits for them)."""
        seen: dict[int, CallState] = {}
        for state in self.shards.values():
            for entry in state.queued:
                call = _call_of(entry)
                if not call.settled:
                    seen.setdefault(id(call), call)
            for batch in state.batches:
                for entry in batch.entries:
                    call = _call_of(entry)
                    if not call.settled:
                        seen.setdefault(id(call), call)
        return list(seen.values())

    def _settle(self, call: CallState, out: list[CallState]) -> None:
        call.settled = True
        self.unsettled_messages -= call.count
        out.append(call)

    def close(self, err: MqdsError) -> list[CallState]:
        """Fail every call not settled yet with ``err``; the streams to cancel are ``self.streams``."""
        out: list[CallState] = []
        for call in self.unsettled():
            call.fail(err)
            self._settle(call, out)
        self.shards.clear()
        self._ready.clear()
        for stream in self.streams.values():
            stream.closed = True
        return out

    # -- planning --------------------------------------------------------------

    def plan(self, now: float | None = None) -> Plan:
        """Do what is due: expire calls past their deadline, give up stalled streams, seal the ready shards'
        queued messages into batches, and say where to send them."""
        now = time.monotonic() if now is None else now
        plan = Plan()
        if now >= self.check_at:
            self._timed(now, plan)
        ready, self._ready = self._ready, {}
        waiting: list[_Shard] = []
        for shard, state in ready.items():
            if state.not_before > now:
                waiting.append(state)
                continue
            self._seal(shard, state)
        while True:
            sends = self._unsent(ready, now)
            stuck = [a for a, batches in sends.items() if not self._appendable(self.streams.get(a), batches)]
            if not stuck:
                break
            for address in stuck:  # restart: resend everything it had in flight on a new stream
                old = self.streams.pop(address)
                plan.cancelled.append(old)
                for shard in self._requeue_stream(old):
                    ready[shard] = self.shards[shard]
        for address, batches in sends.items():
            stream = self.streams.get(address)
            if stream is None:
                stream = self.streams[address] = StreamState(address)
                plan.opened.append(stream)
            if not stream.in_flight:
                stream.waiting_since = now
                self.check_at = min(self.check_at, now + self.limits.stall_s)
            for batch in batches:
                batch.stream = stream
                stream.in_flight[batch.sequence] = batch
                stream.last_sequence = batch.sequence
                plan.sends.append((stream, batch))
        for state in waiting:
            self.check_at = min(self.check_at, state.not_before)
        plan.refresh_map, self._refresh = self._refresh, False
        plan.wake_at = self.check_at if self.check_at < math.inf else None
        return plan

    def _timed(self, now: float, plan: Plan) -> None:
        """Expire calls past their deadlines, end backoffs, give up stalled streams; then ``check_at`` anew."""
        out = plan.settled
        for address, stream in list(self.streams.items()):
            if stream.in_flight and now - stream.waiting_since >= self.limits.stall_s:
                plan.cancelled.append(stream)
                self._stalled[address] = now + self.limits.stall_s
                err = errors.error(
                    Reason.UNAVAILABLE,
                    f"no answer from {address} in {now - stream.waiting_since:.1f} s (stall_s "
                    f"{self.limits.stall_s:g}): the stream was given up and its batches resent",
                )
                out.extend(self.stream_ended(stream, err, now))
        next_at = math.inf
        for shard, state in list(self.shards.items()):
            if state.earliest <= now:
                self._expire(state, now, out)
            if not (state.queued or state.batches):
                if state.not_before <= now:
                    del self.shards[shard]  # idle: a shard that gets calls again starts afresh
                    self._ready.pop(shard, None)
                    continue
            elif state.not_before <= now:
                self._ready[shard] = state
            else:
                next_at = min(next_at, state.not_before)
            next_at = min(next_at, state.earliest)
        for address, until in list(self._stalled.items()):
            if until <= now:
                del self._stalled[address]
        stall_s = self.limits.stall_s
        for stream in self.streams.values():
            if stream.in_flight:
                next_at = min(next_at, stream.waiting_since + stall_s)
        self.check_at = next_at

    def _expire(self, state: _Shard, now: float, out: list[CallState]) -> None:
        earliest = math.inf
        for entries in (state.queued, *(b.entries for b in state.batches)):
            for entry in entries:
                call = _call_of(entry)
                if call.settled:
                    continue
                if call.deadline <= now:
                    call.fail(call.last_error or errors.error(Reason.DEADLINE_EXCEEDED, "not acknowledged in time"))
                    self._settle(call, out)
                elif call.deadline < earliest:
                    earliest = call.deadline
        state.earliest = earliest

    def _seal(self, shard: int, state: _Shard) -> None:
        limits = self.limits
        queued = state.queued
        while queued and len(state.batches) < limits.max_batches_per_shard:
            entries: list[Entry] = []
            messages: list[Any] = []
            size = 0
            while queued and len(entries) < limits.max_batch_messages:
                entry = queued[0]
                if type(entry) is tuple:
                    call, index = entry
                    m = call.messages[index]
                    nbytes = store_frames.message_size(index, m) + _FRAME_BYTES
                else:
                    call = entry
                    m = call.message
                    nbytes = call.nbytes + _FRAME_BYTES
                if entries and size + nbytes > limits.max_batch_bytes:
                    break
                queued.popleft()
                if call.settled:
                    continue
                entries.append(entry)
                messages.append(m)
                size += nbytes
            if not entries:
                continue
            sequence = next(self.sequences)
            self.stats["batches"] += 1
            self.stats["messages"] += len(messages)
            for entry in entries:
                if type(entry) is tuple and not entry[0].sequence:
                    entry[0].sequence = sequence
            request = store_frames.store_frame(messages, self.producer_id, sequence)
            state.batches.append(Batch(shard, sequence, entries, request))

    def _unsent(self, ready: dict[int, _Shard], now: float) -> dict[str, list[Batch]]:
        """The unsent batches of the ready shards that may send now, by the address they go to, in sequence order."""
        sends: dict[str, list[Batch]] = {}
        for shard, state in ready.items():
            if state.not_before > now or not state.batches:
                continue
            if state.batches[-1].stream is not None:  # all sent (the common case)
                continue
            # Drop unsent batches whose calls all settled (their deadline passed).
            state.batches = deque(b for b in state.batches if b.stream is not None or not b.settled)
            unsent = [b for b in state.batches if b.stream is None]
            if not unsent:
                continue
            sticky = state.stream()
            address = sticky.address if sticky is not None else self._route(shard, now)
            sends.setdefault(address, []).extend(unsent)
        for batches in sends.values():
            if len(batches) > 1:
                batches.sort(key=lambda b: b.sequence)
        return sends

    def _route(self, shard: int, now: float) -> str:
        address = self.table.leader_of(shard) or self.table.known_addresses()[0]
        if self._stalled and self._stalled.get(address, 0.0) > now:
            # Its stream stalled lately and no leader is known yet: another replica answers with a hint.
            others = [a for a in self.table.replica_addresses(shard) if self._stalled.get(a, 0.0) <= now]
            if others:
                return others[shard % len(others)]
        return address

    @staticmethod
    def _appendable(stream: StreamState | None, batches: list[Batch]) -> bool:
        if stream is None:
            return True
        return batches[0].sequence > stream.last_sequence and not any(b.shard in stream.poisoned for b in batches)

    def _requeue_stream(self, stream: StreamState) -> set[int]:
        """Take back what ``stream`` had in flight (to be sent again); the shards it belonged to."""
        stream.closed = True
        shards = set()
        for batch in stream.in_flight.values():
            batch.stream = None
            shards.add(batch.shard)
        stream.in_flight.clear()
        return shards

    def _requeue_shard(self, stream: StreamState, shard: int) -> None:
        for batch in self.shards[shard].batches:
            if batch.stream is stream:
                batch.stream = None
                stream.in_flight.pop(batch.sequence, None)

    # -- answers ---------------------------------------------------------------

    def acked(self, stream: StreamState, response: Any) -> Sequence[CallState]:
        """A batch's answer on ``stream`` (a ``StoreStreamResponse``, or ``(sequence, timestamps)`` for one that
        stored every message); the calls it settled. Answers of batches moved elsewhere are ignored."""
        plain = type(response) is tuple
        sequence = response[0] if plain else response.sequence
        batch = stream.in_flight.pop(sequence, None) if not stream.closed else None
        if batch is None:
            return []
        if stream.in_flight:
            stream.waiting_since = time.monotonic()
        entries = batch.entries
        if plain:
            timestamps = response[1]
            if len(timestamps) != len(entries):
                return self._wrong_count(stream, batch)
            shard = batch.shard
            result = None
        else:
            result = response.result
            failure = next((f for f in result.failures if f.shard == batch.shard), None)
            if failure is not None:
                out: list[CallState] = []
                self._batch_failed(stream, batch, errors.from_failure(failure), out)
                return out
            if len(result.positions) != len(entries):
                return self._wrong_count(stream, batch)
        state = self.shards[batch.shard]
        if state.batches and state.batches[0] is batch:
            state.batches.popleft()
        else:
            state.batches.remove(batch)
        state.delays = state.backoff.delays()
        if state.queued or (state.batches and state.batches[-1].stream is None):
            self._ready[batch.shard] = state
        if plain:
            out = []
            for entry, ts in zip(entries, timestamps, strict=True):
                if type(entry) is tuple:
                    call, index = entry
                    call.positions[index] = (ts, shard)
                else:
                    entry.timestamp_us = ts
            return self._parts_done(batch, out)
        assert result is not None
        for entry, position in zip(entries, result.positions, strict=True):
            if type(entry) is tuple:
                call, index = entry
                call.positions[index] = (position.timestamp_us, position.shard)
            else:
                entry.timestamp_us = position.timestamp_us
        # Messages the node refused alone (the rest of the batch is stored): each fails its own call.
        for refused in result.message_failures:
            if refused.index < len(entries):
                entry = entries[refused.index]
                if type(entry) is tuple:
                    call, index = entry
                    call.positions[index] = None
                    call.failed[index] = errors.from_message_failure(refused, f"message {index}")
                elif not entry.settled:
                    entry.timestamp_us = 0
                    entry.error = errors.from_message_failure(refused, "message 0")
        return self._parts_done(batch, [])

    def _wrong_count(self, stream: StreamState, batch: Batch) -> list[CallState]:
        out: list[CallState] = []
        err = errors.error(Reason.INTERNAL, "the node answered a batch with the wrong number of positions")
        self._batch_failed(stream, batch, err, out)
        return out

    def _parts_done(self, batch: Batch, out: list[CallState]) -> list[CallState]:
        """Settle, in call order, the calls whose part on ``batch``'s shard this batch completed."""
        checked: set[int] = set()
        for entry in batch.entries:
            if type(entry) is not tuple:  # the common case: a one-message call, answered
                if not entry.settled:
                    entry.parts_left = 0
                    entry.settled = True
                    self.unsettled_messages -= 1
                    out.append(entry)
                continue
            call = entry[0]
            if call.settled or id(call) in checked:
                continue
            checked.add(id(call))
            positions, failed = call.positions, call.failed
            if (
                all(positions[i] is not None or i in failed for i, s in enumerate(call.shards) if s == batch.shard)
                and call.part_settled()
            ):
                self._settle(call, out)
        return out

    def _batch_failed(self, stream: StreamState, batch: Batch, err: MqdsError, out: list[CallState]) -> None:
        stream.poisoned.add(batch.shard)
        self._requeue_shard(stream, batch.shard)
        batch.stream = None
        self._ready[batch.shard] = self.shards[batch.shard]
        if err.retriable:
            for entry in batch.entries:
                _call_of(entry).last_error = err
            self._retry_later(batch.shard, err)
            return
        self.shards[batch.shard].batches.remove(batch)
        self._fail_entries(batch, err)
        self._parts_done(batch, out)

    @staticmethod
    def _fail_entries(batch: Batch, err: MqdsError) -> None:
        for entry in batch.entries:
            if type(entry) is tuple:
                call, index = entry
                call.failed[index] = err
            elif not entry.settled:
                entry.error = err

    def _retry_later(self, shard: int, err: MqdsError, now: float | None = None) -> None:
        state = self.shards[shard]
        self._ready[shard] = state
        if err.reason in _REDIRECTS and self.table.learn(err, shard):
            return  # the hinted leader, at once
        if err.reason not in BUSY and err.reason is not Reason.STREAM_IDLE:
            self.table.forget_leader(shard)
            self._refresh = True
        if err.reason is not Reason.STREAM_IDLE:
            state.not_before = (time.monotonic() if now is None else now) + next(state.delays)
            self.check_at = min(self.check_at, state.not_before)

    def carry_out(
        self, plan: Plan, open_stream: Callable[[StreamState], StoreCall]
    ) -> tuple[list[StoreCall], list[CallState]]:
        """Do a plan's stream work with the driver's ``open_stream``: cancel, open, send, in that order.

        Returns the streams opened and the calls of those that could not be (a closed channel: each
        such stream ends at once, its calls settled here, for the driver to publish).
        """
        for state in plan.cancelled:
            if isinstance(state.handle, StoreCall):
                state.handle.cancel()
        opened: list[StoreCall] = []
        failed: list[CallState] = []
        for state in plan.opened:
            try:
                stream = open_stream(state)
            except Exception as err:  # a closed channel: end the stream at once
                failed += self.stream_ended(state, open_failed(err))
                continue
            state.handle = stream
            opened.append(stream)
        for state, batch in plan.sends:
            if isinstance(state.handle, StoreCall):
                state.handle.send(batch.request)
        return opened, failed

    def stream_ended(self, stream: StreamState, err: MqdsError | None, now: float | None = None) -> list[CallState]:
        """``stream`` ended (``err`` None: closed by the node without a status); the calls that settles."""
        out: list[CallState] = []
        if stream.closed:
            return out
        if self.streams.get(stream.address) is stream:
            del self.streams[stream.address]
        batches = sorted(stream.in_flight.values(), key=lambda b: b.sequence)
        self._requeue_stream(stream)
        if not batches:
            return out
        err = err or errors.error(Reason.UNAVAILABLE, f"the node at {stream.address} ended the stream")
        if err.retriable:
            for batch in batches:
                for entry in batch.entries:
                    _call_of(entry).last_error = err
            for shard in sorted({b.shard for b in batches}):
                self._retry_later(shard, err, now)
            return out
        for batch in batches:
            self.shards[batch.shard].batches.remove(batch)
            self._fail_entries(batch, err)
            self._parts_done(batch, out)
        return out
