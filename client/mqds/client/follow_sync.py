"""The synchronous client's push subscriptions: one ``Storage.Follow`` call per node, run with threads.

:class:`FollowMux` keeps a client's Follow calls, one per node, each with a
thread reading its answers and handing them to the subscription they are
for. :class:`Subscription` is what ``Client.follow`` returns: an iterator of
:class:`~mqds.client.follow.FollowBatch`. Everything a subscription decides
(granting credit, moving a shard part to another node after a failure)
happens in the thread that iterates it; the readers only queue what came.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from mqds.client.follow import FollowBatch, FollowPosition, ShardPart
from mqds.client.model import Message
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.protocol.topics import TopicError, validate_filter
from mqds.v1 import storage_pb2 as pb

if TYPE_CHECKING:
    from mqds.client.routing import Router

__all__ = ["FollowMux", "Subscription"]

log = logging.getLogger(__name__)

FOLLOW_METHOD = "/mqds.v1.Storage/Follow"
_RETRY_MAX_S = 2.0


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
        while (request := self.requests.get()) is not None:
            yield request

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
        self._routes: dict[int, tuple[Subscription, ShardPart, _Call]] = {}
        self._ids = itertools.count(1)

    def start(self, sub: Subscription, part: ShardPart, address: str, request: pb.FollowStart) -> None:
        """Start ``part`` on the node at ``address`` under a new id (``request`` gets it)."""
        with self._lock:
            call = self._calls.get(address)
            if call is None or call.ended:
                call = self._calls[address] = _Call(self, address)
            part.sub_id = request.id = next(self._ids)
            part.address = address
            self._routes[part.sub_id] = (sub, part, call)
        call.send(pb.FollowRequest(start=request))

    def credit(self, part: ShardPart, messages: int) -> None:
        with self._lock:
            route = self._routes.get(part.sub_id)
        if route is not None:
            route[2].send(pb.FollowRequest(credit=pb.FollowCredit(id=part.sub_id, messages=messages)))

    def stop(self, part: ShardPart) -> None:
        """End ``part``'s current subscription (its answers still on the way are dropped)."""
        with self._lock:
            route = self._routes.pop(part.sub_id, None)
            idle = route is not None and not any(r[2] is route[2] for r in self._routes.values())
            if idle and route is not None:
                self._calls.pop(route[2].address, None)
        if route is not None:
            if idle:
                route[2].close()
            else:
                route[2].send(pb.FollowRequest(cancel=part.sub_id))

    # -- from the reader threads ----------------------------------------------------------

    def on_answer(self, answer: pb.FollowResponse) -> None:
        with self._lock:
            route = self._routes.get(answer.id)
            if route is not None and answer.HasField("failure"):
                del self._routes[answer.id]
        if route is not None:
            route[0].events.put((route[1], answer.id, answer, None))

    def on_end(self, call: _Call, err: MqdsError) -> None:
        with self._lock:
            call.ended = True
            if self._calls.get(call.address) is call:
                del self._calls[call.address]
            lost = [(sid, r) for sid, r in self._routes.items() if r[2] is call]
            for sid, _ in lost:
                del self._routes[sid]
        for sid, (sub, part, _) in lost:
            sub.events.put((part, sid, None, err))

    def close(self) -> None:
        with self._lock:
            calls = list(self._calls.values())
            self._calls.clear()
            self._routes.clear()
        for call in calls:
            call.close()


