"""The client's view of the cluster: nodes, vnode placement and leaders, and calls that follow them.

The map is learned from any node (``Cluster.GetClusterMap``) and kept fresh
three ways: a NOT_LEADER error names the leader, which patches the map at
once; a node that cannot be reached, or a shard without a leader, triggers a
refresh from every known node; and concurrent callers that need a refresh
share one (the first does it, the others wait for its result, success or
failure).

A client may start before the cluster does (a broker started with its
nodes), or lose every node at once: while no node answers (connection
refused, unreachable, not part of a cluster yet) the map is asked for again
with the same backoff until the call's deadline (:class:`MapWait`); only then
does the call fail, with UNAVAILABLE naming the endpoints tried and the last
cause.

Everything here except :class:`Router` does no I/O, and is shared by the
synchronous client and the asyncio one (:mod:`mqds.client.aio`): the map and
how it is patched (:class:`RoutingTable`), one refresh of it
(:class:`MapRefresh`), waiting for a first map (:class:`MapWait`), and the
retry rules of a call to one shard (:class:`ShardRetry`) or to several at once (:class:`Fanout`): what to retry
(NOT_LEADER, NO_LEADER, an unreachable node), when to refresh the map, and
the exponential backoff with jitter until the caller's deadline. Each client
only runs the requests and waits: :class:`Router` with threads, the asyncio
router with tasks.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from mqds.client.connection import ConnectionSettings
from mqds.protocol import errors
from mqds.protocol.cluster_view import ClusterView
from mqds.protocol.errors import MqdsError, Reason
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc
from mqds.v1 import sessions_pb2_grpc as spb_grpc
from mqds.v1 import storage_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

# Refresh at most this often when nothing is wrong (a NOT_LEADER hint or a
# failure always allows one).
_MIN_REFRESH_INTERVAL_S = 0.1

# While waiting for a first map, a refresh is not started with less time than this.
_MIN_MAP_WAIT_TRY_S = 0.1

# Errors after which the node asked may be down: try another replica, refresh.
CREDENTIAL_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
_UNREACHABLE = (Reason.UNAVAILABLE, Reason.SHUTTING_DOWN, Reason.DEADLINE_EXCEEDED)
_REDIRECTS = (Reason.NOT_LEADER, Reason.NOT_HOSTED)


@dataclass
class Backoff:
    """Exponential backoff with full jitter, in seconds."""

    initial_s: float = 0.05
    max_s: float = 1.0
    multiplier: float = 2.0

    def delays(self) -> Iterator[float]:
        delay = self.initial_s
        while True:
            yield random.uniform(0, delay)
            delay = min(delay * self.multiplier, self.max_s)


class RoutingTable:
    """The seeds and the cluster view, patched from errors and refreshes; safe to share between threads."""

    def __init__(self, seeds: Sequence[str]) -> None:
        self.seeds = list(seeds)
        self.view = ClusterView()
        self.refreshed_at = 0.0
        # The last refresh that no node answered, and when it ended.
        self.last_failure: MqdsError | None = None
        self.failed_at = 0.0
        self._lock = threading.Lock()

    def known_addresses(self) -> list[str]:
        with self._lock:
            return sorted(set(self.seeds) | set(self.view.addresses.values()))

    def leader_of(self, shard: int) -> str | None:
        """The address of the shard's leader (or, without a known leader, its first replica)."""
        with self._lock:
            view = self.view
            leader = view.leaders.get(shard)
            node = leader[1] if leader else next(iter(view.replicas.get(shard, [])), None)
            return view.addresses.get(node) if node else None

    def replica_addresses(self, shard: int) -> list[str]:
        with self._lock:
            return [self.view.addresses[n] for n in self.view.replicas.get(shard, []) if n in self.view.addresses]

    def address_for(self, shard: int | None, *, any_replica: bool = False, attempt: int = 0) -> str:
        """Where to send a request for ``shard``: its leader, or (``any_replica``) its replicas in turn."""
        if shard is None:
            return self.known_addresses()[0]
        if any_replica:
            candidates = self.replica_addresses(shard) or self.known_addresses()
            return candidates[attempt % len(candidates)]
        return self.leader_of(shard) or self.known_addresses()[0]

    def learn(self, err: MqdsError, shard: int | None) -> bool:
        """Patch the map from a NOT_LEADER hint; True when it named a leader."""
        leader = err.metadata.get("leader")
        if not leader or shard is None:
            return False
        address = err.metadata.get("leader_address")
        with self._lock:
            if address:
                self.view.addresses[leader] = address
            term = self.view.leaders.get(shard, (0, ""))[0]
            self.view.leaders[shard] = (term, leader)
        return True

    def forget_leader(self, shard: int) -> None:
        with self._lock:
            self.view.leaders.pop(shard, None)

    def merge(self, maps: Iterable[clpb.ClusterMap]) -> None:
        with self._lock:
            for cmap in maps:
                self.view.merge(cmap)

    def cluster_map(self) -> clpb.ClusterMap:
        with self._lock:
            return self.view.to_pb()

    def can_share_refresh(self, started: float, force: bool) -> bool:
        """Whether a caller that wanted a refresh at ``started`` can use the map as it is now.

        True when a refresh finished after ``started`` (someone refreshed
        while this caller waited its turn) or, unless ``force``, a moment
        before it.
        """
        if self.view.version < 0:
            return False
        if self.refreshed_at >= started:
            return True
        return not force and self.refreshed_at >= started - _MIN_REFRESH_INTERVAL_S

    def shared_failure(self, started: float) -> MqdsError | None:
        """The failure of a refresh that ended after ``started`` (while this caller waited its turn), if any.

        A caller queued behind a refresh that no node answered gets that
        answer instead of asking the same nodes again at once.
        """
        if self.last_failure is not None and self.failed_at >= started and self.failed_at > self.refreshed_at:
            return self.last_failure
        return None

    def refresh_busy(self) -> MqdsError:
        """The error of a caller that could not start a refresh in time: another one held it that long."""
        last = f" (last: {self.last_failure.message})" if self.last_failure is not None else ""
        return errors.error(
            Reason.UNAVAILABLE,
            f"no mqds node answered at {', '.join(self.known_addresses())} in time: "
            f"another call's refresh of the cluster map was still waiting for them{last}",
        )


