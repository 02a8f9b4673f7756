"""The synchronous client's pipelined writes: one StoreStream per leader node, run with threads.

:class:`SyncPipeline` runs the rules of :mod:`mqds.client.pipeline`: callers
queue calls (waiting for room in the window), one pump thread seals batches,
opens, cancels and feeds the streams and completes the futures (in the order
the calls settled, so a shard's futures complete in call order), and one
reader thread per stream hands its acknowledgements back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent import futures

import grpc

from mqds.client.model import Message
from mqds.client.pipeline import PendingCall, Pipeline, PipelineLimits, Plan, StreamState, check_messages
from mqds.client.pipeline_calls import closed_error, open_failed, read_failed, resolve, store_stream
from mqds.client.routing import Router
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.v1 import storage_pb2 as pb

__all__ = ["SyncPipeline"]

log = logging.getLogger(__name__)


class _Stream:
    """One StoreStream call: a request queue feeding gRPC, and a thread reading the acknowledgements."""

    def __init__(self, owner: SyncPipeline, state: StreamState) -> None:
        self.owner = owner
        self.state = state
        self.requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        router = owner.router
        self.call = store_stream(router.channel(state.address))(self._requests(), metadata=router.metadata)
        threading.Thread(target=self._read, name="mqds-store-stream", daemon=True).start()

    def _requests(self) -> Iterator[bytes]:
        while (request := self.requests.get()) is not None:
            yield request

    def _read(self) -> None:
        err: MqdsError | None = None
        try:
            for response in self.call:
                self.owner.on_response(self.state, response)
        except grpc.RpcError as rpc_error:
            err = self.owner.router.settings.call_error(rpc_error)
        except Exception as unexpected:  # never leave the calls waiting
            log.exception("store stream to %s failed", self.state.address)
            err = read_failed(unexpected)
        self.owner.on_end(self.state, err)

    def send(self, request: bytes) -> None:
        self.requests.put(request)

    def cancel(self) -> None:
        self.requests.put(None)
        self.call.cancel()


class SyncPipeline:
    """Pipelined writes of a :class:`mqds.client.Client`; thread-safe."""

    def __init__(
        self, router: Router, producer_id: str, sequences: Iterator[int], limits: PipelineLimits | None = None
    ) -> None:
        self.router = router
        self.core = Pipeline(router.table, producer_id, sequences, limits, router.backoff)
        self._cond = threading.Condition()
        self._dirty = False
        self._closed = False
        self._refreshing = False
        self._settled: deque[PendingCall] = deque()
        self._pump: threading.Thread | None = None

    def submit(self, messages: Sequence[Message], n_shards: int, deadline: float) -> futures.Future[list[Message]]:
        """Queue a call (waiting for room in the window until its deadline); its future."""
        future: futures.Future[list[Message]] = futures.Future()
        refused = check_messages(messages)
        if refused and len(refused) == len(messages):  # nothing to send: the first one's error
            future.set_exception(refused[0])
            return future
        call = PendingCall(messages, n_shards, deadline, refused)
        call.handle = future
        with self._cond:
            while not self._closed and not self.core.has_room(len(call.messages)):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    future.set_exception(
                        errors.error(Reason.DEADLINE_EXCEEDED, "no room in the write window before the deadline")
                    )
                    return future
                self._cond.wait(remaining)
            if self._closed:
                future.set_exception(closed_error())
                return future
            self._settled.extend(self.core.add(call))
            self._wake()
            if self._pump is None:
                self._pump = threading.Thread(target=self._run, name="mqds-store-pump", daemon=True)
                self._pump.start()
        return future

    def _wake(self) -> None:
        self._dirty = True
        self._cond.notify_all()

    def pending(self) -> list[futures.Future[list[Message]]]:
        """The futures of every call submitted so far that is not complete yet."""
        with self._cond:
            handles = [call.handle for call in self._settled] + self.core.unsettled()
        return [f for f in handles if isinstance(f, futures.Future) and not f.done()]

    # -- events from the streams (reader threads) ----------------------------------

    def on_response(self, state: StreamState, response: pb.StoreStreamResponse) -> None:
        with self._cond:
            self._settled.extend(self.core.acked(state, response))
            self._wake()

    def on_end(self, state: StreamState, err: MqdsError | None) -> None:
        with self._cond:
            if not self._closed:
                self._settled.extend(self.core.stream_ended(state, err))
            self._wake()

    # -- the pump ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._dirty and not self._closed:
                    wake_at = self._wake_at
                    timeout = None if wake_at is None else max(0.0, wake_at - time.monotonic())
                    if timeout == 0.0:
                        break
                    self._cond.wait(timeout)
                if self._closed:
                    return
                self._dirty = False
                plan = self.core.plan()
                self._wake_at = plan.wake_at
                self._execute(plan)
                settled = list(self._settled) + plan.settled
                self._settled.clear()
                if plan.settled:
                    self._cond.notify_all()  # room in the window
                refresh = plan.refresh_map and not self._refreshing
                self._refreshing = self._refreshing or refresh
            for call in settled:
                resolve(call)
            if refresh:
                self.router.submit(self._refresh)

    _wake_at: float | None = None

    def _execute(self, plan: Plan) -> None:
        for state in plan.cancelled:
            if isinstance(state.handle, _Stream):
                state.handle.cancel()
        for state in plan.opened:
            try:
                state.handle = _Stream(self, state)
            except Exception as err:  # a closed channel: end the stream at once
                self._settled.extend(self.core.stream_ended(state, open_failed(err)))
        for state, batch in plan.sends:
            if isinstance(state.handle, _Stream):
                state.handle.send(batch.request)

    def _refresh(self) -> None:
        try:
            self.router.refresh_quietly(2.0)
        finally:
            with self._cond:
                self._refreshing = False
                self._wake()

    def close(self) -> None:
        """Cancel the streams; calls not acknowledged yet fail with UNAVAILABLE."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            streams = [s.handle for s in self.core.streams.values()]
            settled = list(self._settled) + self.core.close(closed_error())
            self._settled.clear()
            self._cond.notify_all()
        for stream in streams:
            if isinstance(stream, _Stream):
                stream.cancel()
        for call in settled:
            resolve(call)
        if self._pump is not None and self._pump is not threading.current_thread():
            self._pump.join(timeout=5)