class Subscription:
    """A push subscription to a topic filter on every shard: iterate it for :class:`FollowBatch` es.

    Made by ``Client.follow``; see its documentation. Not thread-safe: iterate
    it from one thread (``poll`` and ``position`` from that thread too);
    ``close`` may come from any.
    """

    def __init__(
        self,
        mux: FollowMux,
        cluster_id: str,
        n_shards: int,
        topic_filter: str,
        *,
        start_time_us: int = 0,
        position: FollowPosition | None = None,
        window: int = 1000,
        any_replica: bool = False,
        shards: list[int] | None = None,
    ) -> None:
        try:
            validate_filter(topic_filter)
        except TopicError as err:
            raise errors.error(Reason.INVALID_TOPIC_FILTER, str(err)) from None
        if window < 1:
            raise errors.error(Reason.INVALID_REQUEST, f"window must be at least 1 message, got {window}")
        if position is not None:
            position.check(cluster_id, topic_filter, n_shards)
        self.mux = mux
        self.cluster_id = cluster_id
        self.topic_filter = topic_filter
        self.start_time_us = start_time_us
        self.window = window
        self.any_replica = any_replica
        self.events: queue.SimpleQueue[tuple[ShardPart, int, pb.FollowResponse | None, MqdsError | None]] = (
            queue.SimpleQueue()
        )
        chosen = list(range(n_shards)) if shards is None else sorted(set(shards))
        self.parts = {s: ShardPart(s, position.shard_after(s) if position else 0) for s in chosen}
        self._last: ShardPart | None = None
        self._taken = 0
        self._closed = False
        self.restarts = 0
        """Shard parts started again elsewhere after a failure (a node lost, a leader moved)."""
        for part in self.parts.values():
            self._start(part)

    # -- iterating ------------------------------------------------------------------------

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
        self._grant_taken()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._closed:
            self._retry_due()
            if deadline is not None and time.monotonic() >= deadline:
                return None
            wait = self._wait_s(deadline)
            try:
                part, sub_id, answer, err = self.events.get(timeout=wait)
            except queue.Empty:
                continue
            if part.sub_id != sub_id or self._closed:
                continue  # from a subscription the part left
            if err is not None:
                self._lost(part, err)
                continue
            assert answer is not None
            if answer.HasField("failure"):
                self._lost(part, errors.from_failure(answer.failure))
                continue
            part.after_us = max(part.after_us, answer.position_us)
            part.attempt, part.last_error = 0, None
            if not answer.messages:
                continue
            part.granted -= len(answer.messages)
            self._last, self._taken = part, len(answer.messages)
            return FollowBatch(part.shard, [Message.from_pb(m) for m in answer.messages], self.position)
        return None

    @property
    def position(self) -> FollowPosition:
        """Where the subscription is: what to save, to follow on later from here."""
        return FollowPosition.of(self.cluster_id, self.topic_filter, {s: p.after_us for s, p in self.parts.items()})

    def close(self) -> None:
        """End the subscription on every node."""
        if self._closed:
            return
        self._closed = True
        for part in self.parts.values():
            self.mux.stop(part)
        self.events.put((ShardPart(-1, 0), -1, None, None))  # wake a poll

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside ---------------------------------------------------------------------------

    def _grant_taken(self) -> None:
        """The application took the last batch: the node may send that many more."""
        part, taken = self._last, self._taken
        self._last, self._taken = None, 0
        if part is None or not taken or part.retry_at:
            return
        part.granted += taken
        self.mux.credit(part, taken)

    def _start(self, part: ShardPart) -> None:
        address = part.hint or self._address(part)
        part.hint = None
        part.retry_at = 0.0
        part.granted = self.window
        request = pb.FollowStart(
            topic_filter=self.topic_filter,
            shard=part.shard,
            after_us=part.after_us,
            start_time_us=self.start_time_us,
            credit=self.window,
            stale_ok=self.any_replica,
        )
        part.history.append(address)
        del part.history[:-8]
        try:
            self.mux.start(self, part, address, request)
        except Exception as err:  # a closed channel: try again later
            self._lost(part, errors.error(Reason.UNAVAILABLE, f"cannot follow on {address}: {err}"))

    def _address(self, part: ShardPart) -> str:
        table = self.mux.router.table
        if not self.any_replica:
            leader = table.leader_of(part.shard)
            if leader is not None and (part.attempt == 0 or leader not in part.history[-1:]):
                return leader
        return table.address_for(part.shard, any_replica=True, attempt=part.attempt)

    def _lost(self, part: ShardPart, err: MqdsError) -> None:
        """``part``'s subscription ended with ``err``: start it again elsewhere, or fail the iteration."""
        self.mux.stop(part)
        if not err.retriable:
            self.close()
            raise err
        table = self.mux.router.table
        if err.reason in (Reason.NOT_LEADER, Reason.NOT_HOSTED) and table.learn(err, part.shard):
            part.hint = err.metadata.get("leader_address") or None
        elif err.reason is not Reason.REPLICA_BEHIND:
            table.forget_leader(part.shard)
        part.attempt += 1
        part.last_error = err
        self.restarts += 1
        part.sub_id = 0
        delay = 0.0 if part.hint else min(_RETRY_MAX_S, 0.05 * 2 ** min(part.attempt, 6))
        part.retry_at = time.monotonic() + delay
        if part.attempt % 4 == 0:
            self.mux.router.refresh_quietly(2.0)

    def _retry_due(self) -> None:
        now = time.monotonic()
        for part in self.parts.values():
            if part.retry_at and part.retry_at <= now:
                self._start(part)

    def _wait_s(self, deadline: float | None) -> float | None:
        waits = [p.retry_at - time.monotonic() for p in self.parts.values() if p.retry_at]
        if deadline is not None:
            waits.append(deadline - time.monotonic())
        return max(0.0, min(waits)) if waits else None
