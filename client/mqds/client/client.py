"""The synchronous mqds client: one API over every vnode of a cluster."""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Iterator as AbcIterator
from typing import Any, TypeVar

import grpc

from mqds.client import operations as ops
from mqds.client import retention as retention_calls
from mqds.client.batch import MessageBatch, NextResult
from mqds.client.broker_state import BrokerStateCalls
from mqds.client.connection import DEFAULT_MAX_MESSAGE_BYTES, ConnectionSettings, parse_endpoints, resolve_settings
from mqds.client.follow import FollowCore, FollowPosition
from mqds.client.follow_sync import FollowMux, Subscription
from mqds.client.model import Fence, Iterator, Message, Rank, Stream
from mqds.client.operations import FanoutCall, ShardCall
from mqds.client.pipeline import PipelineLimits, resolve_limits
from mqds.client.pipeline_handles import StoreFuture
from mqds.client.pipeline_sync import SyncPipeline
from mqds.client.replay import GROUP_BYTES, GROUP_DEPTH, WEIGH_BATCH
from mqds.client.replay import read_ahead as read_ahead_batches
from mqds.client.retry import time_left
from mqds.client.routing import Backoff, Router, ShardFailures
from mqds.client.storage_admin import StorageAdminCalls
from mqds.client.stream_reads import RankRead, read_rank
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.v1 import cluster_pb2 as clpb

log = logging.getLogger(__name__)

T = TypeVar("T")


__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "Client", "ShardFailures", "parse_endpoints"]


