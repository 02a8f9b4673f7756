"""The queue consumers (``chaos-queue-<n>``): they share queue mode on the topics of a slow publisher of their own.

Between them they must get every message of it; see :class:`QueueConsumer`
for why not all of ``chaos/#``.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from mqds.chaos.history import QUEUE
from mqds.chaos.workload.consumer import FetchAckConsumer
from mqds.client import Message
from mqds.client import errors as E

QUEUE_SENDER = "queue"
"""The sender (and topic level) of the queue consumers' messages: ``chaos/queue/<seq>``."""
QUEUE_BATCH = 2
QUEUE_INTERVAL_S = 0.25
"""The queue publisher writes QUEUE_BATCH messages, then pauses this long: at most 8 messages a second."""


class QueueConsumer(FetchAckConsumer):
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
