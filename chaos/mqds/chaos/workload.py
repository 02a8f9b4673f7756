"""The workload of a chaos run: exactly-once publishers, iterator readers, persistent-session consumers.

**Publishers.** Each publisher thread has its own :class:`~mqds.client.Client`
(its own producer id) and writes batches of messages of its senders, numbered
by a per-sender sequence, one call at a time. Most publishers have one sender,
chosen so that every shard has one (which is what lets the checker time write
outages per vnode); the "multi" publishers put three senders on three shards
in every call, so calls fail part-way (``PartialBatchError``). Every call is
recorded as an :class:`~mqds.chaos.history.Attempt`; its messages are recorded
as attempted before the call, and as acknowledged with their positions when it
returns. A call that fails with a retriable error is retried with the same
messages and the same client sequence (``err.metadata["sequence"]``, or only
the failed messages with ``err.sequence`` after a partial failure), until it
succeeds or the drain ends: the exactly-once contract under test.

**Readers.** Each reader thread tails the filter ``chaos/#`` the way a broker
replays a persistent session: it asks for the streams now and again, keeps an
iterator per stream, and calls ``next`` on each. It checks what it sees as it
goes (a message that was never attempted, one seen twice, a sender's messages
out of order within a stream) and records every message it saw, so the checker
can tell whether anything read during the faults is missing at the end. One
reader reads from leaders (linearizable), the other with ``stale_ok`` from any
replica.

**Persistent-session consumers** fetch what a broker would deliver to an
offline MQTT session (``fetch_offline``) and acknowledge it (``ack``), each
with its own client, over and over while the faults run, then until a fetch
begun after the workload ended comes back empty (the drain). Every delivered
message is recorded in order, redeliveries included: an acknowledgement lost
to a fault means the message comes again, which at-least-once delivery allows,
so the checker counts redeliveries and reports a loss only for an
acknowledged write that a consumer never got. Each :class:`PubsubConsumer`
(``chaos-sub-<n>``) has its own read position on ``chaos/#`` and must get
every message; two :class:`QueueConsumer` threads (``chaos-queue-<n>``) share
queue mode on the topics of a slow publisher of their own (sender
``queue``; see the class for why not all of ``chaos/#``), and between them
must get every message of it.
:class:`SessionConsumer` is what the runner needs of a consumer.

**Pausing.** Publishers and consumers pass a :class:`PauseGate` before each
unit of work (a batch with its retries; a fetch with its acknowledgements).
:class:`WorkloadPause` closes the gates of all of them and waits (bounded)
until the units in flight are done, so the cluster gets no writes at all for
an idle spell (the ``idle-restart`` nemeses); a call still in flight when the
bound runs out goes on as any call does (a kill makes its outcome unknown, and
it is retried). Readers are not paused: reads write nothing.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar, Protocol

from mqds.chaos.history import (
    FAILED,
    OK,
    PARTIAL,
    PUBSUB,
    QUEUE,
    TOPIC_FILTER,
    UNKNOWN,
    Attempt,
    ConsumerLog,
    History,
    MessageKey,
    ReadMessage,
    parse_message,
    payload_of,
    topic_of,
)
from mqds.client import Client, Message
from mqds.client import errors as E
from mqds.client.model import Iterator, Stream
from mqds.protocol.sharding import shard_of

log = logging.getLogger(__name__)


def senders_for_shards(prefix: str, n_shards: int, shards: list[int]) -> list[str]:
    """One sender clientid per shard in ``shards``: ``<prefix><n>`` with the first n that hashes there."""
    found: dict[int, str] = {}
    wanted = set(shards)
    n = 0
    while wanted - set(found):
        name = f"{prefix}{n}"
        shard = shard_of(name, n_shards)
        if shard in wanted and shard not in found:
            found[shard] = name
        n += 1
    return [found[s] for s in shards]


class PauseGate:
    """Where a worker thread may be held between two units of work.

    The worker calls :meth:`enter` before a unit (it blocks while the gate is
    closed, and returns False once ``stop`` is set) and :meth:`leave` after it.
    :meth:`close` makes the next ``enter`` block; :meth:`wait_quiet` waits
    until no unit is in flight; :meth:`open` lets the worker go on.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False

    def enter(self, stop: threading.Event) -> bool:
        with self._cond:
            while self._closed and not stop.is_set():
                self._cond.wait(0.2)
            if stop.is_set():
                return False
            self._busy = True
            return True

    def leave(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True

    def open(self) -> None:
        with self._cond:
            self._closed = False
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def wait_quiet(self, timeout_s: float) -> bool:
        """Until no unit of work is in flight (True), or ``timeout_s`` passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._busy, timeout_s)


class WorkloadPause:
    """Pause and resume the writers of a run (publishers, consumers, hostile clients): each has a PauseGate."""

    def __init__(self, history: History) -> None:
        self.history = history
        self.gates: dict[str, PauseGate] = {}
        self.paused_at: float | None = None

    def add(self, name: str, gate: PauseGate) -> None:
        self.gates[name] = gate

    @property
    def paused(self) -> bool:
        return self.paused_at is not None

    def pause(self, timeout_s: float) -> list[str]:
        """Close every gate, then wait until the units in flight are done; the names of those still busy."""
        self.paused_at = self.history.clock()
        for gate in self.gates.values():
            gate.close()
        deadline = time.monotonic() + timeout_s
        return [name for name, gate in self.gates.items() if not gate.wait_quiet(max(0.0, deadline - time.monotonic()))]

    def resume(self) -> float | None:
        """Open every gate; when the pause began (None if it was not paused)."""
        began, self.paused_at = self.paused_at, None
        for gate in self.gates.values():
            gate.open()
        return began


class Publisher:
    """One thread writing batches of its senders' messages, exactly once, until told to stop."""

    def __init__(
        self,
        name: str,
        senders: list[str],
        make_client: Callable[[], Client],
        history: History,
        n_shards: int,
        *,
        batch: int,
        interval_s: float,
        call_timeout_s: float,
    ) -> None:
        self.name = name
        self.senders = senders
        self.client = make_client()
        self.history = history
        self.n_shards = n_shards
        self.shards = tuple(sorted({shard_of(s, n_shards) for s in senders}))
        self.batch = batch
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self.next_seq = dict.fromkeys(senders, 0)
        # stop: begin no new batch; abandon: stop retrying too (the drain is over).
        self.stop = threading.Event()
        self.abandon = threading.Event()
        self.gate = PauseGate()
        self.thread = threading.Thread(target=self._run, name=f"chaos-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _messages(self) -> list[Message]:
        per_sender = max(1, self.batch // len(self.senders))
        out = []
        for sender in self.senders:
            start = self.next_seq[sender]
            for seq in range(start, start + per_sender):
                out.append(Message(topic=topic_of(sender, seq), payload=payload_of(sender, seq), sender=sender, qos=1))
            self.next_seq[sender] = start + per_sender
        return out

    @staticmethod
    def _key(message: Message) -> MessageKey:
        return message.sender, int(message.topic.rsplit("/", 1)[1])

    def _run(self) -> None:
        try:
            while self.gate.enter(self.stop):
                try:
                    self._write_one_batch()
                finally:
                    self.gate.leave()
                self.stop.wait(self.interval_s)
        except Exception as err:  # a bug in the client or here: record it, it fails the run
            log.exception("publisher %s died", self.name)
            self.history.record_anomaly("publisher-crashed", f"{self.name}: {err!r}")
        finally:
            self.client.close()

    def _write_one_batch(self) -> None:
        pending = self._messages()
        self.history.record_attempted([self._key(m) for m in pending])
        sequence: int | None = None
        backoff = 0.05
        while pending and not self.abandon.is_set():
            started = self.history.clock()
            shards = tuple(sorted({shard_of(m.sender, self.n_shards) for m in pending}))
            try:
                stored = self.client.store_batch(pending, timeout_s=self.call_timeout_s, sequence=sequence)
            except E.PartialBatchError as err:
                self._acked(err.stored)
                retriable = err.retriable
                self._attempt(err.sequence, shards, pending, started, PARTIAL, len(err.stored), err)
                if not retriable:
                    self._attempt(err.sequence, shards, err.failed_messages, started, FAILED, 0, err)
                    return
                pending, sequence = err.failed_messages, err.sequence
            except E.MqdsError as err:
                # Without a sequence the call failed before it sent anything (no cluster map).
                given = err.metadata.get("sequence")
                if given is not None:
                    sequence = int(given)
                self._attempt(sequence, shards, pending, started, UNKNOWN if err.retriable else FAILED, 0, err)
                if not err.retriable:
                    return
            else:
                self._acked(stored)
                if len(stored) != len(pending):
                    self.history.record_anomaly(
                        "short-ack", f"{self.name}: store_batch returned {len(stored)} of {len(pending)} messages"
                    )
                self._attempt(sequence, shards, pending, started, OK, len(stored), None)
                return
            time.sleep(backoff)
            backoff = min(backoff * 2, 0.5)

    def _acked(self, stored: list[Message]) -> None:
        acks = []
        for m in stored:
            if m.timestamp_us is None or m.shard is None:
                self.history.record_anomaly("ack-without-position", f"{self.name}: {m.topic} acked without position")
                continue
            acks.append((self._key(m), int(m.shard), int(m.timestamp_us)))
        self.history.record_acks(acks)

    def _attempt(
        self,
        sequence: int | None,
        shards: tuple[int, ...],
        messages: list[Message],
        started: float,
        outcome: str,
        n_acked: int,
        err: E.MqdsError | None,
    ) -> None:
        self.history.record_attempt(
            Attempt(
                publisher=self.name,
                sequence=sequence,
                shards=shards,
                n_messages=len(messages),
                started=started,
                ended=self.history.clock(),
                outcome=outcome,
                n_acked=n_acked,
                error=f"{err.reason.value}: {err.message[:200]}" if err is not None else "",
            )
        )


class Reader:
    """One thread tailing ``chaos/#`` with iterators, checking what it sees."""

    def __init__(
        self,
        name: str,
        make_client: Callable[[], Client],
        history: History,
        *,
        stale_ok: bool,
        batch_size: int = 500,
        streams_every_s: float = 1.0,
    ) -> None:
        self.name = name
        self.client = make_client()
        self.history = history
        self.stale_ok = stale_ok
        self.batch_size = batch_size
        self.streams_every_s = streams_every_s
        self.iterators: dict[Stream, Iterator | None] = {}
        self.last_seq: dict[tuple[Stream, str], int] = {}
        self.seen: set[MessageKey] = set()
        self.errors = 0
        self.read = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"chaos-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        next_streams = 0.0
        try:
            while not self._stop.is_set():
                try:
                    if time.monotonic() >= next_streams:
                        self._discover()
                        next_streams = time.monotonic() + self.streams_every_s
                    got = self._poll()
                except E.MqdsError as err:
                    self._error(err)
                    self._stop.wait(0.2)
                    continue
                if not got:
                    self._stop.wait(0.2)
        except Exception as err:
            log.exception("reader %s died", self.name)
            self.history.record_anomaly("reader-crashed", f"{self.name}: {err!r}")
        finally:
            self.client.close()

    def _error(self, err: E.MqdsError) -> None:
        self.errors += 1
        if err.retriable:
            return
        if self.stale_ok and isinstance(err, E.NotFoundError):
            # A replica behind (or being rebuilt after a wipe) may not know the stream yet.
            return
        self.history.record_anomaly("reader-error", f"{self.name}: {err}")

    def _discover(self) -> None:
        for _, stream in self.client.get_streams(TOPIC_FILTER, 0, stale_ok=self.stale_ok, timeout_s=5):
            if stream not in self.iterators:
                self.iterators[stream] = self.client.make_iterator(
                    stream, TOPIC_FILTER, 0, stale_ok=self.stale_ok, timeout_s=5
                )

    def _poll(self) -> int:
        got = 0
        for stream, iterator in list(self.iterators.items()):
            if iterator is None or self._stop.is_set():
                continue
            try:
                result = self.client.next(iterator, self.batch_size, stale_ok=self.stale_ok, timeout_s=5)
            except E.MqdsError as err:
                self._error(err)
                continue
            self._observe(stream, result.messages)
            got += len(result.messages)
            self.iterators[stream] = None if result.end_of_stream else result.iterator
        return got

    def _observe(self, stream: Stream, messages: list[Message]) -> None:
        seen = []
        for m in messages:
            key = parse_message(m.topic, m.payload)
            if key is None:
                self.history.record_anomaly("reader-unexpected", f"{self.name}: unparsable message on {m.topic!r}")
                continue
            if not self.history.is_attempted(key):
                self.history.record_anomaly("reader-unexpected", f"{self.name}: {key[0]}#{key[1]} never attempted")
            if key in self.seen:
                self.history.record_anomaly("reader-duplicate", f"{self.name}: {key[0]}#{key[1]} seen twice")
            self.seen.add(key)
            last = self.last_seq.get((stream, key[0]))
            if last is not None and key[1] <= last:
                self.history.record_anomaly(
                    "reader-order", f"{self.name}: {key[0]}#{key[1]} after #{last} in shard {stream.shard} stream"
                )
            self.last_seq[(stream, key[0])] = key[1]
            seen.append(ReadMessage(key[0], key[1], int(m.shard or 0), int(m.timestamp_us or 0)))
        self.read += len(seen)
        self.history.record_seen(seen)


class SessionConsumer(Protocol):
    """A persistent-session consumer, as the runner drives it.

    ``start`` starts its thread; ``finish`` begins the drain (stop once a
    fetch begun after this comes back empty); ``stop`` stops it at once (the
    drain ran out of time, or the run is over); ``thread`` is joined. What it
    was delivered goes to its :class:`~mqds.chaos.history.ConsumerLog`
    (``log``), which the checker reads.
    """

    name: str
    log: ConsumerLog
    thread: threading.Thread
    gate: PauseGate

    def start(self) -> None: ...

    def finish(self) -> None: ...

    def stop(self) -> None: ...


QUEUE_SENDER = "queue"
"""The sender (and topic level) of the queue consumers' messages: ``chaos/queue/<seq>``."""
QUEUE_BATCH = 2
QUEUE_INTERVAL_S = 0.25
"""The queue publisher writes QUEUE_BATCH messages, then pauses this long: at most 8 messages a second."""


class _FetchAckConsumer(ABC):
    """The loop both consumer kinds share: fetch, record, acknowledge, back off on errors, idle when caught up.

    A fetch that does not fill ``max_count`` means the consumer caught up, so
    it waits for its next turn: every ``poll_s`` on the run's clock,
    ``phase_s`` into the period (this bounds the load it adds, as a fetch is a
    read of every shard and each acknowledgement a Raft write, and lets
    consumers that share a queue take turns). A full one means more is
    waiting, so it fetches again at once. Errors are expected while faults
    run: a retriable one (no leader, a deadline) backs off and the loop goes
    on, and whatever was not acknowledged comes again. A non-retriable error
    is a finding (an anomaly), as for the readers.
    """

    mode: ClassVar[str]

    def __init__(
        self,
        name: str,
        make_client: Callable[[], Client],
        history: History,
        *,
        topic_filter: str = TOPIC_FILTER,
        max_count: int = 500,
        poll_s: float = 2.0,
        phase_s: float = 0.0,
        call_timeout_s: float = 5.0,
    ) -> None:
        self.name = name
        self.topic_filter = topic_filter
        self.client = make_client()
        self.history = history
        self.log = history.add_consumer(name, self.mode, topic_filter)
        self.max_count = max_count
        self.poll_s = poll_s
        self.phase_s = phase_s
        self.call_timeout_s = call_timeout_s
        self._stop = threading.Event()
        self._finish = threading.Event()
        # Ends the wait for the next turn: once draining, nothing new comes, so there is no point waiting.
        self._wake = threading.Event()
        self.gate = PauseGate()
        self.thread = threading.Thread(target=self._run, name=f"chaos-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        self._finish.set()
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        backoff = 0.1
        try:
            self._idle()
            while self.gate.enter(self._stop):
                # Only a fetch that began after the workload ended can prove the consumer has everything.
                finishing = self._finish.is_set()
                error: E.MqdsError | None = None
                messages: list[Message] = []
                try:
                    messages = self.client.fetch_offline(
                        self.name, self.topic_filter, self.mode, self.max_count, timeout_s=self.call_timeout_s
                    )
                    if messages:
                        self._deliver(messages)
                        self._ack(messages)
                except E.MqdsError as err:
                    error = err
                finally:
                    self.gate.leave()
                if error is not None:
                    self._error(error)
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 1.0)
                    continue
                backoff = 0.1
                if not messages and finishing:
                    self.log.drained = True
                    return
                if len(messages) < self.max_count:
                    self._idle()
        except Exception as err:  # a bug in the client or here: record it, it fails the run
            log.exception("consumer %s died", self.name)
            self.history.record_anomaly("consumer-crashed", f"{self.name}: {err!r}")
        finally:
            self._close()

    def _idle(self) -> None:
        """Wait for this consumer's next turn: ``phase_s`` past a multiple of ``poll_s`` on the run's clock."""
        now = self.history.clock()
        turns = math.floor((now - self.phase_s) / self.poll_s) + 1
        self._wake.wait(self.phase_s + turns * self.poll_s - now)

    def _close(self) -> None:
        self.client.close()

    def _error(self, err: E.MqdsError) -> None:
        self.log.errors += 1
        if not err.retriable:
            self.history.record_anomaly("consumer-error", f"{self.name}: {err}")

    def _deliver(self, messages: list[Message]) -> None:
        got = []
        for m in messages:
            key = parse_message(m.topic, m.payload)
            if key is None:
                self.history.record_anomaly("consumer-unexpected", f"{self.name}: unparsable message on {m.topic!r}")
                continue
            got.append(ReadMessage(key[0], key[1], int(m.shard or 0), int(m.timestamp_us or 0)))
        self.history.record_delivered(self.name, got)

    def _ack_one(self, message: Message) -> E.MqdsError | None:
        """Acknowledge one message; the error, if it failed (it is then delivered again)."""
        try:
            self.client.ack(self.name, self.topic_filter, message, mode=self.mode, timeout_s=self.call_timeout_s)
        except E.MqdsError as err:
            return err
        return None

    @abstractmethod
    def _ack(self, messages: list[Message]) -> None:
        """Acknowledge what a fetch delivered (counting acks and errors in ``log``)."""


class PubsubConsumer(_FetchAckConsumer):
    """A subscriber with its own read position on ``chaos/#``: it must get every stored message.

    It acknowledges the last message of each shard in a fetch, as a broker
    does once the client acknowledged everything delivered: the read
    position is per shard, and acknowledging a message acknowledges the
    earlier ones of its shard. All of a consumer's acknowledgements go to the
    shard of its clientid, so after the first one fails the others would
    wait out the same missing leader: it stops there, and the rest come
    again with the next fetch.
    """

    mode = PUBSUB

    def _ack(self, messages: list[Message]) -> None:
        last: dict[int | None, Message] = {}
        for m in messages:  # oldest first: the last of each shard is the furthest
            last[m.shard] = m
        for m in last.values():
            if self._stop.is_set():
                return
            err = self._ack_one(m)
            if err is not None:
                self._error(err)
                return
            self.log.acks += 1


class QueueConsumer(_FetchAckConsumer):
    """One of the queue readers sharing ``topic_filter``: between them they must get every message of it.

    Queue mode has no read position: every fetch reads the matching streams
    from their start and skips what a queue reader acknowledged, and every
    message takes an acknowledgement of its own (a Raft write in its shard).
    On all of ``chaos/#`` that would add a write per message to the
    publishers' load and make each fetch read the whole history. Even one
    ordinary sender (30 messages a second) was too much: the acknowledgements
    tripled the writes to its vnode, whose leadership then could not be
    handed over (a transfer needs the target to have the whole log), and the
    membership fault took two to three times as long. So the runner adds a
    publisher of their own (sender :data:`QUEUE_SENDER`,
    :data:`QUEUE_BATCH` messages every :data:`QUEUE_INTERVAL_S` s, retried
    exactly once like the others). A fetch's acknowledgements go out together
    (``ACKS_IN_FLIGHT``), and the consumers take turns (``phase_s``), so each
    mostly finds what the other took already acknowledged; what both got (a
    turn that ran long, an acknowledgement lost) is counted, not a violation.
    """

    mode = QUEUE
    ACKS_IN_FLIGHT = 8
    _pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        self._pool = ThreadPoolExecutor(self.ACKS_IN_FLIGHT, thread_name_prefix=f"chaos-{self.name}-ack")
        super().start()

    def _ack(self, messages: list[Message]) -> None:
        pool = self._pool
        assert pool is not None, "acknowledging before start()"
        failed = threading.Event()

        def one(m: Message) -> tuple[bool, E.MqdsError | None]:
            """(acknowledged, the error): skipped after a failure, as the shard most likely has no leader."""
            if failed.is_set() or self._stop.is_set():
                return False, None
            err = self._ack_one(m)
            if err is not None:
                failed.set()
            return err is None, err

        for acked, err in pool.map(one, messages):
            self.log.acks += acked
            if err is not None:
                self._error(err)

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        super()._close()