class MapRefresh:
    """One refresh: ask every known node for its map, then the nodes those maps name, and merge the answers.

    >>> table = RoutingTable(["a:1"])
    >>> refresh = MapRefresh(table)
    >>> refresh.next_addresses()
    ['a:1']
    >>> refresh.answer("a:1", None, "connection refused")
    >>> refresh.next_addresses()
    []
    >>> refresh.finish()
    Traceback (most recent call last):
    mqds.protocol.errors.UnavailableError: UNAVAILABLE: no mqds node answered at a:1 (a:1: connection refused)
    """

    def __init__(self, table: RoutingTable) -> None:
        self.table = table
        self._asked: set[str] = set()
        self._answered = 0
        self._failures: dict[str, str] = {}

    def next_addresses(self) -> list[str]:
        """The nodes to ask next (all at once); empty when every known node was asked."""
        addresses = [a for a in self.table.known_addresses() if a not in self._asked]
        self._asked.update(addresses)
        return addresses

    def answer(self, address: str, cmap: clpb.ClusterMap | None, failure: str = "") -> None:
        """What ``address`` answered: its map, or None and why not (a map without shards counts as none)."""
        if cmap is not None and cmap.n_shards <= 0:
            cmap, failure = None, "it has no cluster map yet"
        if cmap is None:
            self._failures[address] = failure
            return
        self._answered += 1
        self.table.merge([cmap])

    def finish(self) -> ClusterView:
        """The refreshed view; UNAVAILABLE, with each node's failure, when no node answered."""
        if not self._answered:
            why = "; ".join(f"{a}: {f}" for a, f in sorted(self._failures.items()) if f)
            failure = errors.error(
                Reason.UNAVAILABLE,
                f"no mqds node answered at {', '.join(sorted(self._asked))}" + (f" ({why})" if why else ""),
            )
            self.table.last_failure, self.table.failed_at = failure, time.monotonic()
            raise failure
        self.table.refreshed_at = time.monotonic()
        return self.table.view


