"""The synchronous mqds client: one API over every vnode of a cluster."""

from __future__ import annotations

import heapq
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Iterator as AbcIterator
from concurrent import futures
from typing import Any, TypeVar

import grpc

from mqds.client.model import Generation, Iterator, Message, NextResult, Rank, Stream
from mqds.client.routing import Backoff, Router
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, PartialBatchError, Reason
from mqds.protocol.sharding import shard_of
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import storage_pb2 as pb

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """``"a:1,b:2"`` or ``["a:1", "b:2"]`` -> ``["a:1", "b:2"]``; rejects empty and port-less entries."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed = [item.strip() for item in items if item and item.strip()]
    if not parsed:
        raise ValueError("no endpoints given: pass 'host:port' addresses of mqds nodes")
    for item in parsed:
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"endpoint {item!r} is not host:port")
    return parsed


class Client:
    """Stores and replays MQTT messages on an mqds cluster.

    ``endpoints`` is a list of ``"host:port"`` strings (any subset of the
    cluster's nodes) or one comma-separated string. The client learns the
    cluster map from them, sends each write to its shard's leader, follows
    leader changes and retries what is safe to retry within ``timeout_s``.
    Reads go to the shard's leader (linearizable); pass ``stale_ok=True`` to
    let any replica answer. Failures raise :class:`mqds.client.errors.MqdsError`
    subclasses. The client is thread-safe; close it, or use it as a context
    manager, to release its connections.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout_s: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        backoff: Backoff | None = None,
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout_s = timeout_s
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # A node that restarts is back in a second or two: retry the
            # connection that often, not on gRPC's default backoff (up to 2
            # minutes), and keep the backoff state per client.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.use_local_subchannel_pool", 1),
        ]
        self._router = Router(self.endpoints, channel_options=options, backoff=backoff)
        self.producer_id = uuid.uuid4().hex
        """Names this client's writes for exactly-once storage (see ``store_batch``)."""
        self._sequences = itertools.count(1)

    # -- plumbing ------------------------------------------------------------

    def _deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def _rpc(self, address: str, method: str, request: Any, timeout_s: float) -> Any:
        try:
            return getattr(self._router.storage(address), method)(request, timeout=timeout_s)
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None

    def _on_shard(
        self, shard: int, method: str, request: Any, deadline: float, *, stale_ok: bool = False, write: bool = False
    ) -> Any:
        self._router.ensure_map(max(0.1, deadline - time.monotonic()))
        return self._router.call(
            shard,
            lambda address, remaining: self._rpc(address, method, request, remaining),
            deadline,
            any_replica=stale_ok,
            retry_unavailable=True,
        )

    def _n_shards(self, deadline: float) -> int:
        return self._router.ensure_map(max(0.1, deadline - time.monotonic())).n_shards

    def _per_leader(
        self, shards: Iterable[int], call: Callable[[list[int], str, float], T], deadline: float, stale_ok: bool = False
    ) -> list[T]:
        """Run ``call(shards, address, timeout)`` once per node leading some of ``shards``, in parallel.

        Shards whose call failed with a retriable error are regrouped by their
        (new) leaders and tried again until the deadline; then the first
        failure is raised.
        """
        results, failures = self._per_leader_partial(shards, call, deadline, stale_ok)
        if failures:
            raise next(iter(failures.values()))
        return results

    def _per_leader_partial(
        self, shards: Iterable[int], call: Callable[[list[int], str, float], T], deadline: float, stale_ok: bool = False
    ) -> tuple[list[T], dict[int, MqdsError]]:
        """Like ``_per_leader``, but returns what succeeded and each failed shard's final error.

        ``call`` may raise :class:`ShardFailures` to fail some of its shards
        while the others succeeded (their results it records itself).
        """
        pending = sorted(set(shards))
        results: list[T] = []
        failures: dict[int, MqdsError] = {}
        delays = self._router.backoff.delays()
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timeout = errors.error(Reason.DEADLINE_EXCEEDED, "the call did not succeed before its deadline")
                failures.update((shard, timeout) for shard in pending)
                break
            groups: dict[str, list[int]] = {}
            for shard in pending:
                if stale_ok:
                    address = (self._router.replica_addresses(shard) or self._router.known_addresses())[0]
                else:
                    address = self._router.leader_of(shard) or self._router.known_addresses()[0]
                groups.setdefault(address, []).append(shard)
            jobs = {self._router.submit(call, group, address, remaining): group for address, group in groups.items()}
            failed: dict[int, MqdsError] = {}
            for job in futures.as_completed(jobs):
                group = jobs[job]
                try:
                    results.append(job.result())
                except ShardFailures as some:
                    failed.update(some.errors)
                except MqdsError as err:
                    failed.update((shard, err) for shard in group)
            retry: list[int] = []
            hinted = True
            for problem, failed_shards in _by_error(failed).items():
                if not problem.retriable:
                    failures.update((shard, problem) for shard in failed_shards)
                    continue
                retry.extend(failed_shards)
                shard_hint = problem.metadata.get("shard")
                if shard_hint is not None and self._router.learn(problem, int(shard_hint)):
                    continue
                # No usable hint: forget the leaders, refresh the map and back off.
                for shard in failed_shards:
                    self._router.forget_leader(shard)
                hinted = False
            pending = sorted(retry)
            if pending and not hinted:
                self._router.refresh_quietly(remaining)
                delay = next(delays)
                if time.monotonic() + delay >= deadline:
                    failures.update((shard, failed[shard]) for shard in pending)
                    break
                time.sleep(delay)
        return results, failures

    def close(self) -> None:
        self._router.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the cluster ------------------------------------------------------------

    def cluster_map(self, timeout_s: float | None = None) -> clpb.ClusterMap:
        """The cluster map as the nodes see it now (nodes, placement, leaders)."""
        view = self._router.refresh(timeout_s or self.timeout_s, force=True)
        cmap = clpb.ClusterMap(
            cluster_id=view.cluster_id, n_shards=view.n_shards, version=view.version, meta_leader=view.meta_leader
        )
        for node_id, address in sorted(view.addresses.items()):
            cmap.nodes.add(id=node_id, address=address)
        for shard in range(view.n_shards):
            term, leader = view.leaders.get(shard, (0, ""))
            cmap.vnodes.add(shard=shard, replicas=view.replicas.get(shard, []), leader=leader, term=term)
        return cmap

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
        seq = next(self._sequences) if sequence is None else sequence
        if seq < 1:
            raise ValueError(f"sequence must be 1 or more, got {seq}")
        deadline = self._deadline(timeout_s)
        n_shards = self._n_shards(deadline)
        by_shard: dict[int, list[int]] = {}
        for index, message in enumerate(batch):
            by_shard.setdefault(shard_of(message.sender, n_shards), []).append(index)
        encoded = [m.to_pb() for m in batch]
        positions: dict[int, tuple[int, int]] = {}

        def send(shards: list[int], address: str, remaining: float) -> None:
            indexes = [i for shard in shards for i in by_shard[shard]]
            request = pb.StoreBatchRequest(
                messages=[encoded[i] for i in indexes], sync=sync, producer_id=self.producer_id, sequence=seq
            )
            response = self._rpc(address, "StoreBatch", request, remaining)
            for index, position in zip(indexes, response.positions, strict=True):
                if position.timestamp_us:
                    positions[index] = (position.timestamp_us, position.shard)
            if response.failures:
                raise ShardFailures({f.shard: errors.from_failure(f) for f in response.failures})

        _, failures = self._per_leader_partial(by_shard, send, deadline)
        stored: list[Message] = []
        failed: list[tuple[Message, MqdsError]] = []
        for index, m in enumerate(batch):
            if index in positions:
                ts, shard = positions[index]
                stored.append(Message(m.topic, m.payload, m.sender, m.qos, m.retain, m.properties, ts, shard))
            else:
                shard = shard_of(m.sender, n_shards)
                failed.append(
                    (Message(m.topic, m.payload, m.sender, m.qos, m.retain, m.properties, None, shard), failures[shard])
                )
        if not failed:
            return stored
        if not stored:
            err = failed[0][1]
            err.metadata["sequence"] = str(seq)
            raise err
        raise PartialBatchError(stored, failed, seq)

    # -- reads ---------------------------------------------------------------

    def get_streams(
        self, topic_filter: str, start_time_us: int = 0, *, stale_ok: bool = False, timeout_s: float | None = None
    ) -> list[tuple[Rank, Stream]]:
        """The streams that may hold messages matching ``topic_filter`` at or after ``start_time_us``, by rank."""
        deadline = self._deadline(timeout_s)
        n_shards = self._n_shards(deadline)

        def fetch(shards: list[int], address: str, remaining: float) -> list[tuple[Rank, Stream]]:
            request = pb.GetStreamsRequest(
                topic_filter=topic_filter, start_time_us=start_time_us, shards=shards, stale_ok=stale_ok
            )
            response = self._rpc(address, "GetStreams", request, remaining)
            return [(Rank(s.rank.shard, s.rank.generation), Stream.from_pb(s.stream)) for s in response.streams]

        found = [item for part in self._per_leader(range(n_shards), fetch, deadline, stale_ok) for item in part]
        return sorted(found, key=lambda item: (item[0], item[1].id))

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
        request = pb.MakeIteratorRequest(
            stream=stream.to_pb(), topic_filter=topic_filter, start_time_us=start_time_us, stale_ok=stale_ok
        )
        response = self._on_shard(stream.shard, "MakeIterator", request, self._deadline(timeout_s), stale_ok=stale_ok)
        return Iterator.from_pb(response.iterator)

    def next(
        self, iterator: Iterator, batch_size: int = 100, *, stale_ok: bool = False, timeout_s: float | None = None
    ) -> NextResult:
        """Up to ``batch_size`` messages after ``iterator``, and the advanced iterator.

        Iterators are positions, not sessions: after a leader change the call
        continues on the new leader, with no message skipped or repeated.
        """
        request = pb.NextRequest(iterator=iterator.to_pb(), batch_size=batch_size, stale_ok=stale_ok)
        response = self._on_shard(iterator.shard, "Next", request, self._deadline(timeout_s), stale_ok=stale_ok)
        from_pb = Message.from_pb
        return NextResult(
            [from_pb(m) for m in response.messages], Iterator.from_pb(response.iterator), response.end_of_stream
        )

    def _stream_messages(
        self, stream: Stream, topic_filter: str, start_time_us: int, batch_size: int, stale_ok: bool
    ) -> AbcIterator[Message]:
        iterator = self.make_iterator(stream, topic_filter, start_time_us, stale_ok=stale_ok)
        while True:
            result = self.next(iterator, batch_size, stale_ok=stale_ok)
            yield from result.messages
            iterator = result.iterator
            if result.end_of_stream or not result.messages:
                return

    def replay(
        self, topic_filter: str, start_time_us: int = 0, batch_size: int = 1000, *, stale_ok: bool = False
    ) -> AbcIterator[Message]:
        """Every stored message matching ``topic_filter``, in rank order.

        Shards come one after the other; within a shard, generations in order,
        and the streams of a generation merged by timestamp, so each sender's
        messages come back in the order they were stored. Messages stored
        while the replay runs may or may not be included.
        """
        by_rank: dict[Rank, list[Stream]] = {}
        for rank, stream in self.get_streams(topic_filter, start_time_us, stale_ok=stale_ok):
            by_rank.setdefault(rank, []).append(stream)
        key: Callable[[Message], int] = _timestamp
        for rank in sorted(by_rank):
            sources = [
                self._stream_messages(stream, topic_filter, start_time_us, batch_size, stale_ok)
                for stream in by_rank[rank]
            ]
            yield from heapq.merge(*sources, key=key) if len(sources) > 1 else sources[0]

    # -- generations ---------------------------------------------------------

    def add_generation(self, shard: int | None = None, timeout_s: float | None = None) -> list[Generation]:
        """Start a new generation in ``shard``, or in every shard; return the new ones."""
        deadline = self._deadline(timeout_s)
        shards = range(self._n_shards(deadline)) if shard is None else [shard]

        def rotate(group: list[int], address: str, remaining: float) -> list[Generation]:
            request = pb.AddGenerationRequest(shards=group)
            return [Generation.from_pb(g) for g in self._rpc(address, "AddGeneration", request, remaining).generations]

        found = [g for part in self._per_leader(shards, rotate, deadline) for g in part]
        return sorted(found, key=lambda g: g.shard)

    def list_generations(
        self, shard: int | None = None, *, stale_ok: bool = False, timeout_s: float | None = None
    ) -> list[Generation]:
        """The generations of ``shard``, or of every shard, in order."""
        deadline = self._deadline(timeout_s)
        shards = range(self._n_shards(deadline)) if shard is None else [shard]

        def fetch(group: list[int], address: str, remaining: float) -> list[Generation]:
            request = pb.ListGenerationsRequest(shards=group, stale_ok=stale_ok)
            return [
                Generation.from_pb(g) for g in self._rpc(address, "ListGenerations", request, remaining).generations
            ]

        found = [g for part in self._per_leader(shards, fetch, deadline, stale_ok) for g in part]
        return sorted(found, key=lambda g: (g.shard, g.generation))

    def drop_generation(self, shard: int, generation: int, timeout_s: float | None = None) -> Generation:
        """Drop a closed generation of a shard and free its disk; return it as it was."""
        request = pb.DropGenerationRequest(shard=shard, generation=generation)
        response = self._on_shard(shard, "DropGeneration", request, self._deadline(timeout_s), write=True)
        return Generation.from_pb(response.dropped)


class ShardFailures(MqdsError):
    """Raised inside a per-leader call: these shards failed, the call's other shards succeeded."""

    def __init__(self, failed: dict[int, MqdsError]) -> None:
        first = next(iter(failed.values()))
        super().__init__(first.reason, first.message, first.metadata)
        self.errors = failed


def _by_error(failed: dict[int, MqdsError]) -> dict[MqdsError, list[int]]:
    grouped: dict[MqdsError, list[int]] = {}
    for shard, err in failed.items():
        grouped.setdefault(err, []).append(shard)
    return grouped


def _timestamp(message: Message) -> int:
    return message.timestamp_us or 0
