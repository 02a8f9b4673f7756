"""The node: the composition root that builds the parts of a node, wires them, starts and stops them.

A node hosts a replica of the cluster-metadata group and one replica of each
vnode the metadata places on it. Its parts, one concept each:

- ``datadir.DataDir``: the data directory's lock and layout;
- ``hosting.Hosting``: the Raft groups and vnode replicas hosted here, and
  the rules to reach them (which replica serves a shard, proposals to leaders);
- ``health.Health``: liveness and readiness on the gRPC health service;
- ``maintenance.Maintenance``: the background loop (replicas per the map,
  generations, retention, leader balance, placement repair, joining);
- ``snapshots.Snapshots``: checkpoints streamed between nodes;
- ``peers.Peers``: channels to the other nodes;
- ``api.*``: the gRPC server and its services (Storage, Sessions, Cluster, Raft).

The parts never import this module: each one takes what it needs, either
another part or the node through a small ``typing.Protocol`` of its own
(``api.cluster_service.ClusterNode``, ``api.raft_service.RaftNode``,
``cluster.membership.MembershipNode``, ``metrics.ObservedNode``), which
``Node`` implements by handing the call to the part that owns it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

from mqds.protocol.errors import MqdsError
from mqds.server import wire
from mqds.server.api.cluster_service import ClusterAPI
from mqds.server.api.follow import FollowLimits
from mqds.server.api.follow_registry import FollowCalls
from mqds.server.api.guard import ApiGuard, CallLimits
from mqds.server.api.handlers import service_handler
from mqds.server.api.raft_service import raft_handler
from mqds.server.api.server import grpc_server
from mqds.server.api.session_service import SessionService
from mqds.server.api.shards_api import now_us
from mqds.server.api.storage_service import StorageService
from mqds.server.auth import load_tokens
from mqds.server.cluster import meta as meta_mod
from mqds.server.cluster.membership import Membership
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.cluster.vnode import Vnode
from mqds.server.config import NodeConfig
from mqds.server.diskusage import DiskUsage
from mqds.server.metrics import NodeMetrics
from mqds.server.node.datadir import DataDir
from mqds.server.node.diskguard import DiskGuard
from mqds.server.node.health import Health
from mqds.server.node.hosting import Hosting
from mqds.server.node.maintenance import Maintenance
from mqds.server.node.peers import Peers
from mqds.server.node.snapshots import Snapshots
from mqds.server.raft import tcp_wire
from mqds.server.raft.cluster_auth import ClusterAuth
from mqds.server.raft.group import RaftGroup, RaftTiming
from mqds.server.raft.journal import COPY_BYTES, NodeLog
from mqds.server.raft.transport import PeerRouter
from mqds.server.raft.v1 import raft_pb2 as rpb
from mqds.server.raft.v1 import raft_pb2_grpc as rpb_grpc
from mqds.server.startup import StartupError
from mqds.server.storage import Engine, EngineOptions, writes
from mqds.server.storage.expiry import NEVER
from mqds.server.tls import NodeTls
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb

log = logging.getLogger(__name__)

# Threads of the control pool: health checks and refusals, never behind the calls (see DESIGN.md).
_CONTROL_WORKERS = 4
# Most peers whose Raft streams this node serves at once (threads are started as streams come).
_PEER_STREAM_WORKERS = 256


class Node:
    """One mqds node."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.node_id = config.node_id
        # The clock of timestamps and the generation timer: the real one,
        # shifted by fault_clock_offset_s in chaos runs (clock skew).
        offset_us = int(config.fault_clock_offset_s * 1_000_000)
        self.clock = (lambda: now_us() + offset_us) if offset_us else now_us
        self._stopping = threading.Event()
        self._changed = threading.Event()
        """Wakes the maintenance loop: a role or the cluster map changed, or the node stops."""
        self._threads: list[threading.Thread] = []
        self.metrics = NodeMetrics(self)
        try:
            self.tls = NodeTls.from_config(config)
        except OSError as err:
            raise StartupError(f"cannot read a TLS file: {err}") from None
        self.data_dir = DataDir(config)
        self.engine = Engine(
            EngineOptions(
                block_cache_bytes=config.block_cache_bytes,
                write_buffer_bytes=config.write_buffer_bytes,
                compaction_low_priority=config.compaction_low_priority,
            )
        )
        t = config.raft_election_timeout_s
        self.timing = RaftTiming(
            heartbeat_s=config.raft_heartbeat_s,
            election_timeout_min_s=t,
            election_timeout_max_s=2 * t,
            log_max_bytes=config.raft_log_max_bytes,
            compaction_interval_s=config.raft_compaction_interval_s,
            max_entry_bytes=config.max_request_bytes + 1024 * 1024,
        )
        # A group past a quarter of its compaction threshold is busy and soon
        # compacted: a new segment records where its entries begin instead of
        # copying them.
        self.raft_log = NodeLog(
            self.data_dir.wal,
            config.raft_segment_bytes,
            min(COPY_BYTES, config.raft_log_max_bytes // 4),
        )
        self.auth = ClusterAuth(config.node_id, config.advertised, config.cluster_secret, config.dev_mode)
        self.router = PeerRouter(
            self.auth,
            self._group_of,
            self.tls.peer_credentials() if self.tls else None,
            linger_s=config.raft_heartbeat_linger_s,
            transport=config.raft_transport,
            tls_client=self.tls.raft_client_context() if self.tls else None,
        )
        self.disk_guard = DiskGuard(self.data_dir.tmp, isolate=self.router.isolate)
        self.raft_log.on_failure = self.disk_guard.failed
        self.disk_usage = DiskUsage(
            config.node_id,
            config.data_dir,
            config.disk_quota_bytes,
            config.disk_min_free_bytes,
            config.disk_check_interval_s,
            logged=lambda: self.raft_log.bytes_written,
            refusing=self._release_logs,
        )
        self.peers = Peers(self.router)
        self.snapshots = Snapshots(self.peers, self.auth, self.metrics, self.data_dir.tmp)
        self.hosting = Hosting(
            config,
            self.data_dir,
            engine=self.engine,
            raft_log=self.raft_log,
            router=self.router,
            timing=self.timing,
            auth=self.auth,
            peers=self.peers,
            clock=self.clock,
            fetch_snapshot=self.snapshots.fetch,
            stopping=self._stopping,
            disk_usage=self.disk_usage,
            changed=self._changed,
        )
        self.router.on_link_change(self.hosting.link_changed)
        self.membership = Membership(self)

        peers = config.peer_map() or {config.node_id: config.advertised}
        try:
            if os.path.exists(self.data_dir.meta_state):
                self.hosting.open_meta(None, joining=False)
            elif config.node_id in peers:
                genesis = meta_mod.genesis(peers, config.n_shards, config.replication_factor)
                self.hosting.open_meta(genesis, joining=False)
            for node_id, address in peers.items():
                self.router.set_address(node_id, address)
            if self.meta is not None:
                self._check_settings()
        except MqdsError as err:
            self._close_all()
            raise StartupError(str(err)) from None
        except Exception:
            self._close_all()
            raise

        self.health = Health(
            self.hosting,
            max_lag_entries=config.ready_max_lag_entries,
            max_apply_stall_s=config.ready_max_apply_stall_s,
        )
        self.maintenance = Maintenance(
            config,
            self.hosting,
            self.health,
            self.membership,
            peers=self.peers,
            router=self.router,
            auth=self.auth,
            retention_drops=self.metrics.retention_drops,
            expired=self.metrics.expired,
            clock=self.clock,
            stopping=self._stopping,
            changed=self._changed,
        )
        self.storage_service = StorageService(
            self.hosting,
            max_payload_bytes=config.max_payload_bytes,
            max_batch_messages=config.max_batch_messages,
            max_next_batch=config.max_next_batch,
            max_answer_bytes=config.max_answer_bytes,
            max_entry_bytes=self.timing.max_entry_bytes,
            clock=self.clock,
            stream_window=config.store_stream_window,
            stream_idle_s=config.store_stream_idle_s,
            follow_limits=FollowLimits(config.follow_max_subscriptions, config.follow_max_batch),
            scratch_dir=self.data_dir.tmp,
            node_id=config.node_id,
            store_limits=self.maintenance.retention_limits.admission,
        )
        tokens = load_tokens(config.auth_tokens_file) if config.auth_tokens_file else {}
        self._control_pool = futures.ThreadPoolExecutor(max_workers=_CONTROL_WORKERS, thread_name_prefix="grpc-control")
        self._stream_pool = futures.ThreadPoolExecutor(
            max_workers=config.max_public_streams, thread_name_prefix="grpc-stream"
        )
        self._peer_pool = futures.ThreadPoolExecutor(max_workers=_PEER_STREAM_WORKERS, thread_name_prefix="raft-in")
        self.guard = ApiGuard(
            tokens,
            self.auth,
            CallLimits(
                max_public_calls=config.max_public_calls,
                max_public_streams=config.max_public_streams,
                max_calls_per_client=config.max_calls_per_client,
                max_internal_calls=config.grpc_workers - config.max_public_calls,
                max_peer_calls=_PEER_STREAM_WORKERS,
            ),
            config=config,
            control_pool=self._control_pool,
            stream_pool=self._stream_pool,
            peer_pool=self._peer_pool,
        )
        """Every call's table entry applied: authentication, roles, bounds and pools (see mqds.server.api.guard)."""
        try:
            if config.raft_transport == "tcp":
                self.router.listen_tcp(
                    config.raft_tcp_listen,
                    self.timing.max_entry_bytes + 2 * tcp_wire.FRAME_TARGET_BYTES,
                    self.tls.raft_server_context() if self.tls else None,
                )
        except OSError as err:
            self._close_all()
            raise StartupError(
                f"cannot take Raft traffic on {config.raft_tcp_listen} (raft_listen): {err.strerror or err}"
            ) from None
        self.server = grpc_server(config, (self.guard,), self._handlers(), self.health.servicer)
        try:
            if self.tls is not None:
                self.port = self.server.add_secure_port(config.listen, self.tls.server_credentials())
            else:
                self.port = self.server.add_insecure_port(config.listen)
        except RuntimeError:
            self._close_all()
            raise StartupError(
                f"cannot listen on {config.listen}: the address is in use or not available on this host"
            ) from None
        if config.metrics_listen:
            try:
                bound = self.metrics.serve(config.metrics_listen)
            except OSError as err:
                self._close_all()
                raise StartupError(
                    f"cannot serve metrics on {config.metrics_listen} (metrics_listen): {err.strerror or err}"
                ) from None
            log.info("metrics on http://%s/metrics", bound)

    def _handlers(self) -> list[Any]:
        """The gRPC handlers of the public services and the internal Raft service."""
        config, requests = self.config, self.metrics.requests
        sessions = SessionService(
            self.hosting,
            max_payload_bytes=config.max_payload_bytes,
            max_fetch=config.max_next_batch,
            max_answer_bytes=config.max_answer_bytes,
            max_entry_bytes=self.timing.max_entry_bytes,
            clock=self.clock,
            session_expiry_default_s=min(int(config.session_expiry_default_s), NEVER),
            follow_calls=self.storage_service.follow_calls,
        )
        return [
            service_handler(pb.DESCRIPTOR.services_by_name["Storage"], self.storage_service, pb, requests),
            service_handler(clpb.DESCRIPTOR.services_by_name["Cluster"], ClusterAPI(self), clpb, requests),
            service_handler(spb.DESCRIPTOR.services_by_name["Sessions"], sessions, spb, requests),
            raft_handler(self, requests),
        ]

    # -- lifecycle -------------------------------------------------------------

    def _check_settings(self) -> None:
        assert self.meta is not None
        cmap = self.meta.map
        if cmap.n_shards != self.config.n_shards:
            raise StartupError(
                f"the cluster in {self.config.data_dir} was created with n_shards={cmap.n_shards}; "
                f"n_shards={self.config.n_shards} cannot change after creation"
            )

    def _release_logs(self) -> None:
        """The disk is past a limit: give back what the logs hold (``Hosting.release_logs``)."""
        self.hosting.release_logs()

    def start(self) -> None:
        self.disk_usage.start()
        self.server.start()
        # Alive (liveness SERVING) from here on, and not ready until the
        # replicas below are open, led and caught up.
        self.health.refresh()
        if self.meta_group is not None:
            self.meta_group.start()
            self.hosting.reconcile()
        self.health.refresh()
        threads = ((self.maintenance.run, "maintenance"), (lambda: self.health.run(self._stopping), "health"))
        for target, name in threads:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info(
            "node %s serving %s on %s (advertised as %s), data in %s",
            self.node_id,
            "plaintext" if self.tls is None else "TLS" if self.tls.client_ca is None else "mutual TLS",
            self.config.listen,
            self.config.advertised,
            self.config.data_dir,
        )
        if not wire.NATIVE:
            log.warning(
                "answers are encoded in Python, not C: the read path's C part (mqds.server._wire_native) was not "
                "built (no C compiler when the package was installed) or MQDS_PURE_PYTHON is set; reads cost more CPU"
            )
        if not writes.NATIVE:
            log.warning(
                "stores put their keys in Python, not C: the store path's C part (mqds.server.storage._store_native) "
                "was not built (no C compiler when the package was installed) or MQDS_PURE_PYTHON is set; writes "
                "cost more CPU"
            )

    def wait(self) -> None:
        self._stopping.wait()

    def stop(self) -> None:
        """Stop serving, let in-flight calls finish, stop the groups, close the databases."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._changed.set()
        self.disk_guard.stop()
        self.disk_usage.stop()
        self.health.enter_graceful_shutdown()
        # New calls are refused from here on; in-flight ones (and the peers'
        # Raft streams) go on during the grace period. Hand leadership over
        # meanwhile: a leader that kept it would refuse every write for the
        # whole grace period, and its followers, still hearing heartbeats,
        # would not elect another (found by the chaos runs: a SIGTERM cost a
        # shard 5-7 s of writes where kill -9 cost 2).
        stopped = self.server.stop(self.config.shutdown_grace_s)
        self.hosting.retire()
        self.hosting.hand_off_leadership(min(3.0, self.config.shutdown_grace_s))
        stopped.wait()
        self._control_pool.shutdown(wait=False)
        self._stream_pool.shutdown(wait=False)
        self._peer_pool.shutdown(wait=False)
        for thread in self._threads:
            thread.join(timeout=10)
        self._close_all()
        log.info("node %s stopped", self.node_id)

    def _close_all(self) -> None:
        self.metrics.close()
        self.hosting.close()
        self.raft_log.close()
        self.router.close()
        self.peers.close()
        self.data_dir.close()

    # -- what the parts see of the node (their Protocols), handed to the part that owns it -----

    def _group_of(self, group: int) -> RaftGroup | None:
        return self.hosting.group_of(group)

    @property
    def meta(self) -> meta_mod.MetaMachine | None:
        return self.hosting.meta

    @property
    def meta_group(self) -> RaftGroup | None:
        return self.hosting.meta_group

    @property
    def vnodes(self) -> dict[int, Vnode]:
        return self.hosting.vnodes

    @property
    def dropped_by_closed_groups(self) -> int:
        """Raft messages from non-members that groups since closed here had dropped (the metrics keep counting)."""
        return self.hosting.dropped_by_closed_groups

    def groups(self) -> list[tuple[int, RaftGroup]]:
        """The Raft groups hosted here, by group id (a copy: safe to use from any thread)."""
        return self.hosting.groups()

    @property
    def follow_calls(self) -> FollowCalls:
        """The Follow calls open on this node (``mqds consumers`` lists them, the lag metrics measure them)."""
        return self.storage_service.follow_calls

    def hosted_vnodes(self) -> list[tuple[int, Vnode]]:
        """The vnode replicas hosted here, by shard (a copy)."""
        return self.hosting.hosted_vnodes()

    def vnode(self, shard: int) -> Vnode:
        """This node's replica of ``shard``; UNKNOWN_SHARD or NOT_HOSTED otherwise."""
        return self.hosting.vnode(shard)

    def ready(self) -> bool:
        """Joined, and every replica the metadata places here is open, has a leader and is caught up."""
        return self.health.ready()

    def cluster_map(self) -> clpb.ClusterMap:
        return self.hosting.cluster_map()

    def propose_meta(self, command: cpb.MetaCommand, timeout_s: float | None = None) -> Any:
        """Log a metadata change on the metadata leader, wherever it is; the result of applying it."""
        return self.hosting.propose_meta(command, timeout_s)

    def internal_stub(self, node_id: str) -> rpb_grpc.RaftStub:
        """The internal Raft service of another node (calls need ``auth.metadata()``)."""
        return self.peers.internal_stub(node_id)

    def cluster_stub(self, node_id: str) -> clpb_grpc.ClusterStub:
        """The public Cluster service of a node (this one included)."""
        return self.peers.cluster_stub(node_id)

    def serve_snapshot(self, request: rpb.FetchSnapshotRequest) -> Iterator[rpb.SnapshotChunk]:
        """A checkpoint of this node's replica of ``request.group``, streamed (FetchSnapshot)."""
        yield from self.snapshots.serve(self.hosting.vnode(request.group), request)