class MapWait:
    """The retry rules of getting the cluster map while no node answers; the caller does the I/O.

    A refresh that no node answered (every one refused the connection, was
    unreachable, or is not part of a cluster yet) is tried again after the
    backoff, until ``deadline``: a client started before its cluster waits
    for it. ``timeout_s`` gives the next refresh's time (or raises the final
    error once the deadline has passed); after a failed refresh, ``failed``
    gives the pause, or raises: at once for an error retrying cannot help
    (a refused credential), else the final error when the deadline would
    pass first. The final error is UNAVAILABLE, naming the endpoints tried
    and the last cause, and how long it waited.

    >>> wait = MapWait(time.monotonic() + 60, Backoff(initial_s=0.01))
    >>> refused = errors.error(Reason.UNAVAILABLE, "no mqds node answered at a:1 (a:1: connection refused)")
    >>> 0 <= wait.failed(refused) <= 0.01
    True
    >>> MapWait(time.monotonic(), Backoff()).failed(refused)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    mqds.protocol.errors.UnavailableError: UNAVAILABLE: no mqds node ... refused); still none after 1 attempt in 0.0 s
    """

    def __init__(self, deadline: float, backoff: Backoff) -> None:
        self.deadline = deadline
        self.started = time.monotonic()
        self.attempts = 0
        self.last: MqdsError | None = None
        self._delays = backoff.delays()

    def timeout_s(self) -> float:
        """The time the next refresh may take; raises the final error when the deadline has passed."""
        remaining = self.deadline - time.monotonic()
        if self.attempts == 0:
            return max(remaining, _MIN_MAP_WAIT_TRY_S)  # one try, however short the deadline
        if remaining <= 0:
            raise self.final()
        return remaining

    def failed(self, err: MqdsError) -> float:
        """A refresh failed with ``err``: the pause before the next one, or raises."""
        self.attempts += 1
        if not err.retriable:
            raise err
        self.last = err
        delay = next(self._delays)
        remaining = self.deadline - time.monotonic()
        if remaining < _MIN_MAP_WAIT_TRY_S:
            raise self.final()
        # Leave the last refresh time enough to tell why it failed.
        return min(delay, remaining - _MIN_MAP_WAIT_TRY_S)

    def final(self) -> MqdsError:
        """The error that ends the wait: the last refresh's, with how long it waited."""
        elapsed = time.monotonic() - self.started
        tries = f"{self.attempts} attempt" + ("s" if self.attempts != 1 else "")
        last = self.last or errors.error(Reason.UNAVAILABLE, "no mqds node answered")
        return errors.error(last.reason, f"{last.message}; still none after {tries} in {elapsed:.1f} s")


