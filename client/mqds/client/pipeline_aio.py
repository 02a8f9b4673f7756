"""The asyncio client's pipelined writes: one ``grpc.aio`` StoreStream per leader node, run with tasks.

:class:`AsyncPipeline` runs the rules of :mod:`mqds.client.pipeline` on the
event loop: callers queue calls (awaiting room in the window), one pump task
seals batches, opens, cancels and feeds the streams and completes the
futures in the order the calls settled; each stream has a writer task (so a
node that stops reading slows the writer, never the loop) and a reader task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from mqds.client.aio_routing import AsyncRouter
from mqds.client.model import Message
from mqds.client.pipeline import PendingCall, Pipeline, PipelineLimits, Plan, StreamState, check_messages
from mqds.client.pipeline_calls import closed_error, open_failed, read_failed, resolve, store_stream
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.v1 import storage_pb2 as pb

__all__ = ["AsyncPipeline"]

log = logging.getLogger(__name__)


class _Stream:
    """One StoreStream call with its writer and reader tasks."""

    def __init__(self, owner: AsyncPipeline, state: StreamState) -> None:
        self.owner = owner
        self.state = state
        self.requests: asyncio.Queue[bytes | None] = asyncio.Queue()
        router = owner.router
        self.call: Any = store_stream(router.channel(state.address))(metadata=router.metadata)
        self.tasks = [asyncio.ensure_future(self._write()), asyncio.ensure_future(self._read())]

    async def _write(self) -> None:
        with contextlib.suppress(Exception):  # a failed call is reported by the reader
            while (request := await self.requests.get()) is not None:
                await self.call.write(request)
            await self.call.done_writing()

    async def _read(self) -> None:
        err: MqdsError | None = None
        try:
            while True:
                response = await self.call.read()
                if response is grpc.aio.EOF:
                    break
                self.owner.on_response(self.state, response)
        except grpc.RpcError as rpc_error:
            err = self.owner.router.settings.call_error(rpc_error)
        except asyncio.CancelledError:
            raise
        except Exception as unexpected:  # never leave the calls waiting
            log.exception("store stream to %s failed", self.state.address)
            err = read_failed(unexpected)
        self.owner.on_end(self.state, err)

    def send(self, request: bytes) -> None:
        self.requests.put_nowait(request)

    def cancel(self) -> None:
        self.requests.put_nowait(None)
        self.call.cancel()


class AsyncPipeline:
    """Pipelined writes of a :class:`mqds.client.aio.Client`; belongs to the client's event loop."""

    def __init__(
        self, router: AsyncRouter, producer_id: str, sequences: Iterator[int], limits: PipelineLimits | None = None
    ) -> None:
        self.router = router
        self.core = Pipeline(router.table, producer_id, sequences, limits, router.backoff)
        self._dirty = asyncio.Event()
        self._room = asyncio.Condition()
        self._closed = False
        self._refreshing = False
        self._settled: deque[PendingCall] = deque()
        self._pump: asyncio.Task[None] | None = None
        self._streams: list[_Stream] = []
        self._refresh_task: asyncio.Future[None] | None = None

    def pending(self) -> list[asyncio.Future[list[Message]]]:
        """The futures of every call submitted so far that is not complete yet."""
        handles = [call.handle for call in self._settled] + self.core.unsettled()
        return [f for f in handles if isinstance(f, asyncio.Future) and not f.done()]

    async def submit(
        self, messages: Sequence[Message], n_shards: int, deadline: float
    ) -> asyncio.Future[list[Message]]:
        """Queue a call (awaiting room in the window until its deadline); its future."""
        future: asyncio.Future[list[Message]] = asyncio.get_running_loop().create_future()
        refused = check_messages(messages)
        if refused and len(refused) == len(messages):  # nothing to send: the first one's error
            future.set_exception(refused[0])
            return future
        call = PendingCall(messages, n_shards, deadline, refused)
        call.handle = future
        if not self._closed and not self.core.has_room(len(call.messages)):
            try:
                async with self._room:
                    await asyncio.wait_for(
                        self._room.wait_for(lambda: self._closed or self.core.has_room(len(call.messages))),
                        max(0.0, deadline - time.monotonic()),
                    )
            except TimeoutError:
                future.set_exception(
                    errors.error(Reason.DEADLINE_EXCEEDED, "no room in the write window before the deadline")
                )
                return future
        if self._closed:
            future.set_exception(closed_error())
            return future
        self._settled.extend(self.core.add(call))
        self._dirty.set()
        if self._pump is None:
            self._pump = asyncio.ensure_future(self._run())
        return future

    # -- events from the streams ---------------------------------------------------

    def on_response(self, state: StreamState, response: pb.StoreStreamResponse) -> None:
        self._settled.extend(self.core.acked(state, response))
        self._dirty.set()

    def on_end(self, state: StreamState, err: MqdsError | None) -> None:
        if not self._closed:
            self._settled.extend(self.core.stream_ended(state, err))
            self._dirty.set()

    # -- the pump ------------------------------------------------------------------

    async def _run(self) -> None:
        wake_at: float | None = None
        while not self._closed:
            timeout = None if wake_at is None else max(0.0, wake_at - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), timeout)
            if self._closed:
                return
            self._dirty.clear()
            plan = self.core.plan()
            wake_at = plan.wake_at
            self._execute(plan)
            settled = list(self._settled) + plan.settled
            self._settled.clear()
            for call in settled:
                resolve(call)
            if settled:
                async with self._room:
                    self._room.notify_all()
            if plan.refresh_map and not self._refreshing:
                self._refreshing = True
                self._refresh_task = asyncio.ensure_future(self._refresh())

    def _execute(self, plan: Plan) -> None:
        for state in plan.cancelled:
            if isinstance(state.handle, _Stream):
                state.handle.cancel()
        for state in plan.opened:
            try:
                stream = _Stream(self, state)
            except Exception as err:  # a closed channel: end the stream at once
                self._settled.extend(self.core.stream_ended(state, open_failed(err)))
                continue
            state.handle = stream
            self._streams = [s for s in self._streams if not s.state.closed]
            self._streams.append(stream)
        for state, batch in plan.sends:
            if isinstance(state.handle, _Stream):
                state.handle.send(batch.request)

    async def _refresh(self) -> None:
        try:
            await self.router.refresh_quietly(2.0)
        finally:
            self._refreshing = False
            self._dirty.set()

    async def close(self) -> None:
        """Cancel the streams; calls not acknowledged yet fail with UNAVAILABLE."""
        if self._closed:
            return
        self._closed = True
        settled = list(self._settled) + self.core.close(closed_error())
        self._settled.clear()
        for call in settled:
            resolve(call)
        tasks: list[asyncio.Future[Any]] = []
        for stream in self._streams:
            stream.cancel()
            tasks.extend(stream.tasks)
        if self._pump is not None:
            self._dirty.set()
            tasks.append(self._pump)
        async with self._room:
            self._room.notify_all()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
