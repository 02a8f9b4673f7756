"""The synchronous client's router: channels to every node, the cluster map, and calls that follow it.

A client may start before the cluster does (a broker started with its
nodes), or lose every node at once: while no node answers (connection
refused, unreachable, not part of a cluster yet) the map is asked for again
with the same backoff until the call's deadline; only then does the call
fail, with UNAVAILABLE naming the endpoints tried and the last cause.

The rules live in modules that do no I/O, shared with the asyncio router
(:mod:`mqds.client.aio.routing`): the map and how it is patched and
refreshed (:mod:`mqds.client.core.routing_table`: :class:`RoutingTable`,
:class:`MapRefresh`), the retry rules of waiting for a first map and of a
call to one shard (:mod:`mqds.client.core.retry`: :class:`Backoff`,
:class:`MapWait`, :class:`ShardRetry`), and those of a call to several
shards at once (:mod:`mqds.client.core.fanout`: :class:`Fanout`,
:class:`ShardFailures`). :class:`Router` only runs the requests and waits,
with threads; those names stay importable from here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any, TypeVar

import grpc

from mqds.client.core.fanout import Fanout, ShardFailures
from mqds.client.core.retry import Backoff, MapWait, ShardRetry
from mqds.client.core.routing_table import CREDENTIAL_CODES, MapLookups, MapRefresh, RoutingTable
from mqds.client.core.stubs import StubCache
from mqds.protocol.cluster_view import ClusterView
from mqds.protocol.errors import MqdsError
from mqds.v1 import cluster_pb2 as clpb

__all__ = [
    "CREDENTIAL_CODES",
    "Backoff",
    "ClusterView",
    "Fanout",
    "MapRefresh",
    "MapWait",
    "Router",
    "RoutingTable",
    "ShardFailures",
    "ShardRetry",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Router(StubCache, MapLookups):
    """Channels to every node, the cluster map, and calls that find the right node (blocking I/O, threads).

    ``settings`` give the channels' TLS, keepalive and size limits, and the
    metadata (auth token) every call carries; ``channel_options`` adds or
    overrides raw gRPC channel arguments.
    """

    def _open(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._refresh_lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="mqds-client")

    # -- channels --------------------------------------------------------------

    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self.settings.open_channel(address, self._credentials, self._options)
                self._channels[address] = channel
            return channel

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        with self._lock:
            self.forget_stubs()
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def submit(self, fn: Callable[..., T], *args: Any) -> futures.Future[T]:
        return self._pool.submit(fn, *args)

    # -- the map ---------------------------------------------------------------

    def refresh(self, timeout_s: float = 5.0, force: bool = False) -> ClusterView:
        """Ask every known node for its map and merge them, once; one refresh shared by concurrent callers.

        Raises UNAVAILABLE when no node answered (see :meth:`wait_for_map`
        for asking until a deadline).
        """
        started = time.monotonic()
        if not self._refresh_lock.acquire(timeout=timeout_s + 1):
            raise self.table.refresh_busy()
        try:
            if (refresh := MapRefresh.begin(self.table, started, force)) is None:
                return self.table.view
            # The answers may name nodes not known before (a seed list of
            # one node): ask those too.
            while addresses := refresh.next_addresses():
                jobs = {self.submit(self._fetch_map, a, timeout_s): a for a in addresses}
                # gRPC's deadline ends each fetch; the wait is bounded anyway.
                finished, _ = futures.wait(jobs, timeout=timeout_s + 1)
                refresh.answers({a: job.result() if job in finished else None for job, a in jobs.items()})
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

    def fanout(
        self,
        shards: Iterable[int],
        call: Callable[[list[int], str, float], T],
        deadline: float,
        stale_ok: bool = False,
    ) -> tuple[list[T], dict[int, MqdsError]]:
        """Run ``call(shards, address, timeout_s)`` once per node leading some of ``shards``, in parallel.

        Returns what succeeded and each failed shard's final error (see
        :class:`Fanout` for what is retried). ``call`` may raise
        :class:`ShardFailures` to fail some of its shards while the others
        succeeded (their results it records itself).
        """
        fan = Fanout(self.table, shards, deadline, self.backoff, stale_ok=stale_ok)
        results: list[T] = []
        while (step := fan.next_round()) is not None:
            groups, remaining = step
            if len(groups) == 1:
                # One node to ask (a single-shard call, most of them): in this
                # thread, not through the pool (a thread hand-off each way).
                ((address, group),) = groups.items()
                try:
                    results.append(call(group, address, remaining))
                except MqdsError as err:
                    fan.failed(group, err)
            else:
                jobs = {self.submit(call, group, address, remaining): group for address, group in groups.items()}
                for job in futures.as_completed(jobs):
                    try:
                        results.append(job.result())
                    except MqdsError as err:
                        fan.failed(jobs[job], err)
            if fan.end_round():
                if fan.refresh_map:
                    self.refresh_quietly(remaining)
                delay = fan.backoff_s()
                if delay is not None:
                    time.sleep(delay)
        return results, fan.failures
