"""The synchronous client's push subscriptions: one ``Storage.Follow`` call per node, run with threads.

:class:`FollowMux` keeps a client's Follow calls, one per node, each with a
thread reading its answers and handing them to the subscription they are
for. :class:`Subscription` is what ``Client.follow`` returns: an iterator of
:class:`~mqds.client.core.follow.FollowBatch`. Everything a subscription decides
(granting credit, moving a shard part to another node after a failure)
happens in the thread that iterates it; the readers only queue what came.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from mqds.client.core.follow import (
    FOLLOW_METHOD,
    MERGE_MAX,
    FollowBatch,
    FollowCore,
    FollowRoutes,
    FollowState,
    ShardPart,
    merge_credits,
)
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.v1 import storage_pb2 as pb

if TYPE_CHECKING:
    from mqds.client.sync.routing import Router

__all__ = ["FollowMux", "Subscription"]

log = logging.getLogger(__name__)


class _Call:
    """One Follow call to a node: a request queue feeding gRPC, a thread reading the answers."""

    def __init__(self, mux: FollowMux, address: str) -> None:
        self.mux = mux
        self.address = address
        self.requests: queue.SimpleQueue[pb.FollowRequest | None] = queue.SimpleQueue()
        router = mux.router
        method = router.channel(address).stream_stream(
            FOLLOW_METHOD,
            request_serializer=pb.FollowRequest.SerializeToString,
            response_deserializer=pb.FollowResponse.FromString,
            _registered_method=True,
        )
        self.call = method(self._requests(), metadata=router.metadata)
        self.ended = False
        threading.Thread(target=self._read, name="mqds-follow", daemon=True).start()

    def _requests(self) -> Iterator[pb.FollowRequest]:
        """The queued requests, the credits waiting together merged (many subscribers' in one request)."""
        while (request := self.requests.get()) is not None:
            waiting = [request]
            with contextlib.suppress(queue.Empty):
                while len(waiting) < MERGE_MAX and (request := self.requests.get_nowait()) is not None:
                    waiting.append(request)
            yield from merge_credits(waiting)
            if request is None:
                return

    def _read(self) -> None:
        err: MqdsError | None = None
        try:
            for answer in self.call:
                self.mux.on_answer(answer)
        except grpc.RpcError as rpc_error:
            err = self.mux.router.settings.call_error(rpc_error)
        except Exception as unexpected:  # never leave the subscriptions waiting
            log.exception("follow call to %s failed", self.address)
            err = errors.error(Reason.INTERNAL, f"the follow call failed: {unexpected}")
        self.mux.on_end(self, err or errors.error(Reason.UNAVAILABLE, f"the node at {self.address} ended the call"))

    def send(self, request: pb.FollowRequest) -> None:
        self.requests.put(request)

    def close(self) -> None:
        self.requests.put(None)
        self.call.cancel()


class FollowMux:
    """A client's Follow calls, one per node, shared by all its subscriptions; thread-safe."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._lock = threading.Lock()
        self._calls: dict[str, _Call] = {}
        self._routes: FollowRoutes[Subscription, _Call] = FollowRoutes()

    def start(self, sub: Subscription, part: ShardPart, address: str, request: pb.FollowStart) -> None:
        """Start ``part`` on the node at ``address`` under a new id (``request`` gets it)."""
        with self._lock:
            call = self._calls.get(address)
            if call is None or call.ended:
                call = self._calls[address] = _Call(self, address)
            self._routes.add(sub, part, call, request)
        call.send(pb.FollowRequest(start=request))

    def credit(self, part: ShardPart, messages: int) -> None:
        with self._lock:
            call = self._routes.call_of(part)
        if call is not None:
            call.send(pb.FollowRequest(credit=pb.FollowCredit(id=part.sub_id, messages=messages)))

    def stop(self, part: ShardPart) -> None:
        """End ``part``'s current subscription (its answers still on the way are dropped)."""
        with self._lock:
            removed = self._routes.remove(part)
            if removed is not None and removed[1]:
                self._calls.pop(removed[0].address, None)
        if removed is None:
            return
        call, idle = removed
        if idle:
            call.close()
        else:
            call.send(pb.FollowRequest(cancel=part.sub_id))

    # -- from the reader threads ----------------------------------------------------------

    def on_answer(self, answer: pb.FollowResponse) -> None:
        with self._lock:
            routes = self._routes.answered(answer)
        for sid, sub, part in routes:
            sub.events.put((part, sid, answer, None))

    def on_end(self, call: _Call, err: MqdsError) -> None:
        with self._lock:
            call.ended = True
            if self._calls.get(call.address) is call:
                del self._calls[call.address]
            lost = self._routes.ended(call)
        for sid, sub, part in lost:
            sub.events.put((part, sid, None, err))

    def close(self) -> None:
        with self._lock:
            calls = list(self._calls.values())
            self._calls.clear()
            self._routes.clear()
        for call in calls:
            call.close()


class Subscription(FollowState):
    """A push subscription to a topic filter on every shard: iterate it for :class:`FollowBatch` es.

    Made by ``Client.follow``; see its documentation. Iterate it from one
    thread (``poll`` and ``position`` from that thread too); ``close`` may
    come from any.
    """

    def __init__(self, mux: FollowMux, core: FollowCore) -> None:
        self.mux = mux
        self.core = core
        self.events: queue.SimpleQueue[tuple[ShardPart, int, pb.FollowResponse | None, MqdsError | None]] = (
            queue.SimpleQueue()
        )
        self._closed = False
        for part in core.parts.values():
            self._start(part)

    def __iter__(self) -> Iterator[FollowBatch]:
        while True:
            batch = self.poll(None)
            if batch is None:
                return
            yield batch

    def poll(self, timeout_s: float | None = None) -> FollowBatch | None:
        """The next batch, waiting up to ``timeout_s`` (None: until one comes or the subscription is closed).

        Returns None on timeout or once closed. Raises the error of a shard
        part that cannot go on (an invalid filter, GENERATION_DROPPED, ...).
        """
        freed = self.core.taken()
        if freed is not None:
            self.mux.credit(*freed)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._closed:
            for part in self.core.due():
                self._start(part)
            if deadline is not None and time.monotonic() >= deadline:
                return None
            try:
                part, sub_id, answer, err = self.events.get(timeout=self.core.wait_s(deadline))
            except queue.Empty:
                continue
            if self._closed:
                break
            try:
                got = self.core.answer(part, sub_id, answer, err)
            except MqdsError:
                self.close()
                raise
            if got is not None:
                return got
        return None

    def close(self) -> None:
        """End the subscription on every node."""
        if self._closed:
            return
        self._closed = True
        for part in self.core.parts.values():
            self.mux.stop(part)
        self.events.put((ShardPart(-1, 0), -1, None, None))  # wake a poll

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self, part: ShardPart) -> None:
        if self.core.wants_refresh(part):
            self.mux.router.refresh_quietly(2.0)
        address, request = self.core.start(part)
        try:
            self.mux.start(self, part, address, request)
        except Exception as err:  # a closed channel: try again later
            self.core.lost(part, errors.error(Reason.UNAVAILABLE, f"cannot follow on {address}: {err}"))
