"""The node: the composition root that wires storage, Raft, the cluster and the gRPC server.

A node hosts a replica of the cluster-metadata group and one replica of each
vnode the metadata places on it. Data directory layout::

    <data_dir>/node.json                node id and layout version
    <data_dir>/meta/state               the cluster map this node applied
    <data_dir>/meta/raft/               the metadata group's journal and snapshot manifest
    <data_dir>/shards/shard-0000/       one RocksDB database per hosted vnode
    <data_dir>/raft/shard-0000/         that vnode's Raft journal and snapshot manifest
    <data_dir>/tmp/                     checkpoints being sent to other nodes

Background work (one thread): create replicas the metadata places here and
delete the ones it moved away; on vnodes this node leads, start a new
generation once the current one is ``generation_interval_s`` old, drop
generations past ``retention_period_s`` (both as log entries, so every
replica agrees), and hand leadership back to the preferred replica once it is
caught up; tell the metadata leader when this node's address changed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.server.api.handlers import service_handler, unary_handlers
from mqds.server.api.session_service import SessionService
from mqds.server.api.storage_service import StorageService, now_us
from mqds.server.auth import ApiGuard, load_tokens, time_left
from mqds.server.cluster import meta as meta_mod
from mqds.server.cluster.membership import Membership
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.cluster.vnode import VnodeReplica
from mqds.server.config import NodeConfig
from mqds.server.metrics import NodeMetrics
from mqds.server.raft.group import META_GROUP, ROLE_LEADER, PendingRead, RaftGroup, RaftTiming
from mqds.server.raft.journal import COPY_BYTES, NodeLog
from mqds.server.raft.transport import ClusterAuth, PeerRouter, raft_stream_handler
from mqds.server.raft.v1 import raft_pb2 as rpb
from mqds.server.raft.v1 import raft_pb2_grpc as rpb_grpc
from mqds.server.storage import Engine, EngineOptions
from mqds.server.tls import NodeTls
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb

log = logging.getLogger(__name__)

NODE_FILE_VERSION = 2
STORAGE_SERVICE = pb.DESCRIPTOR.services_by_name["Storage"].full_name
CLUSTER_SERVICE = clpb.DESCRIPTOR.services_by_name["Cluster"].full_name
SESSIONS_SERVICE = spb.DESCRIPTOR.services_by_name["Sessions"].full_name
RAFT_SERVICE = rpb.DESCRIPTOR.services_by_name["Raft"].full_name
_CHUNK = 1024 * 1024
_ROLES = {0: clpb.RAFT_ROLE_FOLLOWER, 1: clpb.RAFT_ROLE_CANDIDATE, 2: clpb.RAFT_ROLE_LEADER}
# How often readiness is computed again: a probe sees a change within this.
_HEALTH_INTERVAL_S = 0.25
# Threads of the control pool: health checks and refusals, never behind the calls (see DESIGN.md).
_CONTROL_WORKERS = 4
# Most peers whose Raft streams this node serves at once (threads are started as streams come).
_PEER_STREAM_WORKERS = 256


class StartupError(RuntimeError):
    """The node cannot start; the message says why and what to do."""


def _lock_data_dir(config: NodeConfig) -> int:
    """Take the data directory's lock (held until the process exits): one node per directory."""
    fd = os.open(os.path.join(config.data_dir, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StartupError(f"data directory {config.data_dir} is in use by another mqds-server process") from None
    return fd


def _check_data_dir(config: NodeConfig) -> int:
    try:
        os.makedirs(config.data_dir, exist_ok=True)
    except OSError as err:
        raise StartupError(f"cannot create data directory {config.data_dir}: {err.strerror}") from None
    if not os.access(config.data_dir, os.W_OK | os.X_OK):
        raise StartupError(f"data directory {config.data_dir} is not writable by this user")
    lock = _lock_data_dir(config)
    for sub in ("shards", "raft", "meta", "tmp"):
        os.makedirs(os.path.join(config.data_dir, sub), exist_ok=True)
    path = os.path.join(config.data_dir, "node.json")
    if os.path.exists(path):
        with open(path) as fh:
            meta = json.load(fh)
        if meta.get("version") != NODE_FILE_VERSION:
            raise StartupError(
                f"{path}: layout version {meta.get('version')} is not supported (expected {NODE_FILE_VERSION})"
            )
        if meta["node_id"] != config.node_id:
            raise StartupError(
                f"data directory {config.data_dir} belongs to node {meta['node_id']!r}, not {config.node_id!r}"
            )
        return lock
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"version": NODE_FILE_VERSION, "node_id": config.node_id}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return lock


@dataclass
class Vnode:
    """A vnode replica hosted here: its storage and its Raft group."""

    shard: int
    replica: VnodeReplica
    group: RaftGroup


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
        self._lock = threading.RLock()
        self._changed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._health_lock = threading.Lock()
        self._readiness: int | None = None
        self.dropped_by_closed_groups = 0
        """Raft messages from non-members that groups since closed here had dropped (the metrics keep counting)."""
        self.metrics = NodeMetrics(self)
        try:
            self.tls = NodeTls.from_config(config)
        except OSError as err:
            raise StartupError(f"cannot read a TLS file: {err}") from None
        self._dir_lock = _check_data_dir(config)
        self._tmp_dir = os.path.join(config.data_dir, "tmp")
        shutil.rmtree(self._tmp_dir, ignore_errors=True)
        os.makedirs(self._tmp_dir, exist_ok=True)
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
            os.path.join(config.data_dir, "raft", "wal"),
            config.raft_segment_bytes,
            min(COPY_BYTES, config.raft_log_max_bytes // 4),
        )
        self.auth = ClusterAuth(config.node_id, config.advertised, config.cluster_secret, config.dev_mode)
        self.router = PeerRouter(
            self.auth,
            self._group_of,
            self.tls.peer_credentials() if self.tls else None,
            linger_s=config.raft_heartbeat_linger_s,
        )
        self.router.on_link_change(self._link_changed)
        self._groups: dict[int, RaftGroup] = {}
        self.vnodes: dict[int, Vnode] = {}
        self.meta: meta_mod.MetaMachine | None = None
        self.meta_group: RaftGroup | None = None
        self._channels: dict[str, grpc.Channel] = {}
        self._last_leader_balance = time.monotonic()
        self._last_placement_check = time.monotonic()
        self._placement_check: threading.Thread | None = None
        self._address_reported = False
        self.membership = Membership(self)

        meta_state = os.path.join(config.data_dir, "meta", "state")
        peers = config.peer_map() or {config.node_id: config.advertised}
        try:
            if os.path.exists(meta_state):
                self._open_meta(None, joining=False)
            elif config.node_id in peers:
                self._open_meta(meta_mod.genesis(peers, config.n_shards, config.replication_factor), joining=False)
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

        self.storage_service = StorageService(
            self,
            max_payload_bytes=config.max_payload_bytes,
            max_batch_messages=config.max_batch_messages,
            max_next_batch=config.max_next_batch,
            max_answer_bytes=config.max_answer_bytes,
            max_entry_bytes=self.timing.max_entry_bytes,
            clock=self.clock,
        )
        self.health = health.HealthServicer()
        tokens = load_tokens(config.auth_tokens_file) if config.auth_tokens_file else {}
        self._control_pool = futures.ThreadPoolExecutor(max_workers=_CONTROL_WORKERS, thread_name_prefix="grpc-control")
        self._peer_pool = futures.ThreadPoolExecutor(max_workers=_PEER_STREAM_WORKERS, thread_name_prefix="raft-in")
        self.guard = ApiGuard(
            tokens,
            self.auth.is_node,
            config.max_calls_per_client,
            max_public_calls=config.max_public_calls,
            dev_mode=config.dev_mode,
            control_pool=self._control_pool,
        )
        """Client authentication, roles, and the limits on public calls in flight (see mqds.server.auth)."""
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.grpc_workers, thread_name_prefix="grpc"),
            interceptors=(self.guard,),
            maximum_concurrent_rpcs=config.max_concurrent_rpcs,
            options=[
                ("grpc.so_reuseport", 0),
                # Raft frames share the port: one append-entries may carry
                # entries up to twice the entry limit. The public services
                # refuse requests over max_request_bytes themselves (handlers).
                ("grpc.max_receive_message_length", 2 * config.max_request_bytes + 4 * _CHUNK),
                ("grpc.max_send_message_length", 2 * config.max_request_bytes + 4 * _CHUNK),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 1000),
                ("grpc.http2.max_ping_strikes", 0),
            ],
        )
        self.server.add_generic_rpc_handlers(
            (
                service_handler(
                    pb.DESCRIPTOR.services_by_name["Storage"],
                    self.storage_service,
                    pb,
                    self.metrics.requests,
                    config.max_request_bytes,
                ),
                service_handler(
                    clpb.DESCRIPTOR.services_by_name["Cluster"],
                    ClusterAPI(self),
                    clpb,
                    self.metrics.requests,
                    config.max_request_bytes,
                ),
                service_handler(
                    spb.DESCRIPTOR.services_by_name["Sessions"],
                    SessionService(
                        self,
                        max_payload_bytes=config.max_payload_bytes,
                        max_fetch=config.max_next_batch,
                        max_answer_bytes=config.max_answer_bytes,
                        max_entry_bytes=self.timing.max_entry_bytes,
                        clock=self.clock,
                    ),
                    spb,
                    self.metrics.requests,
                    config.max_request_bytes,
                ),
                self._raft_handler(),
            )
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # Reflection describes the public services only: its own pool holds
        # their files (the default pool would describe the internal protos too).
        reflection.enable_server_reflection(
            (STORAGE_SERVICE, CLUSTER_SERVICE, SESSIONS_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME),
            self.server,
            pool=_public_descriptor_pool(),
        )
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

    # -- lifecycle -------------------------------------------------------------

    def _check_settings(self) -> None:
        assert self.meta is not None
        cmap = self.meta.map
        if cmap.n_shards != self.config.n_shards:
            raise StartupError(
                f"the cluster in {self.config.data_dir} was created with n_shards={cmap.n_shards}; "
                f"n_shards={self.config.n_shards} cannot change after creation"
            )

    def start(self) -> None:
        self.server.start()
        # Alive (liveness SERVING) from here on, and not ready until the
        # replicas below are open, led and caught up.
        self._set_health()
        if self.meta_group is not None:
            self.meta_group.start()
            self._reconcile()
        self._set_health()
        for target, name in ((self._background, "maintenance"), (self._health_loop, "health")):
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

    def wait(self) -> None:
        self._stopping.wait()

    def stop(self) -> None:
        """Stop serving, let in-flight calls finish, stop the groups, close the databases."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._changed.set()
        self.health.enter_graceful_shutdown()
        # New calls are refused from here on; in-flight ones (and the peers'
        # Raft streams) go on during the grace period. Hand leadership over
        # meanwhile: a leader that kept it would refuse every write for the
        # whole grace period, and its followers, still hearing heartbeats,
        # would not elect another (found by the chaos runs: a SIGTERM cost a
        # shard 5-7 s of writes where kill -9 cost 2).
        stopped = self.server.stop(self.config.shutdown_grace_s)
        for group in list(self._groups.values()):
            group.retire()
        self._hand_off_leadership(min(3.0, self.config.shutdown_grace_s))
        stopped.wait()
        self._control_pool.shutdown(wait=False)
        self._peer_pool.shutdown(wait=False)
        for thread in self._threads:
            thread.join(timeout=10)
        self._close_all()
        log.info("node %s stopped", self.node_id)

    def _hand_off_leadership(self, timeout_s: float) -> None:
        """Best effort, within ``timeout_s``: move the leadership of every group led here to a follower.

        A transfer is refused until a follower has the leader's whole log;
        with no new writes coming in, that happens within a round trip.
        """
        deadline = time.monotonic() + timeout_s
        asked: dict[int, float] = {}
        while time.monotonic() < deadline:
            led = [g for g in list(self._groups.values()) if g.is_leader and len(g.members) > 1]
            if not led:
                return
            for group in led:
                # A granted transfer takes an election to complete: do not ask again meanwhile.
                if time.monotonic() - asked.get(group.group, -10.0) < 1.0:
                    continue
                try:
                    group.transfer_leadership(None)
                    asked[group.group] = time.monotonic()
                    log.info("%s: leadership handed over before stopping", group.name)
                except MqdsError:
                    pass
            time.sleep(0.05)
        still = [g.name for g in list(self._groups.values()) if g.is_leader and len(g.members) > 1]
        if still:
            log.info("stopping while still leading %s", ", ".join(still))

    def _close_all(self) -> None:
        self.metrics.close()
        with self._lock:
            vnodes = list(self.vnodes.values())
            self.vnodes.clear()
        for vnode in vnodes:
            vnode.replica.stopping.set()
            vnode.group.stop()
            vnode.replica.close()
        if self.meta_group is not None:
            self.meta_group.stop()
            self.meta_group = None
        self._groups.clear()
        self.raft_log.close()
        self.router.close()
        for channel in self._channels.values():
            channel.close()
        if self._dir_lock >= 0:
            os.close(self._dir_lock)
            self._dir_lock = -1

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
        meta, meta_group = self.meta, self.meta_group
        if meta is None or meta_group is None or not self._caught_up(meta_group):
            return False
        for info in meta.map.vnodes:
            if self.node_id not in info.replicas:
                continue
            vnode = self.vnodes.get(info.shard)
            if vnode is None or not vnode.replica.storage.initialized or not self._caught_up(vnode.group):
                return False
        return True

    def _caught_up(self, group: RaftGroup) -> bool:
        return (
            group.leader_id is not None
            and not group.installing_snapshot
            and group.catch_up_lag() <= self.config.ready_max_lag_entries
            and group.apply_stalled_s() < self.config.ready_max_apply_stall_s
        )

    def _set_health(self) -> None:
        """Liveness ("") SERVING while the process serves; readiness (the API services) while ready().

        Only changes reach the health service: each one is sent to every
        Watch stream of the service.
        """
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        with self._health_lock:
            ready = self.ready()
            # A node that is not ready declines leadership handed to it: a
            # leader's balancer moved vnodes onto a node still fetching
            # snapshots, and they had no leader once that node was stopped.
            for group in list(self._groups.values()):
                group.not_ready = not ready
            status = serving if ready else not_serving
            if self._readiness is None:
                self.health.set("", serving)
            if status == self._readiness:
                return
            for service in (STORAGE_SERVICE, CLUSTER_SERVICE, SESSIONS_SERVICE):
                self.health.set(service, status)
            if self._readiness is not None or status == serving:
                log.info("readiness: %s", "SERVING" if status == serving else "NOT_SERVING (catching up)")
            self._readiness = status

    def _health_loop(self) -> None:
        """Refresh readiness on a thread of its own: the maintenance loop can wait seconds on a proposal."""
        while not self._stopping.wait(_HEALTH_INTERVAL_S):
            try:
                self._set_health()
            except Exception:
                log.exception("readiness check failed; will retry")

    def groups(self) -> list[tuple[int, RaftGroup]]:
        """The Raft groups hosted here, by group id (a copy: safe to use from any thread)."""
        return sorted(list(self._groups.items()), key=lambda item: item[0])

    def hosted_vnodes(self) -> list[tuple[int, Vnode]]:
        """The vnode replicas hosted here, by shard (a copy)."""
        return sorted(list(self.vnodes.items()), key=lambda item: item[0])

    # -- groups ------------------------------------------------------------------

    def _group_of(self, group: int) -> RaftGroup | None:
        return self._groups.get(group)

    def _link_changed(self, node_id: str, connected: bool) -> None:
        for group in list(self._groups.values()):
            group.peer_connected(node_id, connected)

    def _new_group(self, group_id: int, members: list[str], machine: Any, directory: str, joining: bool) -> RaftGroup:
        group = RaftGroup(
            group_id,
            self.node_id,
            members,
            machine,
            directory,
            self.raft_log.journal(group_id),
            self.router,
            self.timing,
            on_role_change=self._role_changed,
            joining=joining,
        )
        self._groups[group_id] = group
        for member in group.members:
            if member != self.node_id and self.router.is_connected(member):
                group.peer_connected(member, True)
        return group

    def _role_changed(self, group: RaftGroup, old: int, new: int) -> None:
        """Called on the group's thread when its role changes."""
        if new == ROLE_LEADER:
            vnode = self.vnodes.get(group.group)
            if vnode is not None and group.group != META_GROUP and not vnode.replica.storage.initialized:
                # A new vnode's first generation starts with a logged
                # command, so every replica records the same creation time.
                group.propose(_add_generation(self.clock(), 0))
        self._changed.set()

    def _open_meta(self, initial: cpb.ClusterState | None, joining: bool) -> None:
        directory = os.path.join(self.config.data_dir, "meta")
        machine = meta_mod.MetaMachine(os.path.join(directory, "state"), initial)
        members = [n.id for n in machine.map.nodes]
        self.meta = machine
        self.meta_group = self._new_group(META_GROUP, members, machine, os.path.join(directory, "raft"), joining)
        machine.on_change(self._meta_changed)
        self._learn_addresses()

    def _meta_changed(self) -> None:
        self._learn_addresses()
        self._changed.set()

    def _learn_addresses(self) -> None:
        assert self.meta is not None
        for node in self.meta.map.nodes:
            if node.id != self.node_id:
                self.router.set_address(node.id, node.address)

    def _vnode_paths(self, shard: int) -> tuple[str, str]:
        return (
            os.path.join(self.config.data_dir, "shards", f"shard-{shard:04d}"),
            os.path.join(self.config.data_dir, "raft", f"shard-{shard:04d}"),
        )

    def _open_vnode(self, shard: int, members: list[str], joining: bool) -> Vnode:
        db_path, raft_dir = self._vnode_paths(shard)
        replica = VnodeReplica(
            shard,
            db_path,
            self.engine,
            node_id=self.node_id,
            fetch_snapshot=self._fetch_snapshot,
            lts_threshold_top=self.config.lts_threshold_top,
            lts_threshold=self.config.lts_threshold,
        )
        try:
            group = self._new_group(shard, members, replica, raft_dir, joining)
        except Exception:
            replica.close()
            raise
        vnode = Vnode(shard, replica, group)
        self.vnodes[shard] = vnode
        log.info(
            "shard %d: replica opened, members %s%s", shard, ",".join(group.members), " (joining)" if joining else ""
        )
        group.start()
        return vnode

    def _close_vnode(self, shard: int, delete: bool) -> None:
        with self._lock:
            vnode = self.vnodes.pop(shard, None)
        if vnode is None:
            return
        self._groups.pop(shard, None)
        vnode.replica.stopping.set()
        vnode.group.stop()
        vnode.replica.close()
        self.dropped_by_closed_groups += vnode.group.dropped_messages
        if delete:
            self.raft_log.drop_group(shard)
            for path in self._vnode_paths(shard):
                shutil.rmtree(path, ignore_errors=True)
            log.info("shard %d: replica removed from this node", shard)

    def meta_caught_up(self) -> bool:
        group = self.meta_group
        if group is None or group.leader_id is None:
            return False
        status = group.status()
        return bool(status["last_applied"] >= max(status["leader_commit"], status["commit_index"]))

    def _reconcile(self) -> None:
        """Open the replicas the metadata places here; delete the ones moved away."""
        if self.meta is None:
            return
        state = self.meta.state
        cmap = state.map
        # No metadata command applied yet (its map version is the index of
        # the last one): a brand-new cluster, whose replicas may campaign.
        # Not the applied index, which an election's no-op already moves.
        fresh = state.map.version == 0
        with self._lock:
            wanted = {v.shard: list(v.replicas) for v in cmap.vnodes if self.node_id in v.replicas}
            for shard, replicas in sorted(wanted.items()):
                if shard not in self.vnodes and not self._stopping.is_set():
                    _, raft_dir = self._vnode_paths(shard)
                    joining = not fresh and not os.path.exists(raft_dir)
                    self._open_vnode(shard, replicas, joining)
            stale = [s for s in self.vnodes if s not in wanted]
        if stale and self.meta_caught_up():
            for shard in stale:
                self._close_vnode(shard, delete=True)

    # -- background work ---------------------------------------------------------

    def _background(self) -> None:
        interval = self.config.maintenance_interval_s
        while not self._stopping.is_set():
            # Catching up (replicas without a leader or uninitialised): look
            # again soon, so readiness follows quickly. A joiner polls its
            # peers at the normal pace.
            catching_up = self.meta is not None and not self.ready()
            self._changed.wait(min(interval, 0.1) if catching_up else interval)
            self._changed.clear()
            if self._stopping.is_set():
                return
            try:
                if self.meta is None:
                    self._try_join()
                    continue
                self._reconcile()
                self._set_health()
                self._report_address()
                self._maintain_generations()
                self._balance_leaders()
                self._check_placement()
            except Exception:
                log.exception("background work failed; will retry")

    def _try_join(self) -> None:
        """A node that is not a founder waits until `mqds admin join` made it a member."""
        for peer, address in sorted(self.config.peer_map().items()):
            if peer == self.node_id:
                continue
            try:
                cmap = clpb_grpc.ClusterStub(self._channel(address)).GetClusterMap(
                    clpb.GetClusterMapRequest(), timeout=2, metadata=self.auth.metadata()
                )
            except grpc.RpcError:
                continue
            if not any(n.id == self.node_id for n in cmap.nodes):
                log.info(
                    "not a member of cluster %s yet; waiting for 'mqds admin join %s'", cmap.cluster_id, self.node_id
                )
                return
            initial = cpb.ClusterState(format=meta_mod.STATE_FORMAT, applied_index=cmap.version)
            initial.map.CopyFrom(cmap)
            initial.map.ClearField("answered_by")
            initial.map.ClearField("meta_leader")
            for vnode in initial.map.vnodes:
                vnode.ClearField("leader")
                vnode.ClearField("term")
            with self._lock:
                self._open_meta(initial, joining=True)
            assert self.meta_group is not None
            self.meta_group.start()
            self._set_health()
            log.info("joined cluster %s", cmap.cluster_id)
            self._changed.set()
            return

    def _report_address(self) -> None:
        if self._address_reported or self.meta is None:
            return
        for node in self.meta.map.nodes:
            if node.id == self.node_id:
                if node.address == self.config.advertised:
                    self._address_reported = True
                    return
                cmd = cpb.MetaCommand(
                    set_address=cpb.SetNodeAddress(node_id=self.node_id, address=self.config.advertised)
                )
                try:
                    self.propose_meta(cmd, timeout_s=5)
                    log.info("told the cluster this node is now at %s", self.config.advertised)
                except MqdsError as err:
                    log.info("could not update this node's address yet: %s", err)
                return

    def _maintain_generations(self) -> None:
        interval_us = int(self.config.generation_interval_s * 1_000_000)
        retention_us = int(self.config.retention_period_s * 1_000_000)
        now = self.clock()
        for vnode in list(self.vnodes.values()):
            if not vnode.group.is_leader:
                continue
            try:
                gens = vnode.replica.generations()
                if not gens:
                    self.propose(vnode.shard, _add_generation(now, 0))
                    continue
                current = gens[-1]
                if interval_us and now - max(current.since_us, current.created_at_us) >= interval_us:
                    info = self.propose(vnode.shard, _add_generation(now, current.generation))
                    log.info("shard %d: generation %d started (interval)", vnode.shard, info.generation)
                if retention_us:
                    horizon = now - retention_us
                    for gen in gens:
                        if gen.until_us is not None and gen.until_us <= horizon:
                            body = cpb.VnodeCommand(drop_generation=cpb.DropGeneration(generation=gen.generation))
                            self.propose(vnode.shard, body.SerializeToString())
                            self.metrics.retention_drops.labels(str(vnode.shard)).inc()
                            log.info("shard %d: generation %d dropped (retention)", vnode.shard, gen.generation)
            except MqdsError as err:
                log.info("shard %d: generation maintenance postponed: %s", vnode.shard, err)

    def _balance_leaders(self) -> None:
        interval = self.config.leader_balance_interval_s
        if not interval or time.monotonic() - self._last_leader_balance < interval or self.meta is None:
            return
        self._last_leader_balance = time.monotonic()
        preferred = {v.shard: v.replicas[0] for v in self.meta.map.vnodes if v.replicas}
        for vnode in list(self.vnodes.values()):
            group = vnode.group
            target = preferred.get(vnode.shard)
            if not group.is_leader or target in (None, self.node_id) or target not in group.members:
                continue
            if not self.router.is_connected(target):
                continue
            try:
                group.transfer_leadership(target)
                log.info("shard %d: leadership handed to preferred replica %s", vnode.shard, target)
            except MqdsError as err:
                log.debug("shard %d: %s", vnode.shard, err)

    def _check_placement(self) -> None:
        """On the metadata leader: now and then, repair vnodes whose placement and Raft group disagree.

        On a thread of its own: a repair can wait for a replica to catch up.
        """
        interval = self.config.placement_repair_interval_s
        group = self.meta_group
        if not interval or group is None or not group.is_leader:
            return
        if time.monotonic() - self._last_placement_check < interval:
            return
        if self._placement_check is not None and self._placement_check.is_alive():
            return
        self._last_placement_check = time.monotonic()

        def check() -> None:
            try:
                self.membership.repair_if_needed()
            except MqdsError as err:
                log.info("placement check: %s; will look again", err)
            except Exception:
                log.exception("placement check failed; will look again")

        self._placement_check = threading.Thread(target=check, name="placement-check", daemon=True)
        self._placement_check.start()

    # -- what the API layer uses -------------------------------------------------

    @property
    def n_shards(self) -> int:
        if self.meta is None:
            raise errors.error(Reason.NO_LEADER, f"node {self.node_id} has not joined a cluster yet")
        return int(self.meta.map.n_shards)

    def vnode(self, shard: int) -> Vnode:
        """This node's replica of ``shard``; UNKNOWN_SHARD or NOT_HOSTED otherwise."""
        n = self.n_shards
        if not 0 <= shard < n:
            raise errors.error(Reason.UNKNOWN_SHARD, f"shard {shard} does not exist; shards are 0 to {n - 1}")
        vnode = self.vnodes.get(shard)
        if vnode is None:
            replicas = []
            if self.meta is not None:
                replicas = next((list(v.replicas) for v in self.meta.map.vnodes if v.shard == shard), [])
            raise errors.error(
                Reason.NOT_HOSTED,
                f"node {self.node_id} holds no replica of shard {shard}; its replicas are on {', '.join(replicas)}",
                replicas=",".join(replicas),
                leader=replicas[0] if replicas else "",
                leader_address=(self.router.address_of(replicas[0]) or "") if replicas else "",
                shard=str(shard),
            )
        return vnode

    def leader_vnode(self, shard: int) -> Vnode:
        vnode = self.vnode(shard)
        if not vnode.group.is_leader:
            err = vnode.group.not_leader_error()
            err.metadata["shard"] = str(shard)
            raise err
        return vnode

    def begin_read(self, shard: int, stale_ok: bool) -> tuple[Vnode, PendingRead | None]:
        vnode = self.vnode(shard)
        if stale_ok:
            return vnode, None
        try:
            return vnode, vnode.group.begin_read()
        except MqdsError as err:
            err.metadata["shard"] = str(shard)
            raise

    @property
    def read_timeout_s(self) -> float:
        """How long a read waits: read_timeout_s, or what is left of the calling client's deadline."""
        return time_left(self.config.read_timeout_s)

    @property
    def write_timeout_s(self) -> float:
        """How long a write waits: write_timeout_s, or what is left of the calling client's deadline."""
        return time_left(self.config.write_timeout_s)

    def propose(self, shard: int, body: bytes) -> Any:
        return self.leader_vnode(shard).group.propose(body).wait(self.write_timeout_s)

    def propose_meta(self, command: cpb.MetaCommand, timeout_s: float | None = None) -> Any:
        """Log a metadata change on the metadata leader, wherever it is; the result of applying it."""
        timeout = timeout_s or self.write_timeout_s
        group = self.meta_group
        if group is None:
            raise errors.error(Reason.NO_LEADER, f"node {self.node_id} has not joined a cluster yet")
        if group.is_leader:
            return group.propose(command.SerializeToString()).wait(timeout)
        leader = group.leader_id
        if leader is None:
            raise group.not_leader_error()
        try:
            self.internal_stub(leader).ProposeMeta(
                rpb.ProposeMetaRequest(command=command.SerializeToString()),
                timeout=timeout,
                metadata=self.auth.metadata(),
            )
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None
        return None

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = self.router.open_channel(address)
            return channel

    def _address(self, node_id: str) -> str:
        address = self.router.address_of(node_id)
        if not address:
            raise errors.error(Reason.UNKNOWN_NODE, f"no address known for node {node_id}")
        return address

    def internal_stub(self, node_id: str) -> rpb_grpc.RaftStub:
        """The internal Raft service of another node (calls need ``auth.metadata()``)."""
        return rpb_grpc.RaftStub(self._channel(self._address(node_id)))

    def cluster_stub(self, node_id: str) -> clpb_grpc.ClusterStub:
        """The public Cluster service of a node (this one included)."""
        return clpb_grpc.ClusterStub(self._channel(self._address(node_id)))

    def cluster_map(self) -> clpb.ClusterMap:
        if self.meta is None:
            raise errors.error(Reason.NO_LEADER, f"node {self.node_id} has not joined a cluster yet")
        cmap = self.meta.map
        cmap.answered_by = self.node_id
        if self.meta_group is not None:
            cmap.meta_leader = self.meta_group.leader_id or ""
        for info in cmap.vnodes:
            vnode = self.vnodes.get(info.shard)
            if vnode is not None and vnode.group.leader_id:
                info.leader = vnode.group.leader_id
                info.term = vnode.group.raftCurrentTerm
        return cmap

    def node_status(self) -> clpb.NodeStatus:
        status = clpb.NodeStatus(node_id=self.node_id, address=self.config.advertised)
        groups = sorted(self._groups.items())
        for group_id, group in groups:
            st = group.status()
            vnode = self.vnodes.get(group_id)
            try:
                generations = len(vnode.replica.generations()) if vnode is not None else 0
            except MqdsError:  # the replica is closing: report what is known
                generations = 0
            status.replicas.add(
                group=group_id,
                role=_ROLES.get(st["role"], clpb.RAFT_ROLE_UNSPECIFIED),
                term=st["term"],
                leader=st["leader"],
                commit_index=st["commit_index"],
                applied_index=st["applied_index"],
                last_log_index=st["last_log_index"],
                log_entries=st["log_entries"],
                log_bytes=st["log_bytes"],
                members=st["members"],
                follower_lag=st["follower_lag"],
                match_index=st["match_index"],
                last_applied=st["last_applied"],
                snapshots_installed=group.snapshots_installed,
                generations=generations,
            )
        status.dropped_raft_messages = self.router.dropped_messages + self.router.dropped_frames
        status.ready = self.ready()
        return status

    # -- snapshots -----------------------------------------------------------------

    def _fetch_snapshot(self, node_id: str, shard: int, min_index: int, dest: str) -> int:
        """Copy ``node_id``'s replica of ``shard`` (applied at least to ``min_index``) into ``dest``."""
        stub = self.internal_stub(node_id)
        os.makedirs(dest, exist_ok=True)
        stream = stub.FetchSnapshot(
            rpb.FetchSnapshotRequest(group=shard, min_index=min_index),
            timeout=3600,
            metadata=self.auth.metadata(),
        )
        header: rpb.SnapshotHeader | None = None
        handles: dict[int, Any] = {}
        received = 0
        try:
            for chunk in stream:
                if chunk.HasField("header"):
                    header = chunk.header
                    for i, f in enumerate(header.files):
                        root = os.path.abspath(dest)
                        path = os.path.abspath(os.path.join(root, f.name))
                        if os.path.isabs(f.name) or os.path.commonpath([root, path]) != root or path == root:
                            raise errors.error(
                                Reason.INVALID_REQUEST, f"snapshot file {f.name!r} escapes its directory"
                            )
                        os.makedirs(os.path.dirname(path), exist_ok=True)
                        handles[i] = open(path, "wb")  # noqa: SIM115 - closed below
                    continue
                if header is None or chunk.chunk.file not in handles:
                    raise errors.error(Reason.INVALID_REQUEST, "snapshot stream out of order")
                handles[chunk.chunk.file].write(chunk.chunk.data)
                received += len(chunk.chunk.data)
            if header is None:
                raise errors.error(Reason.INVALID_REQUEST, "empty snapshot stream")
            for i, f in enumerate(header.files):
                fh = handles[i]
                fh.flush()
                if fh.tell() != f.size:
                    raise errors.error(
                        Reason.INVALID_REQUEST, f"snapshot file {f.name} is {fh.tell()} bytes, not {f.size}"
                    )
                os.fsync(fh.fileno())
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None
        finally:
            for fh in handles.values():
                fh.close()
        log.info("shard %d: fetched %d bytes of snapshot from %s", shard, received, node_id)
        self.metrics.snapshot_received(shard, received)
        return int(header.applied_index)

    def serve_snapshot(self, request: rpb.FetchSnapshotRequest) -> Iterator[rpb.SnapshotChunk]:
        vnode = self.vnode(request.group)
        directory = os.path.join(self._tmp_dir, f"snapshot-{request.group}-{uuid.uuid4().hex}")
        started = time.monotonic()
        sent = 0
        try:
            with vnode.replica.reading() as storage:
                if storage.applied_index < request.min_index:
                    raise errors.error(
                        Reason.NO_LEADER,
                        f"shard {request.group}: this replica applied {storage.applied_index}, "
                        f"behind the requested {request.min_index}",
                    )
                applied = storage.checkpoint(directory)
            files = []
            for root, _, names in os.walk(directory):
                for name in sorted(names):
                    path = os.path.join(root, name)
                    files.append((os.path.relpath(path, directory), path, os.path.getsize(path)))
            header = rpb.SnapshotHeader(applied_index=applied)
            for rel, _, size in files:
                header.files.add(name=rel, size=size)
            yield rpb.SnapshotChunk(header=header)
            for i, (_, path, _) in enumerate(files):
                with open(path, "rb") as fh:
                    while True:
                        data = fh.read(_CHUNK)
                        if not data:
                            break
                        yield rpb.SnapshotChunk(chunk=rpb.FileChunk(file=i, data=data))
                        sent += len(data)
            self.metrics.snapshot_sent(request.group, sent, time.monotonic() - started)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    # -- the internal Raft service -----------------------------------------------

    def _raft_handler(self) -> grpc.GenericRpcHandler:
        api = RaftAPI(self)
        descriptor = rpb.DESCRIPTOR.services_by_name["Raft"]
        handlers = unary_handlers(descriptor, api, rpb, self.metrics.requests)
        handlers["Stream"] = raft_stream_handler(self.router, self._peer_pool)
        handlers["FetchSnapshot"] = grpc.unary_stream_rpc_method_handler(
            api.FetchSnapshot,
            request_deserializer=rpb.FetchSnapshotRequest.FromString,
            response_serializer=rpb.SnapshotChunk.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)


def _public_descriptor_pool() -> descriptor_pool.DescriptorPool:
    """A descriptor pool of the public API's proto files (and what they import), for server reflection."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file: Any) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.Add(proto)
        added.add(file.name)

    for module in (pb, clpb, spb, health_pb2, reflection_pb2):
        add(module.DESCRIPTOR)
    return pool


def _add_generation(now: int, if_current: int) -> bytes:
    return cpb.VnodeCommand(add_generation=cpb.AddGeneration(now_us=now, if_current=if_current)).SerializeToString()


class ClusterAPI:
    """mqds.v1.Cluster: the cluster map, node status and membership administration."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def GetClusterMap(self, request: clpb.GetClusterMapRequest, context: Any = None) -> clpb.ClusterMap:
        return self.node.cluster_map()

    def GetNodeStatus(self, request: clpb.GetNodeStatusRequest, context: Any = None) -> clpb.NodeStatus:
        return self.node.node_status()

    def JoinNode(self, request: clpb.JoinNodeRequest, context: Any = None) -> clpb.MembershipResponse:
        return self.node.membership.join(request.node_id, request.address)

    def LeaveNode(self, request: clpb.LeaveNodeRequest, context: Any = None) -> clpb.MembershipResponse:
        return self.node.membership.leave(request.node_id)

    def ForgetNode(self, request: clpb.ForgetNodeRequest, context: Any = None) -> clpb.MembershipResponse:
        return self.node.membership.forget(request.node_id)

    def Rebalance(self, request: clpb.RebalanceRequest, context: Any = None) -> clpb.MembershipResponse:
        return self.node.membership.rebalance()

    def GetReplicaDigest(self, request: clpb.GetReplicaDigestRequest, context: Any = None) -> clpb.ReplicaDigest:
        replica = self.node.vnode(request.shard).replica
        for _ in range(50):
            with replica.reading() as storage:
                before = storage.applied_index
                digest = hashlib.sha256()
                keys = 0
                for cf, key, value in storage.dump():
                    for part in (cf.encode(), key, value):
                        digest.update(len(part).to_bytes(4, "big") + part)
                    keys += 1
                if storage.applied_index == before:
                    return clpb.ReplicaDigest(
                        shard=request.shard, applied_index=before, sha256=digest.hexdigest(), keys=keys
                    )
            time.sleep(0.05)
        raise errors.error(Reason.OVERLOADED, f"shard {request.shard} kept changing while being digested")


class RaftAPI:
    """mqds.server.raft.v1.Raft: what nodes ask each other (every call authenticated)."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def FetchSnapshot(self, request: rpb.FetchSnapshotRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            self.node.auth.check(context)
            yield from self.node.serve_snapshot(request)
        except MqdsError as err:
            context.abort_with_status(errors.to_status(err))

    def ChangeMembership(
        self, request: rpb.ChangeMembershipRequest, context: grpc.ServicerContext
    ) -> rpb.ChangeMembershipResponse:
        self.node.auth.check(context)
        group = self._led_group(request.group)
        add = request.kind == rpb.MembershipChange.KIND_ADD
        if not add and request.kind != rpb.MembershipChange.KIND_REMOVE:
            raise errors.error(Reason.INVALID_REQUEST, "membership change kind must be ADD or REMOVE")
        if add == (request.node_id in group.members):
            return rpb.ChangeMembershipResponse(members=group.members)
        if not add and request.node_id == self.node.node_id:
            raise errors.error(Reason.MEMBERSHIP_REFUSED, "a leader cannot remove itself; transfer leadership first")
        group.change_membership(add, request.node_id).wait(self.node.config.write_timeout_s)
        return rpb.ChangeMembershipResponse(members=group.members)

    def TransferLeadership(
        self, request: rpb.TransferLeadershipRequest, context: grpc.ServicerContext
    ) -> rpb.TransferLeadershipResponse:
        self.node.auth.check(context)
        self._led_group(request.group).transfer_leadership(request.node_id or None)
        return rpb.TransferLeadershipResponse()

    def ProposeMeta(self, request: rpb.ProposeMetaRequest, context: grpc.ServicerContext) -> rpb.ProposeMetaResponse:
        self.node.auth.check(context)
        group = self.node.meta_group
        if group is None or not group.is_leader:
            raise (group.not_leader_error() if group is not None else errors.error(Reason.NO_LEADER, "no metadata"))
        cpb.MetaCommand.FromString(request.command)
        group.propose(request.command).wait(self.node.config.write_timeout_s)
        return rpb.ProposeMetaResponse(index=group.raftLastApplied)

    def InjectFault(self, request: rpb.InjectFaultRequest, context: grpc.ServicerContext) -> rpb.InjectFaultResponse:
        self.node.auth.check(context)
        if not self.node.config.fault_injection:
            raise errors.error(Reason.UNAUTHENTICATED, "this node does not run with fault_injection enabled")
        self.node.router.block(list(request.blocked_peers))
        log.warning("fault injection: Raft traffic with %s dropped", list(request.blocked_peers) or "nobody")
        return rpb.InjectFaultResponse()

    def _led_group(self, group_id: int) -> RaftGroup:
        group = self.node.meta_group if group_id == META_GROUP else self.node.vnode(group_id).group
        if group is None:
            raise errors.error(Reason.NO_LEADER, "this node has no metadata replica")
        if not group.is_leader:
            raise group.not_leader_error()
        return group
