"""The client's view of the cluster: nodes, vnode placement and leaders, and calls that follow them.

The map is learned from any node (``Cluster.GetClusterMap``) and kept fresh
three ways: a NOT_LEADER error names the leader, which patches the map at
once; a node that cannot be reached, or a shard without a leader, triggers a
refresh from every known node; and concurrent callers that need a refresh
share one (the first does it, the others wait for its result).

:meth:`Router.call` runs one request against a shard's leader (or any
replica) and retries what is worth retrying (NOT_LEADER, NO_LEADER, an
unreachable node) with exponential backoff and jitter until the caller's
deadline.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc
from mqds.v1 import storage_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

# Refresh at most this often when nothing is wrong (a NOT_LEADER hint or a
# failure always allows one).
_MIN_REFRESH_INTERVAL_S = 0.1


@dataclass
class Backoff:
    """Exponential backoff with full jitter, in seconds."""

    initial_s: float = 0.05
    max_s: float = 1.0
    multiplier: float = 2.0

    def delays(self) -> Any:
        delay = self.initial_s
        while True:
            yield random.uniform(0, delay)
            delay = min(delay * self.multiplier, self.max_s)


@dataclass
class ClusterView:
    """What the client knows: addresses, placement, and leaders with the term they were seen in."""

    n_shards: int = 0
    addresses: dict[str, str] = field(default_factory=dict)
    replicas: dict[int, list[str]] = field(default_factory=dict)
    leaders: dict[int, tuple[int, str]] = field(default_factory=dict)
    version: int = -1
    cluster_id: str = ""
    meta_leader: str = ""

    def merge(self, cmap: clpb.ClusterMap) -> None:
        if cmap.version >= self.version:
            self.version = cmap.version
            self.n_shards = cmap.n_shards
            self.cluster_id = cmap.cluster_id
            self.addresses.update({n.id: n.address for n in cmap.nodes})
            self.replicas = {v.shard: list(v.replicas) for v in cmap.vnodes}
        if cmap.meta_leader:
            self.meta_leader = cmap.meta_leader
        for v in cmap.vnodes:
            if v.leader and v.term >= self.leaders.get(v.shard, (-1, ""))[0]:
                self.leaders[v.shard] = (v.term, v.leader)


class Router:
    """Channels to every node, the cluster map, and calls that find the right node."""

    def __init__(
        self,
        seeds: Sequence[str],
        *,
        channel_options: list[tuple[str, Any]],
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        backoff: Backoff | None = None,
    ) -> None:
        self.seeds = list(seeds)
        self._options = channel_options
        self._credentials = credentials
        self.metadata = list(metadata)
        self.backoff = backoff or Backoff()
        self.view = ClusterView()
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._refresh_lock = threading.Lock()
        self._refreshed_at = 0.0
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="mqds-client")

    # -- channels --------------------------------------------------------------

    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                if self._credentials is not None:
                    channel = grpc.secure_channel(address, self._credentials, options=self._options)
                else:
                    channel = grpc.insecure_channel(address, options=self._options)
                self._channels[address] = channel
            return channel

    def storage(self, address: str) -> pb_grpc.StorageStub:
        return pb_grpc.StorageStub(self.channel(address))

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
        with self._lock:
            return sorted(set(self.seeds) | set(self.view.addresses.values()))

    def refresh(self, timeout_s: float = 5.0, force: bool = False) -> ClusterView:
        """Ask every known node for its map and merge them; one refresh shared by concurrent callers."""
        started = time.monotonic()
        with self._refresh_lock:
            if self.view.version >= 0:
                # Someone refreshed while we waited for the lock, or (unless
                # forced) a moment ago: share their result.
                if self._refreshed_at >= started:
                    return self.view
                if not force and self._refreshed_at >= started - _MIN_REFRESH_INTERVAL_S:
                    return self.view
            asked: set[str] = set()
            answered = 0
            # Ask every node known; the answers may name nodes not known
            # before (a seed list of one node), so ask those too.
            while True:
                addresses = [a for a in self.known_addresses() if a not in asked]
                if not addresses:
                    break
                asked.update(addresses)
                pending = {self.submit(self._fetch_map, a, timeout_s): a for a in addresses}
                maps = []
                for done in futures.as_completed(pending, timeout=timeout_s + 1):
                    cmap = done.result()
                    if cmap is not None:
                        maps.append(cmap)
                answered += len(maps)
                with self._lock:
                    for cmap in maps:
                        self.view.merge(cmap)
            if not answered:
                raise errors.error(
                    Reason.UNAVAILABLE, f"no mqds node answered at {', '.join(sorted(asked))}; is the cluster running?"
                )
            self._refreshed_at = time.monotonic()
            return self.view

    def _fetch_map(self, address: str, timeout_s: float) -> clpb.ClusterMap | None:
        try:
            return self.cluster(address).GetClusterMap(
                clpb.GetClusterMapRequest(), timeout=timeout_s, metadata=self.metadata
            )
        except grpc.RpcError as err:
            log.debug("cluster map from %s failed: %s", address, err.code())
            return None

    def ensure_map(self, timeout_s: float) -> ClusterView:
        if self.view.version < 0:
            self.refresh(timeout_s)
        return self.view

    def leader_of(self, shard: int) -> str | None:
        with self._lock:
            view = self.view
            leader = view.leaders.get(shard)
            node = leader[1] if leader else next(iter(view.replicas.get(shard, [])), None)
            return view.addresses.get(node) if node else None

    def replica_addresses(self, shard: int) -> list[str]:
        with self._lock:
            return [self.view.addresses[n] for n in self.view.replicas.get(shard, []) if n in self.view.addresses]

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
        map patched or refreshed first), others go to the caller.
        ``retry_unavailable=False`` gives up on an unreachable node (for
        writes whose first attempt may have been applied).
        """
        delays = self.backoff.delays()
        tried_replicas = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.error(Reason.DEADLINE_EXCEEDED, "the call did not succeed before its deadline")
            if shard is None:
                address = self.known_addresses()[0]
            elif any_replica:
                candidates = self.replica_addresses(shard) or self.known_addresses()
                address = candidates[tried_replicas % len(candidates)]
            else:
                address = self.leader_of(shard) or self.known_addresses()[0]
            try:
                return attempt(address, remaining)
            except MqdsError as err:
                if not err.retriable or (err.reason is Reason.DEADLINE_EXCEEDED and not retry_unavailable):
                    raise
                if err.reason in (Reason.UNAVAILABLE, Reason.SHUTTING_DOWN, Reason.DEADLINE_EXCEEDED):
                    if not retry_unavailable:
                        raise
                    tried_replicas += 1
                    if shard is not None:
                        self.forget_leader(shard)
                    self.refresh_quietly(remaining)
                elif err.reason in (Reason.NOT_LEADER, Reason.NOT_HOSTED):
                    if self.learn(err, shard):
                        continue
                    self.refresh_quietly(remaining)
                else:  # NO_LEADER, OVERLOADED, ...
                    if shard is not None:
                        self.forget_leader(shard)
                    self.refresh_quietly(remaining)
                delay = next(delays)
                if time.monotonic() + delay >= deadline:
                    raise
                time.sleep(delay)

    def refresh_quietly(self, remaining: float) -> None:
        try:
            self.refresh(min(2.0, max(remaining, 0.1)), force=True)
        except MqdsError as err:
            log.debug("map refresh failed: %s", err)
