"""Persistent-session consumers: what the runner needs of one, and the fetch-and-acknowledge loop they share.

A consumer fetches what a broker would deliver to an offline MQTT session
(``fetch_offline``) and acknowledges it (``ack``), with its own client, over
and over while the faults run, then until a fetch begun after the workload
ended comes back empty (the drain). Every delivered message is recorded in
order, redeliveries included: an acknowledgement lost to a fault means the
message comes again, which at-least-once delivery allows, so the checker
counts redeliveries and reports a loss only for an acknowledged write that a
consumer never got. The two kinds,
:class:`~mqds.chaos.workload.pubsub_consumer.PubsubConsumer` and
:class:`~mqds.chaos.workload.queue_consumer.QueueConsumer`, differ in how they
acknowledge (:meth:`FetchAckConsumer._ack`).
:class:`SessionConsumer` is what the runner needs of a consumer.
"""

from __future__ import annotations

import logging
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, Protocol

from mqds.chaos.history import TOPIC_FILTER, ConsumerLog, History, ReadMessage, parse_message
from mqds.chaos.workload.pause import PauseGate
from mqds.client import Client, Message
from mqds.client import errors as E

log = logging.getLogger(__name__)


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


class FetchAckConsumer(ABC):
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