class ShardRetry:
    """The retry rules of one call to a shard's leader (or any replica); the caller does the I/O.

    ``next_attempt`` says where to send and how long is left; after a
    failure, ``failed`` raises the error when retrying cannot help and
    otherwise says whether to back off before the next attempt (False when a
    NOT_LEADER hint already named the leader), and ``refresh_map`` whether
    the map must be refreshed first (not for OVERLOADED: the node is busy,
    not gone, and stays the leader); then ``backoff_s`` gives the pause, or
    raises the error when the deadline would pass first.
    ``retry_unavailable=False`` gives up on an unreachable node (for writes
    whose first attempt may have been applied).
    """

    def __init__(
        self,
        table: RoutingTable,
        shard: int | None,
        deadline: float,
        backoff: Backoff,
        *,
        any_replica: bool = False,
        retry_unavailable: bool = True,
    ) -> None:
        self.table = table
        self.shard = shard
        self.deadline = deadline
        self.any_replica = any_replica
        self.retry_unavailable = retry_unavailable
        self._delays = backoff.delays()
        self._tried_replicas = 0
        self.refresh_map = True
        """After a failure that backs off: whether to refresh the cluster map first."""

    def next_attempt(self) -> tuple[str, float]:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise errors.error(Reason.DEADLINE_EXCEEDED, "the call did not succeed before its deadline")
        address = self.table.address_for(self.shard, any_replica=self.any_replica, attempt=self._tried_replicas)
        return address, remaining

    def failed(self, err: MqdsError) -> bool:
        if not err.retriable:
            raise err
        self.refresh_map = err.reason is not Reason.OVERLOADED
        if err.reason is Reason.OVERLOADED:
            pass  # the same node, after a pause: forgetting it made a busy cluster refresh its map again and again
        elif err.reason in _UNREACHABLE:
            if not self.retry_unavailable:
                raise err
            self._tried_replicas += 1
            if self.shard is not None:
                self.table.forget_leader(self.shard)
        elif err.reason is Reason.REPLICA_BEHIND:
            self._tried_replicas += 1  # the next replica may have applied further
        elif err.reason in _REDIRECTS:
            if self.table.learn(err, self.shard):
                return False
        elif self.shard is not None:  # NO_LEADER, OVERLOADED, ...
            self.table.forget_leader(self.shard)
        return True

    def backoff_s(self, err: MqdsError) -> float:
        delay = next(self._delays)
        if time.monotonic() + delay >= self.deadline:
            raise err
        return delay


class ShardFailures(MqdsError):
    """Raised inside a per-leader call: these shards failed, the call's other shards succeeded."""

    def __init__(self, failed: dict[int, MqdsError]) -> None:
        first = next(iter(failed.values()))
        super().__init__(first.reason, first.message, first.metadata)
        self.errors = failed


class Fanout:
    """The retry rules of a call that touches several shards; the caller does the I/O.

    Each round sends one request per node that leads some of the pending
    shards (or, with ``stale_ok``, hosts them), in parallel: ``next_round``
    gives the groups and the time left, ``failed`` records a group's (or,
    through :class:`ShardFailures`, some shards') failure, and ``end_round``
    decides what is retried: shards that failed retriably are regrouped by
    their (new) leaders; without a leader hint the map is refreshed and the
    caller backs off (``backoff_s``) first. Shards that cannot succeed end in
    ``failures`` with their final error (DEADLINE_EXCEEDED, or the last
    retriable error, once the deadline passes).
    """

    def __init__(
        self, table: RoutingTable, shards: Iterable[int], deadline: float, backoff: Backoff, *, stale_ok: bool = False
    ) -> None:
        self.table = table
        self.deadline = deadline
        self.stale_ok = stale_ok
        self.pending = sorted(set(shards))
        self.failures: dict[int, MqdsError] = {}
        self._delays = backoff.delays()
        self._failed: dict[int, MqdsError] = {}
        self.refresh_map = False
        """After a round that backs off: whether to refresh the cluster map first (not when all were OVERLOADED)."""

    def next_round(self) -> tuple[dict[str, list[int]], float] | None:
        """The next round's requests (address -> shards) and the time left; None when nothing is left to try."""
        if not self.pending:
            return None
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            timeout = errors.error(Reason.DEADLINE_EXCEEDED, "the call did not succeed before its deadline")
            self.failures.update((shard, timeout) for shard in self.pending)
            self.pending = []
            return None
        groups: dict[str, list[int]] = {}
        for shard in self.pending:
            if self.stale_ok:
                address = (self.table.replica_addresses(shard) or self.table.known_addresses())[0]
            else:
                address = self.table.leader_of(shard) or self.table.known_addresses()[0]
            groups.setdefault(address, []).append(shard)
        self._failed = {}
        return groups, remaining

    def failed(self, group: Sequence[int], err: MqdsError) -> None:
        """A request of this round failed: for all of ``group``, or for the shards a ShardFailures names."""
        if isinstance(err, ShardFailures):
            self._failed.update(err.errors)
        else:
            self._failed.update((shard, err) for shard in group)

    def end_round(self) -> bool:
        """Settle the round's failures; True when the caller must back off before the next.

        ``refresh_map`` then says whether to refresh the map first: not when
        the only trouble was OVERLOADED (busy nodes keep their leaderships).
        """
        retry: list[int] = []
        hinted = True
        busy = False
        for problem, shards in _by_error(self._failed).items():
            if not problem.retriable:
                self.failures.update((shard, problem) for shard in shards)
                continue
            retry.extend(shards)
            if problem.reason is Reason.OVERLOADED:
                busy = True
                continue
            shard_hint = problem.metadata.get("shard")
            if shard_hint is not None and self.table.learn(problem, int(shard_hint)):
                continue
            # No usable hint: forget the leaders, refresh the map and back off.
            for shard in shards:
                self.table.forget_leader(shard)
            hinted = False
        self.pending = sorted(retry)
        self.refresh_map = not hinted
        return bool(self.pending) and (busy or not hinted)

    def backoff_s(self) -> float | None:
        """The pause before the next round; None (the pending shards failed) when the deadline would pass."""
        delay = next(self._delays)
        if time.monotonic() + delay >= self.deadline:
            self.failures.update((shard, self._failed[shard]) for shard in self.pending)
            self.pending = []
            return None
        return delay


