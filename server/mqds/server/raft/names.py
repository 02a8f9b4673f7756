"""How groups and their members are named: the metadata group's id, a group's display name, a member.

Below every other module of the package (futures, snapshots and the group all
name groups and members), so none of them needs to import ``group.py``.
"""

from __future__ import annotations

from pysyncobj.node import Node

from mqds.protocol.cluster_view import META_GROUP

__all__ = ["META_GROUP", "PeerNode", "group_name"]


def group_name(group: int) -> str:
    return "meta" if group == META_GROUP else f"shard {group}"


class PeerNode(Node):
    """A Raft member, known by its node id; its address lives in the router's address book."""

    def __init__(self, node_id: str) -> None:
        super().__init__(node_id)

    # pysyncobj keys its per-peer state (next and match indexes, connections)
    # by node objects: a leader's cycle hashes and compares them a few hundred
    # times per Raft round. Reading ``_id`` directly skips pysyncobj's ``id``
    # property on every one of those; the pickled form stays the same.
    def __hash__(self) -> int:
        return hash(self._id)

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Node) and self._id == other._id)
