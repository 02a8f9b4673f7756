"""Pipelined publishers: one-message ``store_async`` calls, many in flight, through the faults.

What a broker does (the amqtt plugin and the ExHook provider store through
the client's pipeline): each call stores one message, ``in_flight`` of them
are unacknowledged at once, and the client library coalesces them into
batches on a ``StoreStream`` per node, resending unacknowledged batches with
their sequences after a lost stream or a leader change. The checker's
contract is the same as for the other publishers: every acknowledged message
stored exactly once, in order. A call whose future fails (its deadline
passed through a long fault) is recorded with an unknown outcome and not
retried: the pipeline gave up on it, and storing it again under a new
sequence could store it twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures

from mqds.chaos.history import OK, UNKNOWN, Attempt, History, MessageKey, payload_of, topic_of
from mqds.chaos.workload.publisher import PublisherThread
from mqds.client import Client, Message
from mqds.client import errors as E
from mqds.protocol.sharding import shard_of

log = logging.getLogger(__name__)


class PipelinedPublisher(PublisherThread):
    """One thread writing its sender's messages one per ``store_async`` call, waves of ``in_flight`` calls at a time.

    A wave's calls are all submitted at once and recorded as they settle;
    the next wave follows ``interval_s`` after the last of them.
    """

    def __init__(
        self,
        name: str,
        sender: str,
        make_client: Callable[[], Client],
        history: History,
        n_shards: int,
        *,
        in_flight: int,
        interval_s: float,
        call_timeout_s: float,
    ) -> None:
        super().__init__(name, make_client, history, interval_s)
        self.sender = sender
        self.shard = shard_of(sender, n_shards)
        self.in_flight = in_flight
        self.call_timeout_s = call_timeout_s
        self.next_seq = 0

    def _write_unit(self) -> None:
        """``in_flight`` one-message calls submitted at once, each recorded as its future settles."""
        sent: list[tuple[MessageKey, float, futures.Future[list[Message]]]] = []
        for _ in range(self.in_flight):
            seq = self.next_seq
            self.next_seq += 1
            key = (self.sender, seq)
            self.history.record_attempted([key])
            # QoS 1, as the other publishers: the persistent-session consumers must get every one.
            message = Message(topic_of(self.sender, seq), payload_of(self.sender, seq), sender=self.sender, qos=1)
            sent.append((key, self.history.clock(), self.client.store_async(message, timeout_s=self.call_timeout_s)))
        for key, started, future in sent:
            try:
                (stored,) = self._result(future)
            except E.MqdsError as err:
                self._attempt(started, UNKNOWN, 0, f"{err.reason.value}: {err.message[:200]}")
                continue
            if stored.timestamp_us is None or stored.shard is None:
                self.history.record_anomaly(
                    "ack-without-position", f"{self.name}: {stored.topic} acked without position"
                )
                continue
            self.history.record_acks([(key, int(stored.shard), int(stored.timestamp_us))])
            self._attempt(started, OK, 1, "")

    def _result(self, future: futures.Future[list[Message]]) -> list[Message]:
        """The call's outcome; once the drain is over (``abandon``), the client is closed, which fails it."""
        while True:
            try:
                return future.result(timeout=0.5)
            except futures.TimeoutError:
                if self.abandon.is_set():
                    self.client.close()

    def _attempt(self, started: float, outcome: str, n_acked: int, error: str) -> None:
        self.history.record_attempt(
            Attempt(
                publisher=self.name,
                sequence=None,
                shards=(self.shard,),
                n_messages=1,
                started=started,
                ended=self.history.clock(),
                outcome=outcome,
                n_acked=n_acked,
                error=error,
            )
        )
