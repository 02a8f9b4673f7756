"""The exactly-once publishers of a chaos run.

Each publisher thread has its own :class:`~mqds.client.Client` (its own
producer id) and writes batches of messages of its senders, numbered by a
per-sender sequence, one call at a time. Most publishers have one sender,
chosen so that every shard has one (:func:`senders_for_shards`: which is
what lets the checker time write outages per vnode); the "multi" publishers
put three senders on three shards in every call, so calls fail part-way
(``PartialBatchError``). Every call is recorded as an
:class:`~mqds.chaos.history.Attempt`; its messages are recorded as attempted
before the call, and as acknowledged with their positions when it returns. A
call that fails with a retriable error is retried with the same messages and
the same client sequence (``err.metadata["sequence"]``, or only the failed
messages with ``err.sequence`` after a partial failure), until it succeeds or
the drain ends: the exactly-once contract under test.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Callable

from mqds.chaos.history import FAILED, OK, PARTIAL, UNKNOWN, Attempt, History, MessageKey, payload_of, topic_of
from mqds.chaos.workload.pause import PauseGate
from mqds.client import Client, Message
from mqds.client import errors as E
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


class PublisherThread(abc.ABC):
    """What every publisher is: a thread with its own client, doing one unit of writes at a time between pauses.

    ``stop``: begin no new unit; ``abandon``: the drain is over, give up on
    what is unacknowledged. A subclass writes one unit in ``_write_unit``.
    """

    def __init__(self, name: str, make_client: Callable[[], Client], history: History, interval_s: float) -> None:
        self.name = name
        self.client = make_client()
        self.history = history
        self.interval_s = interval_s
        self.stop = threading.Event()
        self.abandon = threading.Event()
        self.gate = PauseGate()
        self.thread = threading.Thread(target=self._run, name=f"chaos-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @abc.abstractmethod
    def _write_unit(self) -> None:
        """One unit of writes (the pause gate is held around it)."""

    def _run(self) -> None:
        try:
            while self.gate.enter(self.stop):
                try:
                    self._write_unit()
                finally:
                    self.gate.leave()
                self.stop.wait(self.interval_s)
        except Exception as err:  # a bug in the client or here: record it, it fails the run
            log.exception("publisher %s died", self.name)
            self.history.record_anomaly("publisher-crashed", f"{self.name}: {err!r}")
        finally:
            self.client.close()


class Publisher(PublisherThread):
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
        super().__init__(name, make_client, history, interval_s)
        self.senders = senders
        self.n_shards = n_shards
        self.shards = tuple(sorted({shard_of(s, n_shards) for s in senders}))
        self.batch = batch
        self.call_timeout_s = call_timeout_s
        self.next_seq = dict.fromkeys(senders, 0)

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

    def _write_unit(self) -> None:
        """One batch, retried with its sequence until acknowledged or abandoned."""
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
