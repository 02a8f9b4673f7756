"""Channels to the other nodes of the cluster, for the calls a node makes to another.

Raft traffic has links of its own (``raft.transport``); these channels carry
the rest: metadata proposals forwarded to the metadata leader, snapshot
fetches, membership steps and status polls. One channel per address, opened
on first use (with the node's TLS and the router's options) and kept until
the node stops.
"""

from __future__ import annotations

import threading

import grpc

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.server.raft.transport import PeerRouter
from mqds.server.raft.v1 import raft_pb2_grpc as rpb_grpc
from mqds.v1 import cluster_pb2_grpc as clpb_grpc


class Peers:
    """gRPC stubs of other nodes, by node id (addresses as the router knows them) or by address."""

    def __init__(self, router: PeerRouter) -> None:
        self.router = router
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = self.router.open_channel(address)
            return channel

    def address(self, node_id: str) -> str:
        address = self.router.address_of(node_id)
        if not address:
            raise errors.error(Reason.UNKNOWN_NODE, f"no address known for node {node_id}")
        return address

    def internal_stub(self, node_id: str) -> rpb_grpc.RaftStub:
        """The internal Raft service of another node (calls need ``auth.metadata()``)."""
        return rpb_grpc.RaftStub(self.channel(self.address(node_id)))

    def cluster_stub(self, node_id: str) -> clpb_grpc.ClusterStub:
        """The public Cluster service of a node (this one included)."""
        return clpb_grpc.ClusterStub(self.channel(self.address(node_id)))

    def close(self) -> None:
        with self._lock:
            channels = list(self._channels.values())
        for channel in channels:
            channel.close()
