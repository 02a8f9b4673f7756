"""The steps of a replica move that talk to a vnode's Raft group, run from the metadata leader.

``Membership`` decides the moves (``membership.py``); these carry out each one
on the vnode: find its current leader (asking the nodes that host it), add or
remove a member through that leader, move leadership, wait until a new member
holds and applied everything committed when it was added, and retry a step
that failed for a reason worth retrying, for up to ``STEP_TIMEOUT_S``. Each
step first checks that this node still leads the metadata group, so a node
that lost leadership stops at its next step and the caller retries on the
new leader.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol, TypeVar

import grpc

from mqds.protocol import errors
from mqds.protocol.cluster_view import ClusterView
from mqds.protocol.errors import MqdsError, Reason
from mqds.server.cluster import meta as meta_mod
from mqds.server.raft.group import RaftGroup
from mqds.server.raft.v1 import raft_pb2 as rpb
from mqds.v1 import cluster_pb2 as clpb

if TYPE_CHECKING:
    from mqds.server.cluster.vnode import Vnode
    from mqds.server.config import NodeConfig
    from mqds.server.raft.cluster_auth import ClusterAuth
    from mqds.server.raft.v1 import raft_pb2_grpc as rpb_grpc
    from mqds.v1 import cluster_pb2_grpc as clpb_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

STEP_TIMEOUT_S = 1800.0
"""How long one step of a move may take, retries and catching up included (a catch-up may need a big snapshot)."""
_POLL_S = 0.2


class VnodeStepsNode(Protocol):
    """What the steps use of the node they run on (``mqds.server.node.node.Node``)."""

    @property
    def config(self) -> NodeConfig: ...

    @property
    def meta(self) -> meta_mod.MetaMachine | None: ...

    @property
    def vnodes(self) -> Mapping[int, Vnode]: ...

    @property
    def auth(self) -> ClusterAuth: ...

    def cluster_stub(self, node_id: str) -> clpb_grpc.ClusterStub: ...

    def internal_stub(self, node_id: str) -> rpb_grpc.RaftStub: ...


class VnodeSteps:
    """Steps on one vnode's Raft group at a time: its leader, its members, its leadership, a member's catch-up."""

    def __init__(self, node: VnodeStepsNode, meta_leader: Callable[[], RaftGroup]) -> None:
        self.node = node
        # The metadata group while this node leads it; raises NOT_LEADER (or NO_LEADER) once it does not.
        self._meta_leader = meta_leader

    def _map(self) -> clpb.ClusterMap:
        assert self.node.meta is not None
        return self.node.meta.map

    def leader(self, shard: int) -> str:
        """The current leader of a vnode, asked of the nodes that host it."""
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while True:
            local = self.node.vnodes.get(shard)
            if local is not None and local.group.leader_id:
                return local.group.leader_id
            view = ClusterView()
            for replica in meta_mod.placement_of(self._map())[shard]:
                try:
                    view.merge(
                        self.node.cluster_stub(replica).GetClusterMap(
                            clpb.GetClusterMapRequest(), timeout=2, metadata=self.node.auth.metadata()
                        )
                    )
                except (grpc.RpcError, MqdsError):
                    continue
            if shard in view.leaders:
                return view.leaders[shard][1]
            self._meta_leader()
            if time.monotonic() > deadline:
                raise errors.error(Reason.NO_LEADER, f"shard {shard} has no leader")
            time.sleep(_POLL_S)

    def status(self, node_id: str, shard: int) -> clpb.ReplicaStatus | None:
        try:
            status = self.node.cluster_stub(node_id).GetNodeStatus(
                clpb.GetNodeStatusRequest(), timeout=5, metadata=self.node.auth.metadata()
            )
        except grpc.RpcError:
            return None
        return next((r for r in status.replicas if r.group == shard), None)

    def change(self, shard: int, node_id: str, add: bool) -> None:
        leader = self.leader(shard)
        stub = self.node.internal_stub(leader)
        kind = rpb.MembershipChange.KIND_ADD if add else rpb.MembershipChange.KIND_REMOVE
        try:
            stub.ChangeMembership(
                rpb.ChangeMembershipRequest(group=shard, kind=kind, node_id=node_id),
                timeout=self.node.config.write_timeout_s + 5,
                metadata=self.node.auth.metadata(),
            )
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None

    def transfer(self, shard: int, target: str) -> None:
        """Move leadership of ``shard`` to ``target`` (any other member when empty) and wait for it."""
        leader = self.leader(shard)
        if leader == target:
            return
        try:
            self.node.internal_stub(leader).TransferLeadership(
                rpb.TransferLeadershipRequest(group=shard, node_id=target),
                timeout=10,
                metadata=self.node.auth.metadata(),
            )
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            now = self.leader(shard)
            if now == target or (not target and now != leader):
                return
            time.sleep(_POLL_S)
        raise errors.error(Reason.NO_LEADER, f"shard {shard}: leadership did not move to {target or 'another replica'}")

    def wait_caught_up(self, shard: int, target: str) -> None:
        """Until the target holds and applied everything committed when the wait began."""
        deadline = time.monotonic() + STEP_TIMEOUT_S
        last_report = time.monotonic()
        goal: int | None = None
        while time.monotonic() < deadline:
            self._meta_leader()
            leader = self.leader(shard)
            status = self.status(leader, shard)
            if status is not None and target in status.members:
                if goal is None:
                    goal = status.commit_index
                match = status.match_index.get(target, 0)
                if match >= goal:
                    target_status = self.status(target, shard)
                    if target_status is not None and target_status.last_applied >= goal:
                        return
                if time.monotonic() - last_report > 5:
                    log.info("shard %d: %s catching up (%d of %d)", shard, target, match, goal)
                    last_report = time.monotonic()
            time.sleep(_POLL_S)
        raise errors.error(Reason.DEADLINE_EXCEEDED, f"shard {shard}: {target} did not catch up in time")

    def retry(self, step: Callable[[], T]) -> T:
        """Run a step until it works, retrying what is worth retrying, within STEP_TIMEOUT_S."""
        deadline = time.monotonic() + STEP_TIMEOUT_S
        delay = _POLL_S
        while True:
            self._meta_leader()  # a node that lost leadership stops here, and the caller retries on the new one
            try:
                return step()
            except MqdsError as err:
                if not err.retriable or time.monotonic() > deadline:
                    raise
                log.info("retrying after: %s", err)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
