"""The public Cluster service: the cluster map, node status, membership administration, replica digests.

Membership changes are carried out by ``cluster.membership.Membership``;
this service reads the node's state and hands requests over.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from mqds.protocol.retention import check_limits, check_rules, format_limits, format_period
from mqds.server.api import replica_digest
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.v1 import cluster_pb2 as clpb

if TYPE_CHECKING:
    from mqds.server.cluster.membership import Membership
    from mqds.server.cluster.vnode import Vnode
    from mqds.server.config import NodeConfig
    from mqds.server.diskusage import DiskUsage
    from mqds.server.raft.group import RaftGroup
    from mqds.server.raft.transport import PeerRouter

log = logging.getLogger(__name__)

_ROLES = {0: clpb.RAFT_ROLE_FOLLOWER, 1: clpb.RAFT_ROLE_CANDIDATE, 2: clpb.RAFT_ROLE_LEADER}


class ClusterNode(Protocol):
    """What the Cluster service reads of the node (``mqds.server.node.node.Node``)."""

    @property
    def node_id(self) -> str: ...

    @property
    def config(self) -> NodeConfig: ...

    @property
    def membership(self) -> Membership: ...

    @property
    def router(self) -> PeerRouter: ...

    @property
    def vnodes(self) -> Mapping[int, Vnode]: ...

    def groups(self) -> list[tuple[int, RaftGroup]]: ...

    def vnode(self, shard: int) -> Vnode: ...

    def cluster_map(self) -> clpb.ClusterMap: ...

    def propose_meta(self, command: cpb.MetaCommand, timeout_s: float | None = None) -> Any: ...

    def ready(self) -> bool: ...

    @property
    def disk_usage(self) -> DiskUsage: ...


def node_status(node: ClusterNode) -> clpb.NodeStatus:
    """This node's replicas, their Raft state, and whether the node is ready."""
    status = clpb.NodeStatus(node_id=node.node_id, address=node.config.advertised)
    disk = node.disk_usage
    usage = disk.usage
    group_bytes = usage.group_bytes if usage is not None else {}
    for group_id, group in node.groups():
        st = group.status()
        vnode = node.vnodes.get(group_id)
        # Never waits: not for a snapshot being swapped in, nor for a write holding the storage's lock.
        generations = vnode.replica.storage.generation_count if vnode is not None else 0
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
            disk_bytes=group_bytes.get(group_id, 0),
        )
    if usage is not None:
        status.data_dir_bytes = usage.data_bytes
        status.disk_free_bytes = usage.free_bytes
        status.disk_total_bytes = usage.total_bytes
        status.raft_wal_bytes = usage.wal_bytes
    status.disk_quota_bytes = disk.quota_bytes
    status.disk_min_free_bytes = disk.min_free_bytes
    status.writes_refused = disk.refusal or ""
    status.dropped_raft_messages = node.router.dropped_messages + node.router.dropped_frames
    status.ready = node.ready()
    return status


class ClusterAPI:
    """mqds.v1.Cluster: the cluster map, node status and membership administration."""

    def __init__(self, node: ClusterNode) -> None:
        self.node = node
        self._digests = replica_digest.DigestLimiter(node.config.digest_rate_bytes)

    def GetClusterMap(self, request: clpb.GetClusterMapRequest, context: Any = None) -> clpb.ClusterMap:
        return self.node.cluster_map()

    def GetNodeStatus(self, request: clpb.GetNodeStatusRequest, context: Any = None) -> clpb.NodeStatus:
        return node_status(self.node)

    def JoinNode(self, request: clpb.JoinNodeRequest, context: Any = None) -> clpb.MembershipResponse:
        return self.node.membership.join(request.node_id, request.address)

    def LeaveNode(self, request: clpb.LeaveNodeRequest, context: Any = None) -> clpb.MembershipResponse:
        return self.node.membership.leave(request.node_id)

    def ForgetNode(self, request: clpb.ForgetNodeRequest, context: Any = None) -> clpb.MembershipResponse:
        return self.node.membership.forget(request.node_id)

    def Rebalance(self, request: clpb.RebalanceRequest, context: Any = None) -> clpb.MembershipResponse:
        return self.node.membership.rebalance()

    def SetRetention(self, request: clpb.SetRetentionRequest, context: Any = None) -> clpb.ClusterMap:
        policy = request.policy
        check_rules([(r.topic_filter, r.period_s) for r in policy.rules], policy.default_s)
        check_limits(policy.rules)
        self.node.propose_meta(cpb.MetaCommand(set_retention=cpb.SetRetention(policy=policy)))
        log.info(
            "retention policy set: %s; default %s",
            ", ".join(
                ",".join(filter(None, (f"{r.topic_filter}={format_period(r.period_s)}", format_limits(r))))
                for r in policy.rules
            )
            or "no rules",
            format_period(policy.default_s),
        )
        # Committed; this node may not have applied it yet (a follower of the metadata group).
        cmap = self.node.cluster_map()
        cmap.retention.CopyFrom(policy)
        return cmap

    def GetReplicaDigest(self, request: clpb.GetReplicaDigestRequest, context: Any = None) -> clpb.ReplicaDigest:
        """One pass over the replica at one applied index, paced and cancellable (``replica_digest.py``)."""
        return replica_digest.digest(self.node.vnode(request.shard).replica, self._digests, context)
