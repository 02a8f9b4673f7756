"""What a caller knows of the cluster: node addresses, shard placement, and shard leaders with their terms.

Shared by the client's routing and by the nodes themselves (membership asks
peers for their maps and merges them the same way), so it lives in the
protocol package, which both sides import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mqds.v1 import cluster_pb2 as clpb

__all__ = ["META_GROUP", "ClusterView"]

META_GROUP = 0xFFFFFFFF
"""The group number of the cluster metadata's Raft group (``ReplicaStatus.group``); vnode groups are their shards."""


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
    retention: clpb.RetentionPolicy | None = None
    """The cluster's retention policy, once one was set."""

    def merge(self, cmap: clpb.ClusterMap) -> None:
        if cmap.version >= self.version:
            self.version = cmap.version
            self.n_shards = cmap.n_shards
            self.cluster_id = cmap.cluster_id
            self.addresses.update({n.id: n.address for n in cmap.nodes})
            self.replicas = {v.shard: list(v.replicas) for v in cmap.vnodes}
            self.retention = cmap.retention if cmap.HasField("retention") else None
        if cmap.meta_leader:
            self.meta_leader = cmap.meta_leader
        for v in cmap.vnodes:
            if v.leader and v.term >= self.leaders.get(v.shard, (-1, ""))[0]:
                self.leaders[v.shard] = (v.term, v.leader)

    def to_pb(self) -> clpb.ClusterMap:
        """The view as a ``ClusterMap`` (what ``Client.cluster_map`` returns)."""
        cmap = clpb.ClusterMap(
            cluster_id=self.cluster_id, n_shards=self.n_shards, version=self.version, meta_leader=self.meta_leader
        )
        if self.retention is not None:
            cmap.retention.CopyFrom(self.retention)
        for node_id, address in sorted(self.addresses.items()):
            cmap.nodes.add(id=node_id, address=address)
        for shard in range(self.n_shards):
            term, leader = self.leaders.get(shard, (0, ""))
            cmap.vnodes.add(shard=shard, replicas=self.replicas.get(shard, []), leader=leader, term=term)
        return cmap