def _by_error(failed: dict[int, MqdsError]) -> dict[MqdsError, list[int]]:
    grouped: dict[MqdsError, list[int]] = {}
    for shard, err in failed.items():
        grouped.setdefault(err, []).append(shard)
    return grouped


class Router:
    """Channels to every node, the cluster map, and calls that find the right node (blocking I/O, threads).

    ``settings`` give the channels' TLS, keepalive and size limits, and the
    metadata (auth token) every call carries; ``channel_options`` adds or
    overrides raw gRPC channel arguments.
    """

    def __init__(
        self,
        seeds: Sequence[str],
        *,
        settings: ConnectionSettings | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        backoff: Backoff | None = None,
    ) -> None:
        self.settings = settings or ConnectionSettings()
        self.table = RoutingTable(seeds)
        self.backoff = backoff or Backoff()
        self.metadata = list(self.settings.call_metadata())
        # Read the PEM files now: a missing or bad one fails the constructor.
        self._credentials = self.settings.channel_credentials()
        self._options = list({**dict(self.settings.channel_options()), **dict(channel_options)}.items())
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._refresh_lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="mqds-client")

    @property
    def seeds(self) -> list[str]:
        return self.table.seeds

    @property
    def view(self) -> ClusterView:
        return self.table.view

    # -- channels --------------------------------------------------------------

    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self.settings.open_channel(address, self._credentials, self._options)
                self._channels[address] = channel
            return channel

    def storage(self, address: str) -> pb_grpc.StorageStub:
        return pb_grpc.StorageStub(self.channel(address))

    def sessions(self, address: str) -> spb_grpc.SessionsStub:
        return spb_grpc.SessionsStub(self.channel(address))

    def cluster(self, address: str) -> clpb_grpc.ClusterStub:
        return clpb_grpc.ClusterStub(self.channel(address))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def submit(self, fn: Callable[..., T], *args: Any) -> futures.Future[T]:
        return self._pool.submit(fn, *args)

    # -- the map ---------------------------------------------------------------

    def known_addresses(self) -> list[str]:
        return self.table.known_addresses()

    def leader_of(self, shard: int) -> str | None:
        return self.table.leader_of(shard)

    def replica_addresses(self, shard: int) -> list[str]:
        return self.table.replica_addresses(shard)

    def learn(self, err: MqdsError, shard: int | None) -> bool:
        """Patch the map from a NOT_LEADER hint; True when it named a leader."""
        return self.table.learn(err, shard)

    def forget_leader(self, shard: int) -> None:
        self.table.forget_leader(shard)

    def refresh(self, timeout_s: float = 5.0, force: bool = False) -> ClusterView:
        """Ask every known node for its map and merge them, once; one refresh shared by concurrent callers.

        Raises UNAVAILABLE when no node answered (see :meth:`wait_for_map`
        for asking until a deadline).
        """
        started = time.monotonic()
        if not self._refresh_lock.acquire(timeout=timeout_s + 1):
            raise self.table.refresh_busy()
        try:
            if self.table.can_share_refresh(started, force):
                return self.table.view
            if (failure := self.table.shared_failure(started)) is not None:
                raise failure
            refresh = MapRefresh(self.table)
            # The answers may name nodes not known before (a seed list of
            # one node): ask those too.
            while addresses := refresh.next_addresses():
                jobs = {self.submit(self._fetch_map, a, timeout_s): a for a in addresses}
                # gRPC's deadline ends each fetch; the wait is bounded anyway.
                finished, _ = futures.wait(jobs, timeout=timeout_s + 1)
                for job, address in jobs.items():
                    if job in finished:
                        refresh.answer(address, *job.result())
                    else:
                        refresh.answer(address, None, "no answer in time")
            return refresh.finish()
        finally:
            self._refresh_lock.release()

    def wait_for_map(self, deadline: float, *, force: bool = False) -> ClusterView:
        """Refresh the map, again and again with backoff while no node answers, until ``deadline``.

        The first call of a client started before its cluster waits here;
        each refresh is shared with concurrent callers (see :class:`MapWait`).
        """
        wait = MapWait(deadline, self.backoff)
        while True:
            try:
                return self.refresh(wait.timeout_s(), force=force)
            except MqdsError as err:
                time.sleep(wait.failed(err))
            if self.table.can_share_refresh(wait.started, force):
                return self.table.view  # another caller's refresh got it while this one paused

    def _fetch_map(self, address: str, timeout_s: float) -> tuple[clpb.ClusterMap | None, str]:
        try:
            return self.cluster(address).GetClusterMap(
                clpb.GetClusterMapRequest(), timeout=timeout_s, metadata=self.metadata
            ), ""
        except grpc.RpcError as err:
            if err.code() in CREDENTIAL_CODES:
                # Every node checks the same tokens: asking others cannot help.
                raise self.settings.call_error(err) from None
            log.debug("cluster map from %s failed: %s", address, err.code())
            return None, self.settings.describe_failure(err)

    def ensure_map(self, timeout_s: float) -> ClusterView:
        """The map, waiting up to ``timeout_s`` for a first one (:meth:`wait_for_map`)."""
        if self.table.view.version < 0:
            self.wait_for_map(time.monotonic() + timeout_s)
        return self.table.view

    def refresh_quietly(self, remaining: float) -> None:
        try:
            self.refresh(min(2.0, max(remaining, 0.1)), force=True)
        except MqdsError as err:
            log.debug("map refresh failed: %s", err)

    # -- calls -------------------------------------------------------------------

    def call(
        self,
        shard: int | None,
        attempt: Callable[[str, float], T],
        deadline: float,
        *,
        any_replica: bool = False,
        retry_unavailable: bool = True,
    ) -> T:
        """Run ``attempt(address, timeout_s)`` against the shard's leader until it works or the deadline passes.

        ``attempt`` raises MqdsError; retriable ones are retried (with the
        map patched or refreshed first, see :class:`ShardRetry`), others go
        to the caller.
        """
        retry = ShardRetry(
            self.table, shard, deadline, self.backoff, any_replica=any_replica, retry_unavailable=retry_unavailable
        )
        while True:
            address, remaining = retry.next_attempt()
            try:
                return attempt(address, remaining)
            except MqdsError as err:
                if not retry.failed(err):
                    continue
                if retry.refresh_map:
                    self.refresh_quietly(remaining)
                time.sleep(retry.backoff_s(err))