class Client(BrokerStateCalls, StorageAdminCalls):
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
    subclasses. The client is thread-safe; close it, or use it as a context
    manager, to release its connections.

    ``settings`` (:class:`mqds.client.ConnectionSettings`) say how to connect:
    TLS, auth token, keepalive, message size limits and the default deadline.
    ``timeout_s`` and ``max_message_bytes`` (both send and receive limits),
    when given, override the settings' values. A missing or bad TLS file is
    a ``ValueError`` here. :class:`mqds.client.aio.Client` is the asyncio
    twin of this class.

    ``max_in_flight_messages`` (default 10,000) bounds the messages
    ``store_async`` keeps unacknowledged; ``pipeline``
    (:class:`mqds.client.pipeline.PipelineLimits`) sets the batch limits too.
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
        self._router = Router(self.endpoints, settings=self.settings, backoff=backoff)
        self.producer_id = uuid.uuid4().hex
        """Names this client's writes for exactly-once storage (see ``store_batch``)."""
        self._sequences = itertools.count(1)
        self.pipeline_limits = resolve_limits(pipeline, max_in_flight_messages, self.settings.max_send_message_bytes)
        """The window and batch limits of ``store_async`` / ``publish``."""
        self._pipeline: SyncPipeline | None = None
        self._pipeline_lock = threading.Lock()
        self._follows: FollowMux | None = None

    # -- plumbing ------------------------------------------------------------

    def _deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def _rpc(self, address: str, method: str, request: Any, timeout_s: float, service: str = "Storage") -> Any:
        stub = self._router.sessions(address) if service == "Sessions" else self._router.storage(address)
        try:
            return getattr(stub, method)(request, timeout=timeout_s, metadata=self._router.metadata)
        except grpc.RpcError as err:
            raise self.settings.call_error(err) from None

    def _on_shard(
        self,
        shard: int,
        method: str,
        request: Any,
        deadline: float,
        *,
        stale_ok: bool = False,
        service: str = "Storage",
    ) -> Any:
        self._router.ensure_map(time_left(deadline))
        return self._router.call(
            shard,
            lambda address, remaining: self._rpc(address, method, request, remaining, service),
            deadline,
            any_replica=stale_ok,
            retry_unavailable=True,
        )

    def _n_shards(self, deadline: float) -> int:
        return self._router.ensure_map(time_left(deadline)).n_shards

    def _routing(self) -> tuple[Router, Callable[[grpc.RpcError], MqdsError]]:
        return self._router, self.settings.call_error

    def _shard_call(self, call: ShardCall[T], timeout_s: float | None, deadline: float | None = None) -> T:
        deadline = self._deadline(timeout_s) if deadline is None else deadline
        return call.parse(
            self._on_shard(
                call.shard, call.method, call.request, deadline, stale_ok=call.stale_ok, service=call.service
            )
        )

    def _keyed_call(self, build: Callable[[int], ShardCall[T]], timeout_s: float | None) -> T:
        """A call to the shard of a key (a clientid, a topic): ``build`` gets the cluster's shard count."""
        deadline = self._deadline(timeout_s)
        return self._shard_call(build(self._n_shards(deadline)), timeout_s, deadline)

    def _fanout_call(self, call: FanoutCall[T], timeout_s: float | None) -> list[T]:
        deadline = self._deadline(timeout_s)
        shards = call.shards_of(self._n_shards(deadline))

        def send(group: list[int], address: str, remaining: float) -> list[T]:
            return call.parse(self._rpc(address, call.method, call.request(group), remaining, call.service))

        return call.merge(self._per_leader(shards, send, deadline, call.stale_ok))

    def _per_leader(
        self, shards: Iterable[int], call: Callable[[list[int], str, float], T], deadline: float, stale_ok: bool = False
    ) -> list[T]:
        """Run ``call(shards, address, timeout)`` once per node leading some of ``shards``, in parallel.

        Shards whose call failed with a retriable error are regrouped by their
        (new) leaders and tried again until the deadline; then the first
        failure is raised.
        """
        results, failures = self._router.fanout(shards, call, deadline, stale_ok)
        if failures:
            raise next(iter(failures.values()))
        return results

    def close(self) -> None:
        """Release the connections; ``store_async`` calls not acknowledged yet fail with UNAVAILABLE."""
        with self._pipeline_lock:
            pipeline, self._pipeline = self._pipeline, None
            follows, self._follows = self._follows, None
        if pipeline is not None:
            pipeline.close()
        if follows is not None:
            follows.close()
        self._router.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the cluster ------------------------------------------------------------

    def cluster_map(self, timeout_s: float | None = None) -> clpb.ClusterMap:
        """The cluster map as the nodes see it now (nodes, placement, leaders).

        While no node answers (the cluster is still starting), asks again
        with backoff until ``timeout_s`` (else the settings') runs out.
        """
        self._router.wait_for_map(time.monotonic() + (timeout_s or self.timeout_s), force=True)
        return self._router.table.cluster_map()

    def set_retention(
        self, rules: Sequence[tuple[str, int]], default_s: int = 0, timeout_s: float | None = None
    ) -> clpb.RetentionPolicy:
        """Set the cluster's retention policy: ``(topic filter, seconds)`` rules, the first matching one
        deciding a message's period, and ``default_s`` for the rest (0: kept until deleted). Replaces the
        previous policy; each vnode's leader then removes what it ended. Needs the admin role."""
        policy = retention_calls.policy_message(rules, default_s)
        self._router.ensure_map(self.timeout_s if timeout_s is None else timeout_s)
        return retention_calls.set_policy(self._router, self.settings.call_error, policy, self._deadline(timeout_s))

    def retention(self, timeout_s: float | None = None) -> clpb.RetentionPolicy | None:
        """The cluster's retention policy, or None when none was set (each node's retention_period_s applies)."""
        return retention_calls.policy_of(self.cluster_map(timeout_s))

    # -- writes --------------------------------------------------------------

    def store_batch(
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
        plan = ops.StoreBatch(batch, self._n_shards(deadline), self.producer_id, seq, sync)

        def send(shards: list[int], address: str, remaining: float) -> None:
            indexes, request = plan.request(shards)
            plan.record(indexes, self._rpc(address, "StoreBatch", request, remaining))

        _, failures = self._router.fanout(plan.shards, send, deadline)
        return plan.outcome(failures)

    def store_async(self, messages: Message | Iterable[Message], *, timeout_s: float | None = None) -> StoreFuture:
        """Queue messages for pipelined storing; a future of them with ``timestamp_us`` and ``shard`` set.

        The future is a :class:`~mqds.client.pipeline_handles.StoreFuture`:
        a ``concurrent.futures.Future`` that is the call itself (one object;
        it makes a lock only for a caller that waits before it is done).
        Messages go to their shards' leaders on one ``StoreStream`` per node,
        coalesced with other calls' into batches. Blocks while the window
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
            n_shards = self._n_shards(deadline)
        except MqdsError as err:
            return StoreFuture.failed_with(err)
        pipeline = self._pipeline
        if pipeline is None:
            with self._pipeline_lock:
                if self._pipeline is None:
                    self._pipeline = SyncPipeline(self._router, self.producer_id, self._sequences, self.pipeline_limits)
                pipeline = self._pipeline
        return pipeline.submit(batch, n_shards, deadline)

    def pipeline_stats(self) -> dict[str, int]:
        """What the pipelined writes did: ``calls`` taken, ``batches`` sent for them and their ``messages``.

        ``messages / batches`` is how many messages a batch carried: how well
        concurrent calls were coalesced (resends are not counted).
        """
        pipeline = self._pipeline
        return dict(pipeline.core.stats) if pipeline is not None else {"calls": 0, "batches": 0, "messages": 0}

    def publish(self, messages: Message | Iterable[Message], timeout_s: float | None = None) -> list[Message]:
        """Store messages through the pipeline (``store_async``) and wait for them; the stored messages."""
        return self.store_async(messages, timeout_s=timeout_s).result()

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every ``store_async`` / ``publish`` call made before this one is acknowledged or failed.

        Each call's outcome stays in its own future (``flush`` raises none of
        them). Raises DEADLINE_EXCEEDED if some are still in flight after
        ``timeout_s`` (default: the client's timeout); they go on.
        """
        pipeline = self._pipeline
        if pipeline is None:
            return
        waiting = pipeline.pending()
        budget = self.settings.timeout_s if timeout_s is None else timeout_s
        end = time.monotonic() + budget
        left = [f for f in waiting if not f.wait(end - time.monotonic())]
        if left:
            raise errors.error(
                Reason.DEADLINE_EXCEEDED,
                f"{len(left)} of {len(waiting)} pipelined calls still in flight after {budget:g} s",
            )

    # -- reads ---------------------------------------------------------------

    def get_streams(
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
        return self._fanout_call(ops.get_streams(topic_filter, start_time_us, stale_ok, chosen), timeout_s)

    def make_iterator(
        self,
        stream: Stream,
        topic_filter: str,
        start_time_us: int = 0,
        *,
        stale_ok: bool = False,
        timeout_s: float | None = None,
    ) -> Iterator:
        """An iterator over ``stream``'s messages matching ``topic_filter`` from ``start_time_us``."""
        return self._shard_call(ops.make_iterator(stream, topic_filter, start_time_us, stale_ok), timeout_s)

    def next(
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
        return self._shard_call(ops.next_batch(iterator, batch_size, stale_ok, fence_us), timeout_s)

    def first_batch(
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
        return self._shard_call(call, timeout_s)

    def get_fences(
        self, shards: Iterable[int] | None = None, *, stale_ok: bool = False, timeout_s: float | None = None
    ) -> list[Fence]:
        """The read fence of each shard (or of ``shards``), in shard order: see :class:`Fence`."""
        return self._fanout_call(ops.get_fences(None if shards is None else list(shards), stale_ok), timeout_s)

    def follow(
        self,
        topic_filter: str,
        *,
        start_time_us: int = 0,
        position: FollowPosition | bytes | None = None,
        window: int = 1000,
        any_replica: bool = False,
        shards: Iterable[int] | None = None,
        timeout_s: float | None = None,
    ) -> Subscription:
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
        view = self._router.ensure_map(time_left(deadline))
        options = {"start_time_us": start_time_us, "window": window, "any_replica": any_replica}
        core = FollowCore.of(self._router.table, view, topic_filter, position, shards, **options)
        with self._pipeline_lock:
            if self._follows is None:
                self._follows = FollowMux(self._router)
            mux = self._follows
        return Subscription(mux, core)

    def replay(
        self, topic_filter: str, start_time_us: int = 0, batch_size: int = 10_000, *, stale_ok: bool = False
    ) -> AbcIterator[Message]:
        """Every stored message matching ``topic_filter``, in rank order.

        Shards come one after the other; within a shard, generations in order,
        and the streams of a generation merged by timestamp, so each sender's
        messages come back in the order they were stored. Every message
        acknowledged before the call is included; each shard is read up to
        its fence, taken when the call starts (see :meth:`get_fences`), so
        messages stored while the replay runs are not, and the replay ends.
        """
        for batch in self.replay_batches(topic_filter, start_time_us, batch_size, stale_ok=stale_ok):
            yield from batch

    def replay_batches(
        self,
        topic_filter: str,
        start_time_us: int = 0,
        batch_size: int = 10_000,
        *,
        stale_ok: bool = False,
        read_ahead: int = 4,
        on_dropped: Callable[[Stream], None] | None = None,
    ) -> AbcIterator[MessageBatch]:
        """What :meth:`replay` returns, in :class:`MessageBatch` es: no ``Message`` object unless asked for.

        Up to ``read_ahead`` shards (or generations) are read at once, in
        threads, each at most 16 MiB of answers ahead of the caller; batches come
        in the same order as :meth:`replay`'s messages, at most
        ``batch_size`` messages each. Closing the iterator stops the reads.

        A generation that retention drops while it is read raises
        ``GenerationDroppedError``; with ``on_dropped``, each of its streams
        is handed to it instead and skipped, and the replay goes on.
        """
        order = ops.replay_order(self.get_streams(topic_filter, start_time_us, stale_ok=stale_ok))
        shards = sorted({streams[0].shard for streams in order})
        # Each shard is read up to its fence, taken now: what was acknowledged before the call is in it.
        fences = {f.shard: f.timestamp_us for f in self.get_fences(shards, stale_ok=stale_ok)} if shards else {}

        def group(streams: list[Stream]) -> Callable[[], AbcIterator[MessageBatch]]:
            read = RankRead(topic_filter, start_time_us, batch_size, fences[streams[0].shard], on_dropped)
            return lambda: read_rank(self, read, streams)

        return read_ahead_batches(
            [group(streams) for streams in order], read_ahead, GROUP_DEPTH, GROUP_BYTES, WEIGH_BATCH
        )
