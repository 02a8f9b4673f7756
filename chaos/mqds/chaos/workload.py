"""The workload of a chaos run: publishers that write exactly once, readers that tail with iterators.

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

**Persistent-session consumers** (fetch offline messages, then ack) are the
third client the issue asks for; their API (``fetch_offline``/``ack``) comes
with the broker-persistence issue and does not exist yet. :class:`SessionConsumer`
is the extension point: implement it, add a factory to
:data:`SESSION_CONSUMERS`, and the runner starts, stops and reports it; its
redeliveries are counted per consumer (at-least-once delivery allows them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from mqds.chaos.history import (
    FAILED,
    OK,
    PARTIAL,
    TOPIC_FILTER,
    UNKNOWN,
    Attempt,
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
            while not self.stop.is_set():
                self._write_one_batch()
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
    """A persistent-session consumer (fetch offline messages, ack them): the extension point.

    Not implemented yet: the broker-persistence API it needs (``fetch_offline``,
    ``ack``) arrives with that issue. A consumer starts its thread in
    ``start``, stops it in ``stop``, and reports ``delivered`` (every message
    it got, redeliveries included, in order) so the runner can count
    redeliveries per consumer and check nothing acknowledged to it is missing.
    """

    name: str

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def delivered(self) -> list[ReadMessage]: ...


SESSION_CONSUMERS: list[Callable[[Callable[[], Client], History], SessionConsumer]] = []
"""Factories of the persistent-session consumers a run starts (none until broker persistence exists)."""
