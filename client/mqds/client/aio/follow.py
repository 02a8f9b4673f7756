"""The asyncio client's push subscriptions: one ``grpc.aio`` Follow call per node, run with tasks.

The same rules as :mod:`mqds.client.sync.follow` (they live in
:class:`~mqds.client.core.follow.FollowCore`): :class:`AsyncFollowMux` keeps a
client's calls, one per node, each with a task reading its answers into the
subscription they are for; :class:`AsyncSubscription` is an async iterator of
:class:`~mqds.client.core.follow.FollowBatch` es.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from mqds.client.core import follow as fc
from mqds.client.core.follow import FollowBatch, FollowCore
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.v1 import storage_pb2 as pb

if TYPE_CHECKING:
    from mqds.client.aio.routing import AsyncRouter

__all__ = ["AsyncFollowMux", "AsyncSubscription"]

log = logging.getLogger(__name__)

_Event = tuple[fc.ShardPart, int, pb.FollowResponse | None, MqdsError | None]


class _Call:
    """One Follow call to a node, with the task reading its answers and the task writing its requests.

    Requests wait in ``outbox`` while a write is under way; the writer takes
    them together and merges their credits (``merge_credits``), as the sync
    client does, so many subscribers granting at once cost one request.
    """

    def __init__(self, mux: AsyncFollowMux, address: str) -> None:
        self.mux = mux
        self.address = address
        method = mux.router.channel(address).stream_stream(
            fc.FOLLOW_METHOD,
            request_serializer=pb.FollowRequest.SerializeToString,
            response_deserializer=pb.FollowResponse.FromString,
            _registered_method=True,
        )
        self.call: Any = method(metadata=mux.router.metadata)
        self.ended = False
        self.outbox: list[pb.FollowRequest] = []
        self._waiting = asyncio.Event()
        self.reader = asyncio.ensure_future(self._read())
        self.writer = asyncio.ensure_future(self._write())

    async def _read(self) -> None:
        err: MqdsError | None = None
        try:
            while True:
                answer = await self.call.read()
                if answer is grpc.aio.EOF:
                    break
                self.mux.on_answer(answer)
        except grpc.RpcError as rpc_error:
            err = self.mux.router.settings.call_error(rpc_error)
        except asyncio.CancelledError:
            raise
        except Exception as unexpected:  # never leave the subscriptions waiting
            log.exception("follow call to %s failed", self.address)
            err = errors.error(Reason.INTERNAL, f"the follow call failed: {unexpected}")
        self.mux.on_end(self, err or errors.error(Reason.UNAVAILABLE, f"the node at {self.address} ended the call"))

    async def _write(self) -> None:
        with contextlib.suppress(Exception):  # a broken call is reported by the reader
            while True:
                await self._waiting.wait()
                waiting, self.outbox = self.outbox[: fc.MERGE_MAX], self.outbox[fc.MERGE_MAX :]
                if not self.outbox:
                    self._waiting.clear()
                for request in fc.merge_credits(waiting):
                    await self.call.write(request)

    def send(self, request: pb.FollowRequest) -> None:
        """Queue ``request``; the writer sends it after those queued before it."""
        self.outbox.append(request)
        self._waiting.set()

    def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()
        self.writer.cancel()


class AsyncFollowMux:
    """An asyncio client's Follow calls, one per node, shared by its subscriptions; belongs to its loop."""

    def __init__(self, router: AsyncRouter) -> None:
        self.router = router
        self._calls: dict[str, _Call] = {}
        self._routes: fc.FollowRoutes[AsyncSubscription, _Call] = fc.FollowRoutes()

    async def start(self, sub: AsyncSubscription, part: fc.ShardPart, address: str, request: pb.FollowStart) -> None:
        call = self._calls.get(address)
        if call is None or call.ended:
            call = self._calls[address] = _Call(self, address)
        self._routes.add(sub, part, call, request)
        call.send(pb.FollowRequest(start=request))

    async def credit(self, part: fc.ShardPart, messages: int) -> None:
        call = self._routes.call_of(part)
        if call is not None:
            call.send(pb.FollowRequest(credit=pb.FollowCredit(id=part.sub_id, messages=messages)))

    async def stop(self, part: fc.ShardPart) -> None:
        removed = self._routes.remove(part)
        if removed is None:
            return
        call, idle = removed
        if idle:
            self._calls.pop(call.address, None)
            call.close()
        else:
            call.send(pb.FollowRequest(cancel=part.sub_id))

    def on_answer(self, answer: pb.FollowResponse) -> None:
        for sid, sub, part in self._routes.answered(answer):
            sub.events.put_nowait((part, sid, answer, None))

    def on_end(self, call: _Call, err: MqdsError) -> None:
        call.ended = True
        call.writer.cancel()
        if self._calls.get(call.address) is call:
            del self._calls[call.address]
        for sid, sub, part in self._routes.ended(call):
            sub.events.put_nowait((part, sid, None, err))

    async def close(self) -> None:
        calls = list(self._calls.values())
        self._calls.clear()
        self._routes.clear()
        for call in calls:
            call.close()
        await asyncio.gather(*(c.reader for c in calls), *(c.writer for c in calls), return_exceptions=True)


class AsyncSubscription(fc.FollowState):
    """A push subscription of the asyncio client: ``async for batch in sub``; see ``mqds.client.Client.follow``."""

    def __init__(self, mux: AsyncFollowMux, core: FollowCore) -> None:
        self.mux = mux
        self.core = core
        self.events: asyncio.Queue[_Event] = asyncio.Queue()
        self._closed = False
        self._started = False

    async def _start_all(self) -> None:
        if not self._started:
            self._started = True
            for part in self.core.parts.values():
                await self._start(part)

    def __aiter__(self) -> AsyncIterator[FollowBatch]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[FollowBatch]:
        while True:
            batch = await self.poll(None)
            if batch is None:
                return
            yield batch

    async def poll(self, timeout_s: float | None = None) -> FollowBatch | None:
        """The next batch, waiting up to ``timeout_s`` (None: until one comes or it is closed); None then."""
        await self._start_all()
        freed = self.core.taken()
        if freed is not None:
            await self.mux.credit(*freed)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._closed:
            for part in self.core.due():
                await self._start(part)
            if deadline is not None and time.monotonic() >= deadline:
                return None
            try:
                part, sub_id, answer, err = await asyncio.wait_for(self.events.get(), self.core.wait_s(deadline))
            except TimeoutError:
                continue
            if self._closed:
                break
            if (got := await self._answer(part, sub_id, answer, err)) is not None:
                return got
        return None

    async def _answer(
        self, part: fc.ShardPart, sub_id: int, answer: pb.FollowResponse | None, err: MqdsError | None
    ) -> FollowBatch | None:
        """What the core makes of an event; a failure it raises (the subscription cannot go on) closes it first."""
        try:
            return self.core.answer(part, sub_id, answer, err)
        except MqdsError:
            await self.close()
            raise

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for part in self.core.parts.values():
            await self.mux.stop(part)
        self.events.put_nowait((fc.ShardPart(-1, 0), -1, None, None))

    async def __aenter__(self) -> AsyncSubscription:
        await self._start_all()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _start(self, part: fc.ShardPart) -> None:
        if self.core.wants_refresh(part):
            await self.mux.router.refresh_quietly(2.0)
        address, request = self.core.start(part)
        try:
            await self.mux.start(self, part, address, request)
        except Exception as err:  # a closed channel: try again later
            self.core.lost(part, errors.error(Reason.UNAVAILABLE, f"cannot follow on {address}: {err}"))
