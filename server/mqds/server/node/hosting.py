"""The replicas a node hosts: the metadata group's and one per vnode the cluster map places here.

``Hosting`` owns every Raft group of the node: it opens the metadata replica
(at start, or once a joiner was admitted), opens the vnode replicas the map
places here and deletes the ones it moved away (``reconcile``), and answers
what the API layer asks of them: which replica serves a shard, whether this
node leads it, a proposal to its leader, a metadata change logged on the
metadata leader wherever it is.

It sees no other part of the node: what it needs (the Raft log and router,
peers to forward metadata proposals to, how to fetch a snapshot) is handed to
it by the composition root.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.server.auth import time_left
from mqds.server.cluster import growth
from mqds.server.cluster import meta as meta_mod
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.cluster.vnode import Vnode, VnodeReplica
from mqds.server.config import NodeConfig
from mqds.server.diskusage import DiskUsage
from mqds.server.node.datadir import DataDir
from mqds.server.node.peers import Peers
from mqds.server.raft.cluster_auth import ClusterAuth
from mqds.server.raft.group import META_GROUP, ROLE_LEADER, PendingRead, RaftGroup, RaftTiming
from mqds.server.raft.journal import NodeLog
from mqds.server.raft.scheduler import RaftScheduler
from mqds.server.raft.transport import PeerRouter
from mqds.server.raft.v1 import raft_pb2 as rpb
from mqds.server.storage import Engine
from mqds.v1 import cluster_pb2 as clpb

log = logging.getLogger(__name__)

FetchSnapshot = Callable[[str, int, int, str], int]
"""(node_id, shard, min_index, dest) -> the applied index of the snapshot copied into dest."""


def add_generation_command(now: int, if_current: int) -> bytes:
    """A VnodeCommand starting a new generation at ``now`` if ``if_current`` is still the current one."""
    return cpb.VnodeCommand(add_generation=cpb.AddGeneration(now_us=now, if_current=if_current)).SerializeToString()


class Hosting:
    """The Raft groups and vnode replicas of one node, and the rules to reach them."""

    def __init__(
        self,
        config: NodeConfig,
        data_dir: DataDir,
        *,
        engine: Engine,
        raft_log: NodeLog,
        router: PeerRouter,
        timing: RaftTiming,
        auth: ClusterAuth,
        peers: Peers,
        clock: Callable[[], int],
        fetch_snapshot: FetchSnapshot,
        stopping: threading.Event,
        changed: threading.Event,
        disk_usage: DiskUsage | None = None,
    ) -> None:
        self.config = config
        self.disk_usage = disk_usage
        """Admission control (``diskusage.py``): None takes every message."""
        self.node_id = config.node_id
        self.data_dir = data_dir
        self.engine = engine
        self.raft_log = raft_log
        self.router = router
        self.timing = timing
        self.auth = auth
        self.peers = peers
        self.clock = clock
        self._fetch_snapshot = fetch_snapshot
        self._stopping = stopping
        self._changed = changed
        """Set on every change the maintenance loop should act on: a new role, a new cluster map."""
        self._lock = threading.RLock()
        self.scheduler = RaftScheduler(config.raft_pass_threads, config.raft_long_step_threads)
        """Steps every group hosted here (``raft/scheduler.py``): no thread per group."""
        self._groups: dict[int, RaftGroup] = {}
        self.vnodes: dict[int, Vnode] = {}
        self.meta: meta_mod.MetaMachine | None = None
        self.meta_group: RaftGroup | None = None
        self.dropped_by_closed_groups = 0
        """Raft messages from non-members that groups since closed here had dropped (the metrics keep counting)."""

    # -- what is hosted ----------------------------------------------------------

    def groups(self) -> list[tuple[int, RaftGroup]]:
        """The Raft groups hosted here, by group id (a copy: safe to use from any thread)."""
        return sorted(list(self._groups.items()), key=lambda item: item[0])

    def hosted_vnodes(self) -> list[tuple[int, Vnode]]:
        """The vnode replicas hosted here, by shard (a copy)."""
        return sorted(list(self.vnodes.items()), key=lambda item: item[0])

    def release_logs(self) -> None:
        """The disk is past a limit: every replica hosted here flushes its memtables (so its RocksDB logs go), and
        every group compacts its Raft log at its next cycle that may (so dead log segments go)."""
        for _, vnode in self.hosted_vnodes():
            with vnode.replica.reading() as storage:
                storage.release_logs()
        for _, group in self.groups():
            group.compact_soon()

    def group_of(self, group: int) -> RaftGroup | None:
        """The group a Raft message is for (the router's lookup)."""
        return self._groups.get(group)

    def link_changed(self, node_id: str, connected: bool) -> None:
        for group in list(self._groups.values()):
            group.peer_connected(node_id, connected)

    # -- opening and closing replicas --------------------------------------------

    def _new_group(
        self,
        group_id: int,
        members: list[str],
        machine: Any,
        directory: str,
        joining: bool,
        admit: Callable[[bytes], None] | None = None,
    ) -> RaftGroup:
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
            on_disk_failure=self.raft_log.fail,
            admit=admit,
            scheduler=self.scheduler,
        )
        self._groups[group_id] = group
        for member in group.members:
            if member != self.node_id and self.router.is_connected(member):
                group.peer_connected(member, True)
        return group

    def _role_changed(self, group: RaftGroup, old: int, new: int) -> None:
        """Called inside the group's cycle when its role changes."""
        if new == ROLE_LEADER:
            vnode = self.vnodes.get(group.group)
            if vnode is not None and group.group != META_GROUP and not vnode.replica.storage.initialized:
                # A new vnode's first generation starts with a logged
                # command, so every replica records the same creation time.
                group.propose(add_generation_command(self.clock(), 0))
        self._changed.set()

    def open_meta(self, initial: cpb.ClusterState | None, joining: bool) -> None:
        """Open the metadata replica: from its state on disk (``initial`` None), or from ``initial``."""
        directory = self.data_dir.meta_dir
        machine = meta_mod.MetaMachine(os.path.join(directory, "state"), initial)
        members = [n.id for n in machine.map.nodes]
        self.meta = machine
        self.meta_group = self._new_group(META_GROUP, members, machine, os.path.join(directory, "raft"), joining)
        machine.on_change(self._meta_changed)
        self._learn_addresses()

    def join(self, initial: cpb.ClusterState) -> None:
        """Open and start the metadata replica of a node just admitted to a cluster."""
        with self._lock:
            self.open_meta(initial, joining=True)
        assert self.meta_group is not None
        self.meta_group.start()

    def _meta_changed(self) -> None:
        self._learn_addresses()
        self._changed.set()

    def _learn_addresses(self) -> None:
        assert self.meta is not None
        for node in self.meta.map.nodes:
            if node.id != self.node_id:
                self.router.set_address(node.id, node.address)

    def _open_vnode(self, shard: int, members: list[str], joining: bool) -> Vnode:
        db_path, raft_dir = self.data_dir.vnode_paths(shard)
        replica = VnodeReplica(
            shard,
            db_path,
            self.engine,
            node_id=self.node_id,
            fetch_snapshot=self._fetch_snapshot,
            lts_threshold_top=self.config.lts_threshold_top,
            lts_threshold=self.config.lts_threshold,
            feed_bytes=self.config.follow_feed_bytes,
        )
        try:
            group = self._new_group(shard, members, replica, raft_dir, joining, self._admission(shard, replica))
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
            for path in self.data_dir.vnode_paths(shard):
                shutil.rmtree(path, ignore_errors=True)
            log.info("shard %d: replica removed from this node", shard)

    def meta_caught_up(self) -> bool:
        group = self.meta_group
        if group is None or group.leader_id is None:
            return False
        status = group.status()
        return bool(status["last_applied"] >= max(status["leader_commit"], status["commit_index"]))

    def reconcile(self) -> None:
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
                    _, raft_dir = self.data_dir.vnode_paths(shard)
                    joining = not fresh and not os.path.exists(raft_dir)
                    self._open_vnode(shard, replicas, joining)
            stale = [s for s in self.vnodes if s not in wanted]
        if stale and self.meta_caught_up():
            for shard in stale:
                self._close_vnode(shard, delete=True)

    def retire(self) -> None:
        """The node is stopping: no group campaigns or accepts leadership from here on."""
        for group in list(self._groups.values()):
            group.retire()

    def hand_off_leadership(self, timeout_s: float) -> None:
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

    def close(self) -> None:
        """Stop every group and close every replica (the metadata group's last)."""
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
        self.scheduler.stop()

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

    def _check_disk(self, shard: int) -> None:
        """Refuse what needs this node's log while its disk has failed (the guard restarts it once it is back)."""
        failure = self.raft_log.failure
        if failure is not None:
            raise errors.error(
                Reason.UNAVAILABLE,
                f"node {self.node_id}'s disk failed ({failure}): it left its Raft groups and restarts once the disk "
                "takes writes again; another replica takes over",
                shard=str(shard),
            )

    def _admission(self, shard: int, replica: VnodeReplica) -> Callable[[bytes], None]:
        """The check every command proposed to ``shard``'s group passes (``RaftGroup.admit``): while this node's
        disk is past a limit, one that adds data (``cluster/growth.py``) is refused with STORAGE_FULL."""

        def exists(key: bytes) -> bool:
            with replica.reading() as storage:
                return storage.meta_get(key) is not None

        def admit(body: bytes) -> None:
            refusal = self.disk_usage.admits() if self.disk_usage is not None else None
            if refusal is None:
                return
            what = growth.adds(body, exists)
            if what is not None:
                raise errors.error(
                    Reason.STORAGE_FULL,
                    f"{refusal}: the vnodes it leads take nothing that adds data ({what} here) until space "
                    "returns (retention, or dropping generations, frees it; reads, deletes and what removes or "
                    "updates state go on)",
                    shard=str(shard),
                )

        return admit

    def leader_vnode(self, shard: int) -> Vnode:
        self._check_disk(shard)
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
        self._check_disk(shard)
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
            self.peers.internal_stub(leader).ProposeMeta(
                rpb.ProposeMetaRequest(command=command.SerializeToString()),
                timeout=timeout,
                metadata=self.auth.metadata(),
            )
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None
        return None

    def cluster_map(self) -> clpb.ClusterMap:
        """The map this node applied, with the leaders and terms it knows of."""
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
                info.term = vnode.group.raft.term
        return cmap
