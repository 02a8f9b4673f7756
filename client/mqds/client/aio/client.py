"""The mqds client's methods, written once: :class:`Client` (here with every call a coroutine).

This file is also the source of the synchronous client: ``client/generate_sync.py``
writes ``mqds/client/sync/client.py`` from it (``async def`` becomes ``def``,
``await`` goes, ``Async`` names lose the prefix, ``mqds.client.aio`` becomes
``mqds.client.sync``), so the two clients have the same methods, arguments,
documentation and decisions by construction. What differs between them is
only where they wait: each driver's ``routing`` (the retry and fan-out
loops), ``pipeline``, ``handles``, ``follow``, ``replay`` (read-ahead) and
``concurrency`` modules, threads in ``sync/``, tasks in ``aio/``. Requests are built, answers
read and retries decided by the I/O-free core (:mod:`mqds.client.core`).

The asyncio client belongs to the event loop it is first used in (its
channels are opened there); the synchronous one is thread-safe.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, TypeVar

import grpc

from mqds.client.aio import backup as backups
from mqds.client.aio.follow import AsyncFollowMux, AsyncSubscription
from mqds.client.aio.handles import AsyncStoreFuture, stored
from mqds.client.aio.pipeline import AsyncPipeline
from mqds.client.aio.reads import read_rank
from mqds.client.aio.replay import read_ahead as read_ahead_batches
from mqds.client.aio.retention import set_policy
from mqds.client.aio.routing import AsyncRouter
from mqds.client.batch import MessageBatch, NextResult
from mqds.client.connection import ConnectionSettings, parse_endpoints, resolve_settings
from mqds.client.core import operations as ops
from mqds.client.core import retention as retention_calls
from mqds.client.core.backup_runs import START_S, BackupReport, CallError, RestoreReport
from mqds.client.core.backup_runs import Progress as BackupProgress
from mqds.client.core.consumers import ConsumerPages, Consumers, LagPlan, check_kinds, push_page, push_request
from mqds.client.core.deletes import DeleteReport, DeleteRun, Progress
from mqds.client.core.follow import FollowCore, FollowPosition
from mqds.client.core.offline import OfflineFetch, SharedFetch
from mqds.client.core.operations import Delivered, FanoutCall, ShardCall
from mqds.client.core.pipeline import PipelineLimits, resolve_limits
from mqds.client.core.retry import Backoff, time_left
from mqds.client.core.share_group import ShareAssignment, share_group_call
from mqds.client.core.stream_reads import GROUP_BYTES, GROUP_DEPTH, WEIGH_BATCH, RankRead, ReadAhead
from mqds.client.model import ClientState, Fence, Generation, Iterator, Message, Rank, ReadPosition, Stream
from mqds.protocol import errors
from mqds.protocol.delivery import Policy
from mqds.protocol.errors import MqdsError, Reason
from mqds.v1 import cluster_pb2 as clpb

__all__ = ["Client"]

T = TypeVar("T")


class Client:
    """Stores and replays MQTT messages on an mqds cluster.

    ``endpoints`` is a list of ``"host:port"`` strings (any subset of the
    cluster's nodes) or one comma-separated string. The client learns the
    cluster map from them, sends each write to its shard's leader, follows
    leader changes and retries what is safe to retry within the call's
    deadline (``timeout_s`` of the call, else of the settings). The client
    may be created before its cluster is up: until some endpoint answers
    with the cluster map, a call keeps asking with backoff until its
    deadline, then raises :class:`~mqds.client.errors.UnavailableError`
    naming the endpoints and the last cause. Reads go to
    the shard's leader (linearizable); pass ``stale_ok=True`` to let any
    replica answer. Failures raise :class:`mqds.client.errors.MqdsError`
    subclasses. Close the client, or use it as a context manager, to release
    its connections.

    ``settings`` (:class:`mqds.client.ConnectionSettings`) say how to connect:
    TLS, auth token, keepalive, message size limits and the default deadline.
    ``timeout_s`` and ``max_message_bytes`` (both send and receive limits),
    when given, override the settings' values. A missing or bad TLS file is
    a ``ValueError`` here. :class:`mqds.client.Client` (synchronous, thread-safe)
    and :class:`mqds.client.aio.Client` (asyncio) are both made from this class.

    ``max_in_flight_messages`` (default 10,000) bounds the messages
    ``store_async`` keeps unacknowledged; ``pipeline``
    (:class:`mqds.client.core.pipeline.PipelineLimits`) sets the batch limits too.
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
        # Guards the lazy start of the pipeline and the push-subscription mux (threads share a
        # synchronous client; on one event loop it is never contended, nothing awaits under it).
        self._lazy_lock = threading.Lock()

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

    def _routing(self) -> tuple[AsyncRouter, CallError]:
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
        """Send ``call`` once per node leading some of its shards, concurrently; the merged answers.

        Shards whose call failed with a retriable error are regrouped by their
        (new) leaders and tried again until the deadline; then the first
        failure is raised.
        """
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
        with self._lazy_lock:
            pipeline, self._pipeline = self._pipeline, None
            follows, self._follows = self._follows, None
        if pipeline is not None:
            await pipeline.close()
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
        self,
        rules: Sequence[tuple[str, int] | clpb.RetentionRule],
        default_s: int = 0,
        timeout_s: float | None = None,
    ) -> clpb.RetentionPolicy:
        """Set the cluster's retention policy: ``(topic filter, seconds)`` rules, the first matching one
        deciding a message's period, and ``default_s`` for the rest (0: kept until deleted). A rule may be a
        ``RetentionRule`` instead, with limits beside its period (``max_messages``, ``max_bytes``,
        ``max_messages_per_topic``, ``discard``; ``mqds.protocol.retention.parse_rule_limits`` reads
        ``'a/#=7d,max_msgs=1000,discard=old'``). Replaces the previous policy; each vnode's leader then
        removes what it ended. Needs the admin role."""
        policy = retention_calls.policy_message(rules, default_s)
        await self._router.ensure_map(self.timeout_s if timeout_s is None else timeout_s)
        return await set_policy(self._router, self.settings.call_error, policy, self._deadline(timeout_s))

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

        The call returns once every message is committed (fsynced on a
        majority of its shard's replicas) and applied on the leader. Messages
        are sent to their shards' leaders in parallel. ``sync`` is accepted
        for compatibility; every acknowledged write is durable.

        Exactly once: each call carries this client's ``producer_id`` and a
        new ``sequence`` number (or the one given), and every retry of the
        call reuses them, so a part whose first attempt committed before its
        answer was lost is not stored again. When some shards' parts were
        stored and others failed, :class:`~mqds.client.errors.PartialBatchError`
        says which; any other failure raised here carries the call's sequence
        in ``err.metadata["sequence"]``. Calling again with that ``sequence``
        and the same (or the failed) messages is a safe retry.
        """
        batch = list(messages)
        seq = next(self._sequences) if sequence is None else ops.check_sequence(sequence)
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
        """Queue messages for pipelined storing; a future of them with ``timestamp_us`` and ``shard`` set.

        The synchronous client returns a :class:`~mqds.client.sync.handles.StoreFuture`:
        a ``concurrent.futures.Future`` that is the call itself (one object;
        it makes a lock only for a caller that waits before it is done). The
        asyncio client's call is awaited to queue the messages (waiting for
        room in the window) and gives an :class:`~mqds.client.aio.handles.AsyncStoreFuture`
        (an ``asyncio.Future``, the call itself) to await for them. Messages
        go to their shards' leaders on one ``StoreStream`` per node, coalesced
        with other calls' into batches. Waits while the window
        (``max_in_flight_messages``) is full. The future fails with the
        call's error; a call whose messages a node can never store (a bad
        topic) fails alone. Futures of one shard complete in call order.
        Failover (a leader change, a lost node) resends the unacknowledged
        batches, each stored once, until the call's deadline; the future
        completes by then (DEADLINE_EXCEEDED, or the last error). See
        ``docs/client.md``, "Pipelined writes".
        """
        batch = messages if isinstance(messages, Message) else list(messages)
        deadline = self._deadline(timeout_s)
        try:
            n_shards = await self._n_shards(deadline)
        except MqdsError as err:
            return AsyncStoreFuture.failed_with(err)
        pipeline = self._pipeline
        if pipeline is None:
            with self._lazy_lock:
                if self._pipeline is None:
                    self._pipeline = AsyncPipeline(
                        self._router, self.producer_id, self._sequences, self.pipeline_limits
                    )
                pipeline = self._pipeline
        return await pipeline.submit(batch, n_shards, deadline)

    def pipeline_stats(self) -> dict[str, int]:
        """What the pipelined writes did: ``calls`` taken, ``batches`` sent for them and their ``messages``.

        ``messages / batches`` is how many messages a batch carried: how well
        concurrent calls were coalesced (resends are not counted).
        """
        pipeline = self._pipeline
        return dict(pipeline.core.stats) if pipeline is not None else {"calls": 0, "batches": 0, "messages": 0}

    async def publish(self, messages: Message | Iterable[Message], timeout_s: float | None = None) -> list[Message]:
        """Store messages through the pipeline (``store_async``) and wait for them; the stored messages."""
        return await stored(await self.store_async(messages, timeout_s=timeout_s))

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every ``store_async`` / ``publish`` call made before this one is acknowledged or failed.

        Each call's outcome stays in its own future (``flush`` raises none of
        them). Raises DEADLINE_EXCEEDED if some are still in flight after
        ``timeout_s`` (default: the client's timeout); they go on.
        """
        pipeline = self._pipeline
        if pipeline is None:
            return
        budget = self.settings.timeout_s if timeout_s is None else timeout_s
        left, waited = await pipeline.wait_pending(budget)
        if left:
            raise errors.error(
                Reason.DEADLINE_EXCEEDED,
                f"{left} of {waited} pipelined calls still in flight after {budget:g} s",
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
        """:meth:`make_iterator` and :meth:`next` in one call: the stream's first batch and the iterator after it.

        Half the calls for a reader of many short streams (a replay, a Spark
        slice); ``stale_ok`` and ``fence_us`` as in :meth:`next`. With ``then``
        (streams of the same shard and generation; needs ``fence_us``), the
        answer goes on into them once a stream is read to the fence:
        ``streams_done`` says how many it finished, and ``iterator`` continues
        the next one when ``end_of_stream`` is False. The streams come one after
        the other, not in time order across them: the Spark source takes them so,
        a replay cuts them into runs and merges those (``merge.runs``).
        """
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
        """A push subscription: iterate it for batches of the messages matching ``topic_filter`` as they are stored.

        From ``position`` (a :class:`FollowPosition`, or its bytes) if given,
        else from ``start_time_us`` (0: everything stored). Each batch holds
        one shard's next messages in the order they were stored, and the
        position to save. Nodes push what they commit (no polling); a
        shard's part moves to another replica or the new leader when its node
        fails, continuing from its position (nothing lost or repeated). At
        most ``window`` messages per shard wait in the client; ``any_replica``
        lets followers serve (committed messages only). See
        ``docs/client.md``, "Push subscriptions".
        """
        deadline = self._deadline(timeout_s)
        view = await self._router.ensure_map(time_left(deadline))
        options = {"start_time_us": start_time_us, "window": window, "any_replica": any_replica}
        core = FollowCore.of(self._router.table, view, topic_filter, position, shards, **options)
        with self._lazy_lock:
            if self._follows is None:
                self._follows = AsyncFollowMux(self._router)
            mux = self._follows
        return AsyncSubscription(mux, core)

    async def replay(
        self, topic_filter: str, start_time_us: int = 0, batch_size: int = 10_000, *, stale_ok: bool = False
    ) -> AsyncIterator[Message]:
        """Every stored message matching ``topic_filter``, in rank order.

        Shards come one after the other; within a shard, generations in order,
        and the streams of a generation merged by timestamp, so each sender's
        messages come back in the order they were stored. Every message
        acknowledged before the call is included; each shard is read up to
        its fence, taken when the call starts (see :meth:`get_fences`), so
        messages stored while the replay runs are not, and the replay ends.
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
        """What :meth:`replay` returns, in :class:`MessageBatch` es: no ``Message`` object unless asked for.

        Up to ``read_ahead`` shards (or generations) are read at once (in
        threads in the synchronous client, in tasks in the asyncio one), each
        at most 16 MiB of answers ahead of the caller; batches come in the
        same order as :meth:`replay`'s messages, at most ``batch_size``
        messages each. Closing the iterator stops the reads.

        A generation that retention drops while it is read raises
        ``GenerationDroppedError``; with ``on_dropped``, each of its streams
        is handed to it instead and skipped, and the replay goes on.
        """
        order = ops.replay_order(await self.get_streams(topic_filter, start_time_us, stale_ok=stale_ok))
        shards = sorted({streams[0].shard for streams in order})
        # Each shard is read up to its fence, taken now: what was acknowledged before the call is in it.
        fences = {f.shard: f.timestamp_us for f in await self.get_fences(shards, stale_ok=stale_ok)} if shards else {}

        def group(streams: list[Stream]) -> Callable[[], AsyncIterator[MessageBatch]]:
            read = RankRead(topic_filter, start_time_us, batch_size, fences[streams[0].shard], on_dropped)
            return lambda: read_rank(self, read, streams)

        groups = [group(streams) for streams in order]
        async for batch in read_ahead_batches(groups, ReadAhead(read_ahead, GROUP_DEPTH, GROUP_BYTES, WEIGH_BATCH)):
            yield batch

    # -- broker state: clients, subscriptions, retained messages, offline delivery --

    async def client_connected(
        self, clientid: str, node: str, timeout_s: float | None = None, *, session_expiry_s: int | None = None
    ) -> ClientState:
        """Record that ``clientid`` connected to broker ``node`` (online, node, online time) and return that.

        ``session_expiry_s`` is the Session Expiry Interval it connected with
        (MQTT 5, seconds: 0 its session ends when it disconnects,
        ``SESSION_NEVER_EXPIRES`` never); None (an MQTT 3.1.1 client) takes
        the node's ``session_expiry_default_s``. Once it has been offline that
        long, its state, proxy subscriptions and read positions are removed.
        A session that ended before this connect starts afresh.
        """
        state = await self._keyed_call(lambda n: ops.client_connected(clientid, node, n, session_expiry_s), timeout_s)
        assert state is not None  # a connect always leaves a record
        return state

    async def client_disconnected(
        self,
        clientid: str,
        node: str | None = None,
        timeout_s: float | None = None,
        *,
        session_expiry_s: int | None = None,
    ) -> ClientState | None:
        """Record that ``clientid`` disconnected (offline, offline time); the new state, None if unknown.

        With ``node``, only if the client is still recorded on that node, so a
        late disconnect from a broker the client already left (it reconnected
        elsewhere) does not mark it offline; None then too.
        ``session_expiry_s`` replaces the interval it connected with (MQTT 5's
        DISCONNECT may carry one); the state says when the session expires.
        """
        return await self._keyed_call(lambda n: ops.client_disconnected(clientid, node, n, session_expiry_s), timeout_s)

    async def client_state(
        self, clientid: str, *, stale_ok: bool = False, timeout_s: float | None = None
    ) -> ClientState | None:
        """What mqds knows of ``clientid``'s connection, or None if it never connected."""
        return await self._keyed_call(lambda n: ops.client_state(clientid, n, stale_ok), timeout_s)

    async def clients_on_node(self, node: str, *, stale_ok: bool = False, timeout_s: float | None = None) -> list[str]:
        """The clientids recorded online on broker ``node``, sorted."""
        return await self._fanout_call(ops.clients_on_node(node, stale_ok), timeout_s)

    async def subscribe(self, clientid: str, topic_filter: str, qos: int = 1, timeout_s: float | None = None) -> None:
        """Add (or change the QoS of) a proxy subscription of ``clientid``."""
        await self._keyed_call(lambda n: ops.subscribe(clientid, topic_filter, qos, n), timeout_s)

    async def unsubscribe(self, clientid: str, topic_filter: str, timeout_s: float | None = None) -> bool:
        """Remove a proxy subscription; whether it existed. The read position stays (see ``forget_acks``)."""
        return await self._keyed_call(lambda n: ops.unsubscribe(clientid, topic_filter, n), timeout_s)

    async def subscriptions(
        self, clientid: str, *, stale_ok: bool = False, timeout_s: float | None = None
    ) -> dict[str, int]:
        """The proxy subscriptions of ``clientid``: topic filter -> QoS, the filters sorted."""
        return await self._keyed_call(lambda n: ops.subscriptions(clientid, n, stale_ok), timeout_s)

    async def retain(self, message: Message, timeout_s: float | None = None) -> Message | None:
        """Keep ``message`` as its topic's retained message; an empty payload deletes it.

        Returns the retained message as stored (``timestamp_us`` and ``shard``
        set, ``retain`` true), or None when it deleted. Retained messages are
        kept in the shard of their topic, apart from the message store.
        """
        return await self._keyed_call(lambda n: ops.retain(message, n), timeout_s)

    async def retained(
        self, topic_filter: str, *, stale_ok: bool = False, timeout_s: float | None = None
    ) -> list[Message]:
        """The retained message of every topic matching ``topic_filter``, sorted by topic."""
        return await self._fanout_call(ops.retained(topic_filter, stale_ok), timeout_s)

    async def fetch_offline(
        self,
        clientid: str,
        topic_filter: str,
        mode: str = "pubsub",
        max_count: int = 500,
        time_range_s: float | None = None,
        *,
        include_qos0: bool = False,
        start: str = "earliest",
        shards: Iterable[int] | None = None,
        timeout_s: float | None = None,
    ) -> list[Message]:
        """Stored messages for a subscriber that was offline: oldest first, at most ``max_count``.

        ``mode="pubsub"`` (one-to-many): the messages matching ``topic_filter``
        after this (clientid, filter)'s read position, which ``ack`` moves;
        every subscriber has its own. ``mode="queue"`` (one-to-one): the
        matching messages no queue reader has acknowledged yet; an
        unacknowledged one comes again. Only QoS 1 and 2 messages unless
        ``include_qos0``; with ``time_range_s``, only messages newer than that
        many seconds. Each message has ``shard`` and ``timestamp_us`` set: its
        position, which ``ack`` takes.

        ``start`` says where a pubsub pair without a read position begins:
        ``"earliest"``, the whole stored history (it gets no position until it
        acknowledges); ``"now"``, what is stored from now on, as MQTT has it for
        a new subscription (the pair's read position is started now, see
        ``start_read_position``; a pair that has one reads on from it).
        ``shards``: only these shards (a share group's member reads its own).
        """
        fetch = ops.FetchOffline.check(clientid, topic_filter, mode, max_count, time_range_s, include_qos0, start)
        deadline = self._deadline(timeout_s)
        position: ReadPosition | None = None
        if fetch.pubsub:
            read = self.start_read_position if fetch.start_now else self.read_position
            position = await read(clientid, topic_filter, timeout_s=timeout_s)
        return fetch.cut(await self._fanout_call(fetch.messages(position, shards), time_left(deadline)))

    async def fetch_offline_many(
        self,
        requests: Iterable[OfflineFetch | tuple[str, str]],
        mode: str = "pubsub",
        max_count: int = 500,
        time_range_s: float | None = None,
        *,
        include_qos0: bool = False,
        start: str = "earliest",
        timeout_s: float | None = None,
    ) -> list[list[Message]]:
        """``fetch_offline`` for many sessions at once, in shared calls: each request's messages, in order.

        ``requests`` are ``(clientid, topic_filter)`` pairs, which take this
        call's other arguments, or :class:`mqds.client.OfflineFetch` values
        with options of their own (a broker's rules differ by filter). Each
        request gets exactly the list ``fetch_offline`` would return for it
        (read position, ``mode``, ``max_count``, ``time_range_s``,
        ``include_qos0`` and ``start`` alike); a pair that two requests name,
        one with ``start="now"`` and one with ``"earliest"``, is read by the
        second as if the first came after it.

        What it costs: the read positions in one call per node for all the
        pairs whose shards it leads, then one ``FetchMessagesShared`` call
        per node for all the sessions, in which each shard is scanned once
        per topic filter (not once per session) and a message several
        sessions need travels once; both in chunks of 1,000 sessions
        (``MAX_SESSIONS_PER_CALL``). A session a node's answer bound cut
        short is asked for the rest at once. A message that several sessions
        get is one ``Message`` object in their lists: do not modify it.
        One failure (after the call's retries) fails the whole call.
        """
        requests = list(requests)
        if not requests:
            return []
        deadline = self._deadline(timeout_s)
        defaults = OfflineFetch("", "", mode, max_count, time_range_s, include_qos0, start)
        plan = SharedFetch(requests, defaults, await self._n_shards(deadline))
        for positions in plan.position_calls():
            plan.record_positions(await self._fanout_call(positions, time_left(deadline)))
        while rounds := plan.fetch_rounds():
            for shared in rounds:
                shared.record(await self._fanout_call(shared.call, time_left(deadline)))
        return plan.results()

    async def read_position(self, clientid: str, topic_filter: str, *, timeout_s: float | None = None) -> ReadPosition:
        """How far the (clientid, filter) pair has read in pubsub mode (``found`` False: it has no position)."""
        return await self._keyed_call(lambda n: ops.read_position(clientid, topic_filter, n), timeout_s)

    async def start_read_position(
        self, clientid: str, topic_filter: str, *, timeout_s: float | None = None
    ) -> ReadPosition:
        """Start the pair's read position now, unless it has one; the pair's position either way.

        A started position reads only what is stored after it: a new MQTT
        subscription's offline delivery begins at its SUBSCRIBE. Message
        timestamps come from each shard leader's clock, so "after" holds to
        within the nodes' clock skew (NTP keeps it to milliseconds).
        """
        return await self._keyed_call(lambda n: ops.start_read_position(clientid, topic_filter, n), timeout_s)

    async def ack(
        self, clientid: str, topic_filter: str, message: Message, mode: str = "pubsub", timeout_s: float | None = None
    ) -> None:
        """Acknowledge a message delivered to ``clientid`` through ``topic_filter``.

        ``pubsub``: moves this (clientid, filter)'s read position in the
        message's shard up to the message (acknowledging a message also
        acknowledges the earlier ones of its shard: brokers deliver in order).
        ``queue``: removes the message for every queue reader (and ends its
        delivery to ``clientid``, see ``deliver``). ``delivery``: ends a
        delivery of ``deliver`` to the (clientid, filter) consumer, in the
        message's shard, and nothing else. ``message``
        must carry its position (``shard``, ``timestamp_us``), as
        ``fetch_offline`` and ``store_batch`` return it.
        """
        await self._keyed_call(lambda n: ops.ack(clientid, topic_filter, message, mode, n), timeout_s)

    async def deliver(
        self,
        clientid: str,
        topic_filter: str,
        policy: Policy,
        max_count: int = 100,
        *,
        queue: bool = False,
        include_qos0: bool = False,
        start_after_us: int = 0,
        shards: Iterable[int] | None = None,
        timeout_s: float | None = None,
    ) -> Delivered:
        """Messages for a consumer that the cluster redelivers: its due redeliveries first, then new messages.

        The consumer is ``clientid`` (a queue reader's, or a share group's
        ``"$share/<group>"``) with ``topic_filter``. A message it does not
        acknowledge (``ack(..., mode="delivery")``, or ``"queue"`` for a queue
        reader, which also removes it for every queue reader) within the
        policy's wait comes back from a later call, its count one higher;
        after ``policy.max_deliveries`` deliveries it is stored on the
        policy's dead-letter topic and not delivered again. ``policy`` is a
        :class:`mqds.protocol.delivery.Policy` (``Policy.of`` checks it).

        Each node leading some of ``shards`` (None: every shard) answers with
        at most ``max_count`` messages and its ``max_answer_bytes``; every
        message in the answer is counted as delivered, so handle them all.
        ``queue``: skip messages a queue reader acknowledged. ``start_after_us``:
        where a consumer new to a shard starts (0: the whole stored history).
        A call that fails after a node logged its step loses that node's
        answer: its messages come back after their wait (at least once).
        """
        call = ops.deliver(clientid, topic_filter, policy, max_count, queue, include_qos0, start_after_us, shards)
        return Delivered.merged(await self._fanout_call(call, timeout_s))

    async def nack(
        self,
        clientid: str,
        topic_filter: str,
        message: Message,
        *,
        received: bool = True,
        timeout_s: float | None = None,
    ) -> None:
        """Give back a message ``deliver`` gave the (clientid, filter) consumer (a negative acknowledgement):
        it is due again at once, its delivery count kept, so the consumer's next ``deliver`` call delivers it
        again, or dead-letters it after its last delivery. ``received=False``: it never reached the consumer
        (a broker fetched it and lost the connection before sending it), so that delivery does not count. A
        message not waiting for its ack is left alone."""
        mode = "nack" if received else "release"
        await self._keyed_call(lambda n: ops.ack(clientid, topic_filter, message, mode, n), timeout_s)

    async def forget_acks(self, clientid: str, topic_filter: str, timeout_s: float | None = None) -> bool:
        """Delete the (clientid, filter) read position (the seed backends' ``on_acked_delete``); whether it existed."""
        return await self._keyed_call(lambda n: ops.forget_acks(clientid, topic_filter, n), timeout_s)

    async def join_share_group(
        self, group: str, topic_filter: str, member: str, lease_s: int = 30, timeout_s: float | None = None
    ) -> ShareAssignment:
        """Join the share group ``$share/<group>/<topic_filter>`` as ``member`` (or renew its lease) for
        ``lease_s`` seconds; the live members and the shards this member reads. See
        :class:`mqds.client.SharedSubscription`, which fetches, acknowledges and renews."""
        return await self._keyed_call(
            lambda n: share_group_call("JoinShareGroup", group, topic_filter, member, lease_s, n), timeout_s
        )

    async def leave_share_group(
        self, group: str, topic_filter: str, member: str, timeout_s: float | None = None
    ) -> ShareAssignment:
        """Leave a share group at once (its shards go to the other members); the members left."""
        return await self._keyed_call(
            lambda n: share_group_call("LeaveShareGroup", group, topic_filter, member, 0, n), timeout_s
        )

    async def forget_session(self, clientid: str, timeout_s: float | None = None) -> tuple[int, int]:
        """Delete every proxy subscription and read position of ``clientid`` (an MQTT clean session discards
        the previous session); (subscriptions, read positions) deleted. Its client state stays."""
        return await self._keyed_call(lambda n: ops.forget_session(clientid, n), timeout_s)

    # -- inspecting consumers -----------------------------------------------------

    async def consumers(
        self,
        kinds: Iterable[str] | None = None,
        *,
        clientid: str = "",
        clientid_prefix: str = "",
        group: str = "",
        lag: bool = True,
        lag_cap: int = 0,
        stale_ok: bool = False,
        timeout_s: float | None = None,
    ) -> Consumers:
        """Who reads the cluster, and how far behind: client sessions, read positions, share groups, push
        subscriptions (``kinds``, a subset of ``"sessions"``, ``"read_positions"``, ``"share_groups"``,
        ``"push_subscriptions"``; None: all). An admin call: it needs the cluster secret or an admin token.

        Each kind is listed from every shard's leader page by page (``Sessions.ListConsumers``), merged
        and sorted; ``clientid`` (exact) and ``clientid_prefix`` narrow sessions and read positions,
        ``group`` share groups (and read positions to that group's). With ``lag``, each read position and
        share group gets its :class:`~mqds.client.core.consumers.Lag`, measured on every shard's leader
        (``Sessions.ConsumerLag``): messages counted up to ``lag_cap`` per shard (0: the nodes' 10,000;
        at most 100,000) and "at least" beyond, and the age of the oldest unread message. Push
        subscriptions are asked of every node (each serves its own) with their lag in the shard they
        read; a node that does not answer is named in ``unreachable``.
        """
        chosen = check_kinds(kinds)
        deadline = self._deadline(timeout_s)
        found = Consumers()
        for kind in chosen:
            if kind == "push_subscriptions":
                await self._push_subscriptions(found, lag_cap, deadline)
                continue
            pages = ConsumerPages(kind, clientid, clientid_prefix, group, stale_ok)
            while (call := pages.next_call()) is not None:
                pages.record(await self._fanout_call(call, time_left(deadline)))
            if kind == "sessions":
                found.sessions = pages.sessions()
            elif kind == "read_positions":
                found.read_positions = pages.positions()
            else:
                found.share_groups = pages.share_groups()
        positions, groups = found.read_positions or [], found.share_groups or []
        if lag and (positions or groups):
            places = [(p.topic_filter, p.position) for p in positions] + [(g.topic_filter, g.position) for g in groups]
            plan = LagPlan(places, lag_cap, await self._n_shards(deadline), stale_ok)
            for first, lag_call in plan.calls():
                plan.record(first, await self._fanout_call(lag_call, time_left(deadline)))
            lags = plan.lags()
            if found.read_positions is not None:
                found.read_positions = [dataclasses.replace(p, lag=lags[i]) for i, p in enumerate(positions)]
            if found.share_groups is not None:
                n = len(positions)
                found.share_groups = [dataclasses.replace(g, lag=lags[n + i]) for i, g in enumerate(groups)]
        return found

    async def _push_subscriptions(self, found: Consumers, lag_cap: int, deadline: float) -> None:
        """Every node's push subscriptions into ``found`` (a node that does not answer into ``unreachable``)."""
        view = await self._router.ensure_map(time_left(deadline))
        found.push_subscriptions = []
        for node, address in sorted(view.addresses.items()):
            start = b""
            try:
                while True:
                    answer = await self._rpc(
                        address, "ListConsumers", push_request(start, lag_cap), time_left(deadline), "Sessions"
                    )
                    page, start = push_page(node, answer)
                    found.push_subscriptions.extend(page)
                    if not start:
                        break
            except MqdsError as err:
                if err.reason in (Reason.UNAUTHENTICATED, Reason.PERMISSION_DENIED, Reason.INVALID_REQUEST):
                    raise
                found.unreachable.append(node)

    # -- storage administration: generations, deletes, backup and restore ----

    # -- generations ---------------------------------------------------------

    async def add_generation(self, shard: int | None = None, timeout_s: float | None = None) -> list[Generation]:
        """Start a new generation in ``shard``, or in every shard; return the new ones."""
        return await self._fanout_call(ops.add_generation(shard), timeout_s)

    async def list_generations(
        self, shard: int | None = None, *, stale_ok: bool = False, timeout_s: float | None = None
    ) -> list[Generation]:
        """The generations of ``shard``, or of every shard, in order."""
        return await self._fanout_call(ops.list_generations(shard, stale_ok), timeout_s)

    async def drop_generation(self, shard: int, generation: int, timeout_s: float | None = None) -> Generation:
        """Drop a closed generation of a shard and free its disk; return it as it was."""
        return await self._shard_call(ops.drop_generation(shard, generation), timeout_s)

    # -- deletes -------------------------------------------------------------

    async def delete_messages(
        self,
        topic_filter: str,
        *,
        sender: str = "",
        since_us: int = 0,
        until_us: int = 0,
        confirm_all: bool = False,
        timeout_s: float | None = None,
        progress: Progress | None = None,
    ) -> DeleteReport:
        """Delete stored messages: those matching ``topic_filter``, of ``sender`` if given, stored in
        ``[since_us, until_us)`` (0: no bound; without ``until_us``, what each shard stored before the
        delete reached it). Needs the admin role (a node's cluster secret or an admin token).

        A sender's messages are deleted in its one shard, others in every shard, one after another;
        each shard's leader logs the delete in bounded steps that every replica applies, so readers,
        iterators and push subscribers see the messages gone at once. ``timeout_s`` bounds each call,
        not the whole delete: a node answers within it with what it did and where to go on, and
        ``progress(shard, answer)`` is called with each answer. Deleting everything (``#``, no sender,
        no time range) needs ``confirm_all``. Returns what was deleted, per shard.
        """
        run = DeleteRun(
            await self._n_shards(self._deadline(timeout_s)),
            topic_filter,
            sender,
            since_us,
            until_us,
            confirm_all,
            progress,
        )
        while (call := run.next_call()) is not None:
            run.record(await self._shard_call(call, timeout_s))
        return run.report

    # -- backup and restore --------------------------------------------------

    async def backup(
        self,
        to: str,
        *,
        parallel: int = 2,
        incremental: bool = True,
        timeout_s: float = 3600.0,
        progress: BackupProgress | None = None,
    ) -> BackupReport:
        """Back up the whole cluster into ``to`` (a directory or an fsspec URL): every shard at a fence
        pinned now, the broker state and the retention policy, with a manifest of checksums written
        last. ``parallel`` shards are exported at a time, each from a follower where one has reached
        its fence. Into a place that holds a backup already, closed generations it has (unchanged
        since) are not copied again unless ``incremental`` is False. Needs the admin role. The exports
        run in threads in the synchronous client, as tasks in the asyncio one (whose file reads and
        writes go to a worker thread, so the event loop goes on); see the driver's ``backup`` module."""
        deadline = self._deadline(timeout_s)
        fences = {f.shard: f.timestamp_us for f in await self.get_fences(timeout_s=min(timeout_s, START_S))}
        router, call_error = self._routing()
        return await backups.backup(
            router,
            call_error,
            to,
            fences=fences,
            retention=await self.retention(min(timeout_s, START_S)),
            deadline=deadline,
            parallel=parallel,
            incremental=incremental,
            progress=progress,
        )

    async def restore(
        self,
        source: str,
        *,
        parallel: int = 2,
        timeout_s: float = 3600.0,
        progress: BackupProgress | None = None,
    ) -> RestoreReport:
        """Restore the backup at ``source`` into this cluster, which must be empty and have the backup's
        shard count (any size and placement). The whole backup is checked first (checksums), and a
        damaged or partial one is refused (``BackupError`` naming what is wrong). A restore that fails
        abandons what it began (the shards are empty and writable again) and raises ``BackupError`` saying
        what failed and what was abandoned. Needs the admin role."""
        deadline = self._deadline(timeout_s)
        router, call_error = self._routing()
        return await backups.restore(
            router,
            call_error,
            source,
            n_shards=await self._n_shards(deadline),
            deadline=deadline,
            parallel=parallel,
            progress=progress,
        )

    async def abandon_restore(self, *, timeout_s: float = 60.0) -> list[int]:
        """End every restore under way in this cluster (one a stopped ``mqds restore`` left behind): what each
        wrote is cleared and the shard takes writes again; the shards whose restore was ended. A shard not being
        restored is left as it is. Needs the admin role."""
        deadline = self._deadline(timeout_s)
        router, call_error = self._routing()
        return await backups.abandon_restore(router, call_error, await self._n_shards(deadline), deadline)
