"""The synchronous client's pipelined writes: one StoreStream per leader node, run with threads.

:class:`SyncPipeline` runs the rules of :mod:`mqds.client.core.pipeline` without
a thread of its own on the path of a write: the caller's thread queues its
call and, when the shard has room, seals and sends the batch itself; the
reader thread of a stream takes an answer, settles its calls and sends what
queued meanwhile. Settled calls are published (their futures completed,
callbacks run) outside the lock, in the order they settled, by whichever of
those threads settled them (one at a time). A timer thread sleeps until the
pipeline's ``check_at`` (a deadline, the end of a backoff, a stalled
stream) and does what is due then.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from mqds.client.core.pipeline import Pipeline, PipelineLimits, Plan, StreamState
from mqds.client.core.pipeline_calls import CallState, StoreCall, closed_error, store_stream
from mqds.client.model import Message
from mqds.client.sync.handles import StoreFuture, publish
from mqds.client.sync.routing import Router
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason

__all__ = ["SyncPipeline"]


class _Stream(StoreCall):
    """One StoreStream call: a request queue feeding gRPC, and a thread reading the acknowledgements."""

    def __init__(self, owner: SyncPipeline, state: StreamState) -> None:
        super().__init__(state)
        self.owner = owner
        self.requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        router = owner.router
        self.call = store_stream(router.channel(state.address))(self._requests(), metadata=router.metadata)
        threading.Thread(target=self._read, name="mqds-store-stream", daemon=True).start()

    def _put(self, request: bytes | None) -> None:
        self.requests.put(request)

    def _requests(self) -> Iterator[bytes]:
        while (request := self.requests.get()) is not None:
            yield request

    def _read(self) -> None:
        err: MqdsError | None = None
        try:
            for response in self.call:
                self.owner.on_response(self.state, response)
        except Exception as failure:  # a status, or a bug: never leave the calls waiting
            err = self.failure(self.state.address, self.owner.router.settings.call_error, failure)
        self._put(None)  # ends gRPC's thread that reads the requests
        self.owner.on_end(self.state, err)


class SyncPipeline:
    """Pipelined writes of a :class:`mqds.client.Client`; thread-safe."""

    def __init__(
        self, router: Router, producer_id: str, sequences: Iterator[int], limits: PipelineLimits | None = None
    ) -> None:
        self.router = router
        self.core = Pipeline(router.table, producer_id, sequences, limits, router.backoff)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # the timer and callers waiting for room
        self._room_waiters = 0
        self._closed = False
        self._refreshing = False
        self._settled: deque[CallState] = deque()
        self._publishing = False
        self._timer: threading.Thread | None = None
        self._timer_at = math.inf

    def submit(self, messages: Message | Sequence[Message], n_shards: int, deadline: float) -> StoreFuture:
        """Queue a call (waiting for room in the window until its deadline); its future."""
        call = StoreFuture(messages, n_shards, deadline)
        count = call.count
        core = self.core
        with self._lock:
            if not core.has_room(count) and not self._closed:
                self._wait_for_room(call, count)
            if call.settled:  # no room before its deadline
                alone = True
            elif self._closed:
                call.fail(closed_error())
                alone = True
            else:
                alone = False
                settled = core.add(call)
                if settled:  # refused: its messages are bad
                    self._settled.extend(settled)
                if core.has_work:
                    self._execute(core.plan())
                if core.check_at < self._timer_at:
                    self._wake_timer()
        if alone:
            publish((call,))
        elif self._settled:
            self._publish()
        return call

    def _wait_for_room(self, call: StoreFuture, count: int) -> None:
        self._room_waiters += 1
        try:
            while not self._closed and not self.core.has_room(count):
                remaining = call.deadline - time.monotonic()
                if remaining <= 0:
                    call.fail(errors.error(Reason.DEADLINE_EXCEEDED, "no room in the write window before the deadline"))
                    return
                self._cond.wait(remaining)
        finally:
            self._room_waiters -= 1

    def pending(self) -> list[StoreFuture]:
        """The futures of every call submitted so far that is not complete yet."""
        with self._lock:
            calls = [*self._settled, *self.core.unsettled()]
        return [c for c in calls if isinstance(c, StoreFuture) and not c.done()]

    def wait_pending(self, budget_s: float) -> tuple[int, int]:
        """Wait up to ``budget_s`` for the calls pending now; (how many are still pending, how many were)."""
        waiting = self.pending()
        end = time.monotonic() + budget_s
        return sum(1 for f in waiting if not f.wait(end - time.monotonic())), len(waiting)

    # -- events from the streams (reader threads) ----------------------------------

    def on_response(self, state: StreamState, response: Any) -> None:
        core = self.core
        with self._lock:
            self._took(core.acked(state, response))
            if core.has_work:
                self._execute(core.plan())
                if core.check_at < self._timer_at:
                    self._wake_timer()
        if self._settled:
            self._publish()

    def on_end(self, state: StreamState, err: MqdsError | None) -> None:
        with self._lock:
            if not self._closed:
                self._took(self.core.stream_ended(state, err))
                if self.core.has_work:
                    self._execute(self.core.plan())
                if self.core.check_at < self._timer_at:
                    self._wake_timer()
        if self._settled:
            self._publish()

    # -- under the lock --------------------------------------------------------------

    def _execute(self, plan: Plan) -> None:
        """Run a plan: cancel, open and feed streams (in the lock: a stream's frames go in sequence order)."""
        _, failed = self.core.carry_out(plan, lambda state: _Stream(self, state))
        self._settled.extend(failed)
        self._took(plan.settled)
        if plan.refresh_map and not self._refreshing:
            self._refreshing = True
            self.router.submit(self._refresh)

    def _took(self, settled: Sequence[CallState]) -> None:
        """Calls the pipeline settled: to be published; room in the window for the callers waiting."""
        if settled:
            self._settled.extend(settled)
            if self._room_waiters:
                self._cond.notify_all()

    def _wake_timer(self) -> None:
        if self._timer is None:
            self._timer = threading.Thread(target=self._run_timer, name="mqds-store-timer", daemon=True)
            self._timer.start()
        else:
            self._cond.notify_all()

    # -- publishing, outside the lock ----------------------------------------------------

    def _publish(self) -> None:
        """Complete the settled calls' futures in the order they settled; one thread at a time does it."""
        with self._lock:
            if self._publishing or not self._settled:
                return
            self._publishing = True
        try:
            while True:
                with self._lock:
                    if not self._settled:
                        self._publishing = False
                        return
                    calls = list(self._settled)
                    self._settled.clear()
                publish(calls)
        except BaseException:
            with self._lock:
                self._publishing = False
            raise

    # -- the timer ---------------------------------------------------------------------

    def _run_timer(self) -> None:
        core = self.core
        while True:
            with self._lock:
                while not self._closed:
                    now = time.monotonic()
                    if core.check_at <= now or core.has_work:
                        break
                    self._timer_at = core.check_at
                    self._cond.wait(None if core.check_at == math.inf else core.check_at - now)
                self._timer_at = math.inf
                if self._closed:
                    return
                self._execute(core.plan())
                self._timer_at = core.check_at
            if self._settled:
                self._publish()

    def _refresh(self) -> None:
        try:
            self.router.refresh_quietly(2.0)
        finally:
            with self._lock:
                self._refreshing = False

    def close(self) -> None:
        """Cancel the streams; calls not acknowledged yet fail with UNAVAILABLE."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            streams = [s.handle for s in self.core.streams.values()]
            self._settled.extend(self.core.close(closed_error()))
            self._cond.notify_all()
        for stream in streams:
            if isinstance(stream, _Stream):
                stream.cancel()
        self._publish()
        timer = self._timer
        if timer is not None and timer is not threading.current_thread():
            timer.join(timeout=5)
