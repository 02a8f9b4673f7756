"""The asyncio client's pipelined writes: one ``grpc.aio`` StoreStream per leader node, run with tasks.

:class:`AsyncPipeline` runs the rules of :mod:`mqds.client.core.pipeline` on the
event loop: callers queue calls (awaiting room in the window); the calls
queued during one pass of the loop are sealed and sent once, by a callback
scheduled with ``call_soon`` when the first of them finds its shard with
room; a stream's reader task takes an answer, completes its calls' futures
(in the order they settled) and sends what queued meanwhile. A timer
(``call_at``) runs the pipeline at its ``check_at``: a deadline, the end of a
backoff, a stalled stream. Each stream has a writer task (so a node that
stops reading slows the writer, never the loop) and a reader task.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from mqds.client.aio.handles import AsyncStoreFuture, publish
from mqds.client.aio.routing import AsyncRouter
from mqds.client.core.pipeline import Pipeline, PipelineLimits, Plan, StreamState
from mqds.client.core.pipeline_calls import CallState, StoreCall, closed_error, store_stream
from mqds.client.model import Message
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason

__all__ = ["AsyncPipeline"]


class _Stream(StoreCall):
    """One StoreStream call with its writer and reader tasks."""

    def __init__(self, owner: AsyncPipeline, state: StreamState) -> None:
        super().__init__(state)
        self.call: Any = store_stream(owner.router.channel(state.address))(metadata=owner.router.metadata)
        self.owner = owner
        self.requests: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.tasks = [asyncio.ensure_future(self._write()), asyncio.ensure_future(self._read())]

    async def _write(self) -> None:
        with contextlib.suppress(Exception):  # a failed call is reported by the reader
            while (request := await self.requests.get()) is not None:
                await self.call.write(request)
            await self.call.done_writing()

    async def _read(self) -> None:
        err: MqdsError | None = None
        try:
            while (response := await self.call.read()) is not grpc.aio.EOF:
                self.owner.on_response(self.state, response)
        except Exception as failure:  # a status, or a bug: never leave the calls waiting
            err = self.failure(self.state.address, self.owner.router.settings.call_error, failure)
        self._put(None)
        self.owner.on_end(self.state, err)

    def _put(self, request: bytes | None) -> None:
        self.requests.put_nowait(request)


class AsyncPipeline:
    """Pipelined writes of a :class:`mqds.client.aio.Client`; belongs to the client's event loop."""

    def __init__(
        self, router: AsyncRouter, producer_id: str, sequences: Iterator[int], limits: PipelineLimits | None = None
    ) -> None:
        self.router = router
        self.core = Pipeline(router.table, producer_id, sequences, limits, router.backoff)
        self._room_waiters: list[asyncio.Future[None]] = []  # callers waiting for room in the window
        self._closed = False
        self._refreshing = False
        self._flush_soon = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._streams: list[_Stream] = []
        self._refresh_task: asyncio.Future[None] | None = None

    def pending(self) -> list[AsyncStoreFuture]:
        """The futures of every call submitted so far that is not complete yet."""
        return [c for c in self.core.unsettled() if isinstance(c, AsyncStoreFuture) and not c.done()]

    async def wait_pending(self, budget_s: float) -> tuple[int, int]:
        """Wait up to ``budget_s`` for the calls pending now; (how many are still pending, how many were)."""
        waiting = self.pending()
        if not waiting:
            return 0, 0
        _, left = await asyncio.wait(waiting, timeout=budget_s)
        return len(left), len(waiting)

    async def submit(self, messages: Message | Sequence[Message], n_shards: int, deadline: float) -> AsyncStoreFuture:
        """Queue a call (awaiting room in the window until its deadline); its future."""
        loop = asyncio.get_running_loop()
        call = AsyncStoreFuture.create(loop, messages, n_shards, deadline)
        core = self.core
        if not self._closed and not core.has_room(call.count):
            await self._wait_for_room(call)
        if call.settled:  # no room before its deadline
            publish((call,))
            return call
        if self._closed:
            call.fail(closed_error())
            publish((call,))
            return call
        settled = core.add(call)
        if settled:  # refused: its messages are bad
            publish(settled)
        if core.has_work and not self._flush_soon:
            self._flush_soon = True
            loop.call_soon(self._flush)
        if core.check_at < self._timer_at:
            self._arm_timer(loop)
        return call

    async def _wait_for_room(self, call: AsyncStoreFuture) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed and not self.core.has_room(call.count):
            remaining = call.deadline - time.monotonic()
            if remaining <= 0:
                call.fail(errors.error(Reason.DEADLINE_EXCEEDED, "no room in the write window before the deadline"))
                return
            room: asyncio.Future[None] = loop.create_future()
            self._room_waiters.append(room)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(room, remaining)

    # -- events from the streams ---------------------------------------------------

    def on_response(self, state: StreamState, response: Any) -> None:
        self._settled(self.core.acked(state, response))
        if self.core.has_work:
            self._run(self.core.plan())

    def on_end(self, state: StreamState, err: MqdsError | None) -> None:
        if not self._closed:
            self._settled(self.core.stream_ended(state, err))
            if self.core.has_work:
                self._run(self.core.plan())
            if self.core.check_at < self._timer_at:
                self._arm_timer(asyncio.get_running_loop())

    # -- planning --------------------------------------------------------------------

    def _flush(self) -> None:
        self._flush_soon = False
        if not self._closed and self.core.has_work:
            self._run(self.core.plan())

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, math.inf
        if self._closed:
            return
        self._run(self.core.plan())

    def _arm_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        at = self.core.check_at
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = loop.call_later(max(0.0, at - time.monotonic()), self._on_timer) if at < math.inf else None

    def _run(self, plan: Plan) -> None:
        opened, failed = self.core.carry_out(plan, lambda state: _Stream(self, state))
        plan.settled.extend(failed)
        if opened:
            self._streams = [s for s in self._streams if not s.state.closed]
            self._streams += [s for s in opened if isinstance(s, _Stream)]
        if plan.refresh_map and not self._refreshing:
            self._refreshing = True
            self._refresh_task = asyncio.ensure_future(self._refresh())
        if self.core.check_at < self._timer_at or self._timer is None:
            self._arm_timer(asyncio.get_running_loop())
        self._settled(plan.settled)

    def _settled(self, calls: Sequence[CallState]) -> None:
        if not calls:
            return
        publish(calls)
        if self._room_waiters:
            self._wake_room()

    def _wake_room(self) -> None:
        waiters, self._room_waiters = self._room_waiters, []
        for room in waiters:
            if not room.done():
                room.set_result(None)

    async def _refresh(self) -> None:
        try:
            await self.router.refresh_quietly(2.0)
        finally:
            self._refreshing = False

    async def close(self) -> None:
        """Cancel the streams; calls not acknowledged yet fail with UNAVAILABLE."""
        if self._closed:
            return
        self._closed = True
        publish(self.core.close(closed_error()))
        if self._timer is not None:
            self._timer.cancel()
        tasks: list[asyncio.Future[Any]] = []
        for stream in self._streams:
            stream.cancel()
            tasks.extend(stream.tasks)
        self._wake_room()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
