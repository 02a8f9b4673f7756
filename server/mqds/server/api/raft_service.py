"""The internal Raft service: what nodes ask each other.

Every method is the cluster's nodes' only (``Role.NODE`` in ``methods.py``):
the guard refuses a caller without the cluster secret before a request is
parsed, and runs the streams on the peer pool. ``Stream`` carries Raft
messages (``raft.transport``, which also reads the sender's id from the
call); ``FetchSnapshot`` streams a replica's checkpoint
(``mqds.server.node.snapshots``); the unary calls change a group's membership or
leader, forward a metadata change to the metadata leader, and inject faults
in chaos runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import grpc

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.server.api.handlers import unary_handlers
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.raft.group import META_GROUP
from mqds.server.raft.transport import raft_stream_handler
from mqds.server.raft.v1 import raft_pb2 as rpb

if TYPE_CHECKING:
    from mqds.server.cluster.vnode import Vnode
    from mqds.server.config import NodeConfig
    from mqds.server.metrics import RequestMetrics
    from mqds.server.raft.group import RaftGroup
    from mqds.server.raft.transport import PeerRouter

log = logging.getLogger(__name__)


class RaftNode(Protocol):
    """What the Raft service uses of the node (``mqds.server.node.node.Node``)."""

    @property
    def node_id(self) -> str: ...

    @property
    def config(self) -> NodeConfig: ...

    @property
    def router(self) -> PeerRouter: ...

    @property
    def meta_group(self) -> RaftGroup | None: ...

    def vnode(self, shard: int) -> Vnode: ...

    def serve_snapshot(self, request: rpb.FetchSnapshotRequest) -> Iterator[rpb.SnapshotChunk]: ...


def raft_handler(node: RaftNode, requests: RequestMetrics) -> grpc.GenericRpcHandler:
    """The service's handler (the guard places each call on its pool)."""
    api = RaftAPI(node)
    descriptor = rpb.DESCRIPTOR.services_by_name["Raft"]
    handlers = unary_handlers(descriptor, api, rpb, requests, streams=True)
    handlers["Stream"] = raft_stream_handler(node.router)
    return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)


class RaftAPI:
    """mqds.server.raft.v1.Raft: what nodes ask each other (the guard lets only nodes call)."""

    def __init__(self, node: RaftNode) -> None:
        self.node = node

    def FetchSnapshot(self, request: rpb.FetchSnapshotRequest) -> Iterator[rpb.SnapshotChunk]:
        return self.node.serve_snapshot(request)

    def ChangeMembership(self, request: rpb.ChangeMembershipRequest) -> rpb.ChangeMembershipResponse:
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

    def TransferLeadership(self, request: rpb.TransferLeadershipRequest) -> rpb.TransferLeadershipResponse:
        self._led_group(request.group).transfer_leadership(request.node_id or None)
        return rpb.TransferLeadershipResponse()

    def ProposeMeta(self, request: rpb.ProposeMetaRequest) -> rpb.ProposeMetaResponse:
        group = self.node.meta_group
        if group is None or not group.is_leader:
            raise (group.not_leader_error() if group is not None else errors.error(Reason.NO_LEADER, "no metadata"))
        try:
            cpb.MetaCommand.FromString(request.command)
        except Exception as err:  # DecodeError, or a RuntimeError from upb
            raise errors.error(Reason.MALFORMED_REQUEST, f"command is not a metadata command ({err})") from None
        group.propose(request.command).wait(self.node.config.write_timeout_s)
        return rpb.ProposeMetaResponse(index=group.raft.last_applied)

    def InjectFault(self, request: rpb.InjectFaultRequest) -> rpb.InjectFaultResponse:
        if not self.node.config.fault_injection:
            raise errors.error(Reason.UNAUTHENTICATED, "this node does not run with fault_injection enabled")
        self.node.router.block(list(request.blocked_peers))
        log.warning("fault injection: Raft traffic with %s dropped", list(request.blocked_peers) or "nobody")
        return rpb.InjectFaultResponse()

    def LinkAddress(self, request: rpb.LinkAddressRequest) -> rpb.LinkAddressResponse:
        return rpb.LinkAddressResponse(port=self.node.router.tcp_port)

    def _led_group(self, group_id: int) -> RaftGroup:
        group = self.node.meta_group if group_id == META_GROUP else self.node.vnode(group_id).group
        if group is None:
            raise errors.error(Reason.NO_LEADER, "this node has no metadata replica")
        if not group.is_leader:
            raise group.not_leader_error()
        return group
