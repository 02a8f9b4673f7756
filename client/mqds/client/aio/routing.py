"""The asyncio client's router: ``grpc.aio`` channels to every node, the cluster map, and calls that follow it.

The asyncio counterpart of :class:`mqds.client.sync.routing.Router`: the same
:class:`~mqds.client.core.routing_table.RoutingTable` and the same retry rules
(:mod:`mqds.client.core.retry`, :mod:`mqds.client.core.fanout`), decided by the same
code; only the waiting differs (tasks, ``asyncio.sleep``, an
``asyncio.Lock`` around the shared map refresh). A router belongs to the
event loop it is first used in: its channels are opened there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import grpc

from mqds.client.core.fanout import Fanout
from mqds.client.core.retry import MapWait, ShardRetry
from mqds.client.core.routing_table import CREDENTIAL_CODES, MapLookups, MapRefresh
from mqds.client.core.stubs import StubCache
from mqds.protocol.cluster_view import ClusterView
from mqds.protocol.errors import MqdsError
from mqds.v1 import cluster_pb2 as clpb

__all__ = ["AsyncRouter"]

# The logger of the asyncio client as a whole, as before the router had a module of its own.
log = logging.getLogger("mqds.client.aio")

T = TypeVar("T")


class AsyncRouter(StubCache, MapLookups):
    """Channels (``grpc.aio``) to every node, the cluster map, and calls that find the right node.

    The asyncio counterpart of :class:`mqds.client.sync.routing.Router`, with the
    same :class:`~mqds.client.sync.routing.RoutingTable` and retry rules, and
    the same arguments (``channel_options`` adds or overrides raw gRPC
    channel arguments).
    """

    def _open(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._refresh_lock = asyncio.Lock()

    # -- channels --------------------------------------------------------------

    def channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self.settings.open_aio_channel(address, self._credentials, self._options)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        self.forget_stubs()
        channels = list(self._channels.values())
        self._channels.clear()
        for channel in channels:
            await channel.close()

    # -- the map ---------------------------------------------------------------

    async def refresh(self, timeout_s: float = 5.0, force: bool = False) -> ClusterView:
        """Ask every known node for its map and merge them, once; one refresh shared by concurrent callers.

        Raises UNAVAILABLE when no node answered (see :meth:`wait_for_map`
        for asking until a deadline).
        """
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s + 1):
                await self._refresh_lock.acquire()
        except TimeoutError:
            raise self.table.refresh_busy() from None
        try:
            if (refresh := MapRefresh.begin(self.table, started, force)) is None:
                return self.table.view
            while addresses := refresh.next_addresses():
                tasks = {asyncio.ensure_future(self._fetch_map(a, timeout_s)): a for a in addresses}
                try:
                    # gRPC's deadline ends each fetch; the wait is bounded anyway.
                    finished, _ = await asyncio.wait(tasks, timeout=timeout_s + 1)
                finally:
                    late = [task for task in tasks if not task.done()]
                    for task in late:
                        task.cancel()
                    await asyncio.gather(*late, return_exceptions=True)
                refresh.answers({a: task.result() if task in finished else None for task, a in tasks.items()})
            return refresh.finish()
        finally:
            self._refresh_lock.release()

    async def wait_for_map(self, deadline: float, *, force: bool = False) -> ClusterView:
        """Refresh the map, again and again with backoff while no node answers, until ``deadline``.

        The first call of a client started before its cluster waits here;
        each refresh is shared with concurrent callers (see
        :class:`~mqds.client.sync.routing.MapWait`).
        """
        wait = MapWait(deadline, self.backoff)
        while True:
            try:
                return await self.refresh(wait.timeout_s(), force=force)
            except MqdsError as err:
                await asyncio.sleep(wait.failed(err))
            if self.table.can_share_refresh(wait.started, force):
                return self.table.view  # another caller's refresh got it while this one paused

    async def _fetch_map(self, address: str, timeout_s: float) -> tuple[clpb.ClusterMap | None, str]:
        try:
            cmap = await self.cluster(address).GetClusterMap(
                clpb.GetClusterMapRequest(), timeout=timeout_s, metadata=self.metadata
            )
            return cmap, ""
        except grpc.RpcError as err:
            if err.code() in CREDENTIAL_CODES:
                # Every node checks the same tokens: asking others cannot help.
                raise self.settings.call_error(err) from None
            log.debug("cluster map from %s failed: %s", address, err.code())
            return None, self.settings.describe_failure(err)

    async def ensure_map(self, timeout_s: float) -> ClusterView:
        """The map, waiting up to ``timeout_s`` for a first one (:meth:`wait_for_map`)."""
        if self.table.view.version < 0:
            await self.wait_for_map(time.monotonic() + timeout_s)
        return self.table.view

    async def refresh_quietly(self, remaining: float) -> None:
        try:
            await self.refresh(min(2.0, max(remaining, 0.1)), force=True)
        except MqdsError as err:
            log.debug("map refresh failed: %s", err)

    # -- calls -------------------------------------------------------------------

    async def call(
        self,
        shard: int | None,
        attempt: Callable[[str, float], Awaitable[T]],
        deadline: float,
        *,
        any_replica: bool = False,
        retry_unavailable: bool = True,
    ) -> T:
        """Await ``attempt(address, timeout_s)`` against the shard's leader until it works or the deadline passes."""
        retry = ShardRetry(
            self.table, shard, deadline, self.backoff, any_replica=any_replica, retry_unavailable=retry_unavailable
        )
        while True:
            address, remaining = retry.next_attempt()
            try:
                return await attempt(address, remaining)
            except MqdsError as err:
                if not retry.failed(err):
                    continue
                if retry.refresh_map:
                    await self.refresh_quietly(remaining)
                await asyncio.sleep(retry.backoff_s(err))

    async def fanout(
        self,
        shards: Iterable[int],
        call: Callable[[list[int], str, float], Awaitable[T]],
        deadline: float,
        stale_ok: bool = False,
    ) -> tuple[list[T], dict[int, MqdsError]]:
        """Await ``call(shards, address, timeout_s)`` once per node leading some of ``shards``, concurrently.

        Returns what succeeded and each failed shard's final error (see
        :class:`~mqds.client.sync.routing.Fanout` for what is retried).
        """
        fan = Fanout(self.table, shards, deadline, self.backoff, stale_ok=stale_ok)
        results: list[T] = []
        while (step := fan.next_round()) is not None:
            groups, remaining = step
            answers = await asyncio.gather(
                *(call(group, address, remaining) for address, group in groups.items()), return_exceptions=True
            )
            for group, answer in zip(groups.values(), answers, strict=True):
                if isinstance(answer, MqdsError):
                    fan.failed(group, answer)
                elif isinstance(answer, BaseException):
                    raise answer
                else:
                    results.append(answer)
            if fan.end_round():
                if fan.refresh_map:
                    await self.refresh_quietly(remaining)
                delay = fan.backoff_s()
                if delay is not None:
                    await asyncio.sleep(delay)
        return results, fan.failures
