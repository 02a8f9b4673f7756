"""Liveness and readiness, as the gRPC health service reports them.

The empty service name is liveness: SERVING while the process serves,
whatever its replicas do. The public API services (Storage, Cluster,
Sessions) are readiness: SERVING while ``ready()``. Readiness is computed
again every ``HEALTH_INTERVAL_S`` on a thread of its own (the maintenance
loop can wait seconds on a proposal), and whenever the node calls
``refresh``; only changes reach the health service.

A node that is not ready also declines leadership handed to it: each
refresh tells every hosted group (``RaftGroup.not_ready``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Protocol

from grpc_health.v1 import health, health_pb2

from mqds.server.api.server import PUBLIC_SERVICES
from mqds.server.cluster.meta import MetaMachine
from mqds.server.cluster.vnode import Vnode
from mqds.server.raft.group import RaftGroup

log = logging.getLogger(__name__)

# How often readiness is computed again: a probe sees a change within this.
HEALTH_INTERVAL_S = 0.25


class Hosted(Protocol):
    """The replicas whose state readiness follows (``mqds.server.node.hosting.Hosting``)."""

    @property
    def node_id(self) -> str: ...

    @property
    def meta(self) -> MetaMachine | None: ...

    @property
    def meta_group(self) -> RaftGroup | None: ...

    @property
    def vnodes(self) -> Mapping[int, Vnode]: ...

    def groups(self) -> list[tuple[int, RaftGroup]]: ...


class Health:
    """Computes readiness and keeps the gRPC health service (``servicer``) up to date."""

    def __init__(self, hosted: Hosted, *, max_lag_entries: int, max_apply_stall_s: float) -> None:
        self.hosted = hosted
        self.max_lag_entries = max_lag_entries
        self.max_apply_stall_s = max_apply_stall_s
        self.servicer = health.HealthServicer()
        self._lock = threading.Lock()
        self._readiness: int | None = None

    def ready(self) -> bool:
        """Joined, and every replica the metadata places here is open, has a leader and is caught up.

        Caught up: not installing a snapshot, applied all but at most
        ``ready_max_lag_entries`` of the entries its leader committed, as far
        as this replica heard (the metadata replica too), and not stalled: an
        applied index that stopped behind the commit index for
        ``ready_max_apply_stall_s`` is not ready, however small the lag. So a
        node replaying its journal after a restart, fetching snapshots after
        its disk was wiped, or unable to apply, is not ready; it is alive all
        along (liveness stays SERVING).
        """
        hosted = self.hosted
        meta, meta_group = hosted.meta, hosted.meta_group
        if meta is None or meta_group is None or not self._caught_up(meta_group):
            return False
        for info in meta.map.vnodes:
            if hosted.node_id not in info.replicas:
                continue
            vnode = hosted.vnodes.get(info.shard)
            if vnode is None or not self._caught_up(vnode.group):
                return False
            storage = vnode.replica.storage
            # A shard being restored has no generation until its restore finishes, on every replica alike.
            if not (storage.initialized or storage.restoring):
                return False
        return True

    def _caught_up(self, group: RaftGroup) -> bool:
        return (
            group.leader_id is not None
            and not group.installing_snapshot
            and group.catch_up_lag() <= self.max_lag_entries
            and group.apply_stalled_s() < self.max_apply_stall_s
        )

    def refresh(self) -> None:
        """Liveness ("") SERVING while the process serves; readiness (the API services) while ready().

        Only changes reach the health service: each one is sent to every
        Watch stream of the service.
        """
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        with self._lock:
            ready = self.ready()
            # A node that is not ready declines leadership handed to it: a
            # leader's balancer moved vnodes onto a node still fetching
            # snapshots, and they had no leader once that node was stopped.
            for _, group in self.hosted.groups():
                group.not_ready = not ready
            status = serving if ready else not_serving
            if self._readiness is None:
                self.servicer.set("", serving)
            if status == self._readiness:
                return
            for service in PUBLIC_SERVICES:
                self.servicer.set(service, status)
            if self._readiness is not None or status == serving:
                log.info("readiness: %s", "SERVING" if status == serving else "NOT_SERVING (catching up)")
            self._readiness = status

    def run(self, stopping: threading.Event) -> None:
        """Refresh readiness until ``stopping`` is set (the health thread)."""
        while not stopping.wait(HEALTH_INTERVAL_S):
            try:
                self.refresh()
            except Exception:
                log.exception("readiness check failed; will retry")

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING from here on, for good."""
        self.servicer.enter_graceful_shutdown()
