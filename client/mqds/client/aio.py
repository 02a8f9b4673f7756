"""The asyncio mqds client: the same API as :class:`mqds.client.Client`, every call a coroutine.

>>> from mqds.client import Message
>>> from mqds.client.aio import Client
>>> async def main() -> None:
...     async with Client(["127.0.0.1:7101"]) as c:
...         await c.store_batch([Message(topic="t/1", payload=b"x", sender="pub-1", qos=1)])
...         async for m in c.replay("t/#"):
...             print(m.topic, m.payload)

Built on ``grpc.aio``; requests are built, answers read, and retries,
leader hints and map refreshes decided by the code the synchronous client
uses (:mod:`mqds.client.operations`, and the rules named in
:mod:`mqds.client.routing`), so both behave alike. This module holds the
public methods (the broker-state calls in :mod:`mqds.client.aio_broker_state`,
the generations, deletes, backup and restore in
:mod:`mqds.client.aio_storage_admin`); the routing loop they run on,
:class:`AsyncRouter`, is in :mod:`mqds.client.aio_routing`. It, the push
subscription ``follow`` returns (:class:`AsyncSubscription`) and a share
group's member (:class:`AsyncSharedSubscription`) are importable from here:
the twins of :class:`mqds.client.routing.Router`,
:class:`mqds.client.Subscription` and :class:`mqds.client.SharedSubscription`.
A client belongs to the event loop it is first used in: its channels are
opened there.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, TypeVar

import grpc

from mqds.client import operations as ops
from mqds.client import retention as retention_calls
from mqds.client.aio_broker_state import AsyncBrokerStateCalls
from mqds.client.aio_routing import AsyncRouter
from mqds.client.aio_storage_admin import AsyncStorageAdminCalls
from mqds.client.batch import MessageBatch, NextResult
from mqds.client.connection import ConnectionSettings, parse_endpoints, resolve_settings
from mqds.client.follow import FollowCore, FollowPosition
from mqds.client.follow_aio import AsyncFollowMux, AsyncSubscription
from mqds.client.model import Fence, Iterator, Message, Rank, Stream
from mqds.client.operations import FanoutCall, ShardCall
from mqds.client.pipeline import PipelineLimits, resolve_limits
from mqds.client.pipeline_aio import AsyncPipeline
from mqds.client.pipeline_handles import AsyncStoreFuture
from mqds.client.replay import GROUP_BYTES, GROUP_DEPTH, WEIGH_BATCH
from mqds.client.replay_aio import read_ahead as read_ahead_batches
from mqds.client.retry import Backoff, time_left
from mqds.client.share_members import AsyncSharedSubscription
from mqds.client.stream_reads import RankRead, read_rank_aio
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.v1 import cluster_pb2 as clpb

__all__ = ["AsyncRouter", "AsyncSharedSubscription", "AsyncSubscription", "Client"]

T = TypeVar("T")


class Client(AsyncBrokerStateCalls, AsyncStorageAdminCalls):
    """Stores and replays MQTT messages on an mqds cluster, from asyncio code.

    The same methods, arguments, results and errors as
    :class:`mqds.client.Client`, as coroutines; ``replay`` and
    ``replay_batches`` are async iterators (``tests/client/test_client_parity.py``
    keeps the two the same). Writes go to their shards' leaders concurrently,
    leader hints are followed, and retriable failures retried with the same
    backoff until the call's deadline; concurrent calls that need a fresh cluster map share
    one refresh. A client may start before its cluster: while no node answers
    yet, a call keeps asking for the map until its deadline. Close it (``await client.close()``) or use ``async with``.
    ``max_in_flight_messages`` and ``pipeline`` bound ``store_async`` /
    ``publish`` as in the synchronous client.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        settings: ConnectionSettings | None = None,
        timeout_s: float | None = None,
        max_message_bytes: int | None = None,
        backoff: Backoff | None = None,
        max_in_flight_messages: int | None = None,
        pipeline: PipelineLimits | None = None,
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.settings = resolve_settings(settings, timeout_s, max_message_bytes)
        self.timeout_s = self.settings.timeout_s
        self._router = AsyncRouter(self.endpoints, settings=self.settings, backoff=backoff)
        self.producer_id = uuid.uuid4().hex
        """Names this client's writes for exactly-once storage (see ``store_batch``)."""
        self._sequences = itertools.count(1)
        self.pipeline_limits = resolve_limits(pipeline, max_in_flight_messages, self.settings.max_send_message_bytes)
        """The window and batch limits of ``store_async`` / ``publish``."""
        self._pipeline: AsyncPipeline | None = None
        self._follows: AsyncFollowMux | None = None

    # -- plumbing ------------------------------------------------------------

    def _deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    async def _rpc(self, address: str, method: str, request: Any, timeout_s: float, service: str = "Storage") -> Any:
        stub = self._router.sessions(address) if service == "Sessions" else self._router.storage(address)
        try:
            return await getattr(stub, method)(request, timeout=timeout_s, metadata=self._router.metadata)
        except grpc.RpcError as err:
            raise self.settings.call_error(err) from None

    async def _n_shards(self, deadline: float) -> int:
        return (await self._router.ensure_map(time_left(deadline))).n_shards

    def _routing(self) -> tuple[AsyncRouter, Callable[[grpc.RpcError], MqdsError]]:
        return self._router, self.settings.call_error

    async def _shard_call(self, call: ShardCall[T], timeout_s: float | None, deadline: float | None = None) -> T:
        deadline = self._deadline(timeout_s) if deadline is None else deadline
        await self._router.ensure_map(time_left(deadline))

        async def attempt(address: str, remaining: float) -> Any:
            return await self._rpc(address, call.method, call.request, remaining, call.service)

        return call.parse(await self._router.call(call.shard, attempt, deadline, any_replica=call.stale_ok))

    async def _keyed_call(self, build: Callable[[int], ShardCall[T]], timeout_s: float | None) -> T:
        """A call to the shard of a key (a clientid, a topic): ``build`` gets the cluster's shard count."""
        deadline = self._deadline(timeout_s)
        return await self._shard_call(build(await self._n_shards(deadline)), timeout_s, deadline)

    async def _fanout_call(self, call: FanoutCall[T], timeout_s: float | None) -> list[T]:
        deadline = self._deadline(timeout_s)
        shards = call.shards_of(await self._n_shards(deadline))

        async def send(group: list[int], address: str, remaining: float) -> list[T]:
            return call.parse(await self._rpc(address, call.method, call.request(group), remaining, call.service))

        parts, failures = await self._router.fanout(shards, send, deadline, call.stale_ok)
        if failures:
            raise next(iter(failures.values()))
        return call.merge(parts)

    async def close(self) -> None:
        """Release the connections; ``store_async`` calls not acknowledged yet fail with UNAVAILABLE."""
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            await pipeline.close()
        follows, self._follows = self._follows, None
        if follows is not None:
            await follows.close()
        await self._router.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the cluster ------------------------------------------------------------

    async def cluster_map(self, timeout_s: float | None = None) -> clpb.ClusterMap:
        """The cluster map as the nodes see it now (nodes, placement, leaders).

        While no node answers (the cluster is still starting), asks again
        with backoff until ``timeout_s`` (else the settings') runs out.
        """
        await self._router.wait_for_map(time.monotonic() + (timeout_s or self.timeout_s), force=True)
        return self._router.table.cluster_map()

    async def set_retention(
        self, rules: Sequence[tuple[str, int]], default_s: int = 0, timeout_s: float | None = None
    ) -> clpb.RetentionPolicy:
        """As :meth:`mqds.client.Client.set_retention`: the cluster's retention policy, ``(topic filter,
        seconds)`` rules (the first matching one decides) and ``default_s`` for the rest (0: kept until
        deleted), replacing the previous one. Needs the admin role."""
        policy = retention_calls.policy_message(rules, default_s)
        await self._router.ensure_map(self.timeout_s if timeout_s is None else timeout_s)
        return await retention_calls.set_policy_aio(
            self._router, self.settings.call_error, policy, self._deadline(timeout_s)
        )

    async def retention(self, timeout_s: float | None = None) -> clpb.RetentionPolicy | None:
        """The cluster's retention policy, or None when none was set (each node's retention_period_s applies)."""
        return retention_calls.policy_of(await self.cluster_map(timeout_s))

    # -- writes --------------------------------------------------------------

    async def store_batch(
        self,
        messages: Iterable[Message],
        sync: bool = True,
        timeout_s: float | None = None,
        *,
        sequence: int | None = None,
    ) -> list[Message]:
        """Store messages; return them with ``timestamp_us`` and ``shard`` set.

        As :meth:`mqds.client.Client.store_batch`: parts go to their shards'
        leaders concurrently; each call carries this client's ``producer_id``
        and a new ``sequence`` (or the one given), reused by every retry, so a
        part is stored once; a partial failure raises
        :class:`~mqds.client.errors.PartialBatchError`, any other failure
        carries the sequence in ``err.metadata["sequence"]``.
        """
        seq = next(self._sequences) if sequence is None else ops.check_sequence(sequence)
        batch = list(messages)
        deadline = self._deadline(timeout_s)
        plan = ops.StoreBatch(batch, await self._n_shards(deadline), self.producer_id, seq, sync)

        async def send(shards: list[int], address: str, remaining: float) -> None:
            indexes, request = plan.request(shards)
            plan.record(indexes, await self._rpc(address, "StoreBatch", request, remaining))

        _, failures = await self._router.fanout(plan.shards, send, deadline)
        return plan.outcome(failures)

    async def store_async(
        self, messages: Message | Iterable[Message], *, timeout_s: float | None = None
    ) -> AsyncStoreFuture:
        """Queue messages for pipelined storing (awaiting room in the window); a future of the stored messages.

        As :meth:`mqds.client.Client.store_async`: ``await`` this to queue
        the messages, then the future it returns for their acknowledgement
        (an ``asyncio.Future`` that is the call itself, one object:
        :class:`~mqds.client.pipeline_handles.AsyncStoreFuture`).
        """
        batch = messages if isinstance(messages, Message) else list(messages)
        deadline = self._deadline(timeout_s)
        try:
            n_shards = await self._n_shards(deadline)
        except MqdsError as err:
            return AsyncStoreFuture.failed_with(err)
        if self._pipeline is None:
            self._pipeline = AsyncPipeline(self._router, self.producer_id, self._sequences, self.pipeline_limits)
        return await self._pipeline.submit(batch, n_shards, deadline)

    def pipeline_stats(self) -> dict[str, int]:
        """What the pipelined writes did: ``calls`` taken, ``batches`` sent for them and their ``messages``.

        ``messages / batches`` is how many messages a batch carried: how well
        concurrent calls were coalesced (resends are not counted).
        """
        pipeline = self._pipeline
        return dict(pipeline.core.stats) if pipeline is not None else {"calls": 0, "batches": 0, "messages": 0}

    async def publish(self, messages: Message | Iterable[Message], timeout_s: float | None = None) -> list[Message]:
        """Store messages through the pipeline (``store_async``) and await them; the stored messages."""
        return await (await self.store_async(messages, timeout_s=timeout_s))

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every ``store_async`` / ``publish`` call made before this one is acknowledged or failed.

        As :meth:`mqds.client.Client.flush`: raises DEADLINE_EXCEEDED if
        some are still in flight after ``timeout_s`` (default: the client's
        timeout), and none of the calls' own errors.
        """
        pipeline = self._pipeline
        if pipeline is None:
            return
        waiting = pipeline.pending()
        if not waiting:
            return
        budget = self.settings.timeout_s if timeout_s is None else timeout_s
        _, left = await asyncio.wait(waiting, timeout=budget)
        if left:
            raise errors.error(
                Reason.DEADLINE_EXCEEDED,
                f"{len(left)} of {len(waiting)} pipelined calls still in flight after {budget:g} s",
            )

    # -- reads ---------------------------------------------------------------

    async def get_streams(
        self,
        topic_filter: str,
        start_time_us: int = 0,
        *,
        stale_ok: bool = False,
        timeout_s: float | None = None,
        shards: Iterable[int] | None = None,
    ) -> list[tuple[Rank, Stream]]:
        """The streams that may hold messages matching ``topic_filter`` at or after ``start_time_us``, by rank.

        ``shards`` limits the question to those shards (default: every shard).
        """
        chosen = None if shards is None else list(shards)
        return await self._fanout_call(ops.get_streams(topic_filter, start_time_us, stale_ok, chosen), timeout_s)

    async def make_iterator(
        self,
        stream: Stream,
        topic_filter: str,
        start_time_us: int = 0,
        *,
        stale_ok: bool = False,
        timeout_s: float | None = None,
    ) -> Iterator:
        """An iterator over ``stream``'s messages matching ``topic_filter`` from ``start_time_us``."""
        return await self._shard_call(ops.make_iterator(stream, topic_filter, start_time_us, stale_ok), timeout_s)

    async def next(
        self,
        iterator: Iterator,
        batch_size: int = 100,
        *,
        stale_ok: bool = False,
        timeout_s: float | None = None,
        fence_us: int | None = None,
    ) -> NextResult:
        """Up to ``batch_size`` messages after ``iterator``, and the advanced iterator.

        Iterators are positions, not sessions: after a leader change the call
        continues on the new leader, with no message skipped or repeated.
        With ``fence_us`` (a :class:`Fence`'s ``timestamp_us``), only messages
        stored at or before it, and ``end_of_stream`` once they are all read;
        with ``stale_ok`` too, any replica that applied that far answers (one
        that has not is skipped), and every answer is the same.
        """
        return await self._shard_call(ops.next_batch(iterator, batch_size, stale_ok, fence_us), timeout_s)

    async def first_batch(
        self,
        stream: Stream,
        topic_filter: str,
        start_time_us: int = 0,
        batch_size: int = 100,
        *,
        stale_ok: bool = False,
        timeout_s: float | None = None,
        fence_us: int | None = None,
        then: Sequence[Stream] = (),
    ) -> NextResult:
        """:meth:`make_iterator` and :meth:`next` in one call (see the sync ``Client.first_batch``)."""
        call = ops.first_batch(stream, topic_filter, start_time_us, batch_size, stale_ok, fence_us, then)
        return await self._shard_call(call, timeout_s)

    async def get_fences(
        self, shards: Iterable[int] | None = None, *, stale_ok: bool = False, timeout_s: float | None = None
    ) -> list[Fence]:
        """The read fence of each shard (or of ``shards``), in shard order: see :class:`Fence`."""
        return await self._fanout_call(ops.get_fences(None if shards is None else list(shards), stale_ok), timeout_s)

    async def follow(
        self,
        topic_filter: str,
        *,
        start_time_us: int = 0,
        position: FollowPosition | bytes | None = None,
        window: int = 1000,
        any_replica: bool = False,
        shards: Iterable[int] | None = None,
        timeout_s: float | None = None,
    ) -> AsyncSubscription:
        """A push subscription (``async for batch in await client.follow(...)``); see the sync ``Client.follow``."""
        deadline = self._deadline(timeout_s)
        view = await self._router.ensure_map(time_left(deadline))
        options = {"start_time_us": start_time_us, "window": window, "any_replica": any_replica}
        core = FollowCore.of(self._router.table, view, topic_filter, position, shards, **options)
        if self._follows is None:
            self._follows = AsyncFollowMux(self._router)
        return AsyncSubscription(self._follows, core)

    async def replay(
        self, topic_filter: str, start_time_us: int = 0, batch_size: int = 10_000, *, stale_ok: bool = False
    ) -> AsyncIterator[Message]:
        """Every stored message matching ``topic_filter``, in rank order (``async for m in client.replay(...)``).

        Shards come one after the other; within a shard, generations in order,
        and the streams of a generation merged by timestamp, so each sender's
        messages come back in the order they were stored. Every message
        acknowledged before the call is included; each shard is read up to
        its fence, taken when the call starts, so the replay ends.
        """
        async for batch in self.replay_batches(topic_filter, start_time_us, batch_size, stale_ok=stale_ok):
            for message in batch:
                yield message

    async def replay_batches(
        self,
        topic_filter: str,
        start_time_us: int = 0,
        batch_size: int = 10_000,
        *,
        stale_ok: bool = False,
        read_ahead: int = 4,
        on_dropped: Callable[[Stream], None] | None = None,
    ) -> AsyncIterator[MessageBatch]:
        """What :meth:`replay` returns, in :class:`MessageBatch` es (see the sync ``Client.replay_batches``).

        Up to ``read_ahead`` shards (or generations) are read at once, in
        tasks, each at most 16 MiB of answers ahead of the caller; ``on_dropped`` as
        in the sync client.
        """
        order = ops.replay_order(await self.get_streams(topic_filter, start_time_us, stale_ok=stale_ok))
        shards = sorted({streams[0].shard for streams in order})
        # Each shard is read up to its fence, taken now: what was acknowledged before the call is in it.
        fences = {f.shard: f.timestamp_us for f in await self.get_fences(shards, stale_ok=stale_ok)} if shards else {}

        def group(streams: list[Stream]) -> Callable[[], AsyncIterator[MessageBatch]]:
            read = RankRead(topic_filter, start_time_us, batch_size, fences[streams[0].shard], on_dropped)
            return lambda: read_rank_aio(self, read, streams)

        groups = [group(streams) for streams in order]
        async for batch in read_ahead_batches(groups, read_ahead, GROUP_DEPTH, GROUP_BYTES, WEIGH_BATCH):
            yield batch
