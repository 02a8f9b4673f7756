"""Replica moves when leadership comes back to the replica being removed.

The metadata leader moves leadership off a replica and then asks the vnode's
leader to remove it; between the two an election or the leader balancer can
make that replica leader again. The move must then try again, not fail.
"""

from __future__ import annotations

import types

import pytest

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.server.cluster import membership as membership_mod
from mqds.server.cluster import meta as meta_mod
from mqds.server.cluster import placement
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.v1 import cluster_pb2 as clpb


class FakeVnode:
    """A vnode's Raft group as the move sees it: a leader and members."""

    def __init__(self, members: list[str], leader: str) -> None:
        self.members = list(members)
        self.leader = leader


class FakeNode:
    """Just what Membership reads and proposes: the map and the metadata log."""

    def __init__(self, replicas: list[str]) -> None:
        cmap = clpb.ClusterMap(n_shards=1, replication_factor=len(replicas))
        cmap.vnodes.add(shard=0, replicas=replicas)
        self.meta = types.SimpleNamespace(map=cmap)
        self.proposed: list[list[str]] = []

    def propose_meta(self, command: cpb.MetaCommand) -> None:
        assert command.WhichOneof("kind") == "set_replicas", command
        vnode = next(v for v in self.meta.map.vnodes if v.shard == command.set_replicas.shard)
        del vnode.replicas[:]
        vnode.replicas.extend(command.set_replicas.replicas)
        self.proposed.append(list(command.set_replicas.replicas))


class Bouncing(membership_mod.Membership):
    """A Membership whose vnode hands leadership back to ``source`` ``bounces`` times."""

    def __init__(self, node: FakeNode, vnode: FakeVnode, source: str, bounces: int) -> None:
        super().__init__(node)  # type: ignore[arg-type]
        self.vnode = vnode
        self.source = source
        self.bounces = bounces
        self.transfers: list[str] = []

    def _vnode_leader(self, shard: int) -> str:
        return self.vnode.leader

    def _wait_caught_up(self, shard: int, target: str) -> None:
        assert target in self.vnode.members

    def _transfer(self, shard: int, target: str) -> None:
        self.transfers.append(target)
        self.vnode.leader = target or next(m for m in self.vnode.members if m != self.vnode.leader)

    def _change(self, shard: int, node_id: str, add: bool) -> None:
        if add:
            self.vnode.members.append(node_id)
            return
        if self.bounces:
            # The balancer (or an election) gave leadership back just now.
            self.bounces -= 1
            self.vnode.leader = self.source
        if node_id == self.vnode.leader:
            raise errors.error(Reason.MEMBERSHIP_REFUSED, "a leader cannot remove itself; transfer leadership first")
        self.vnode.members.remove(node_id)


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(membership_mod.time, "sleep", lambda _s: None)


def test_a_move_succeeds_when_leadership_returns_to_the_source_before_its_removal() -> None:
    node = FakeNode(["a", "b", "c"])
    vnode = FakeVnode(["a", "b", "c"], leader="a")
    moves = Bouncing(node, vnode, source="a", bounces=2)
    moves._execute(placement.Move(shard=0, source="a", target="d"))
    assert vnode.members == ["b", "c", "d"]
    assert vnode.leader != "a"
    # The target takes the source's place, so it becomes the preferred leader.
    assert meta_mod.placement_of(node.meta.map)[0] == ["d", "b", "c"]
    # The first transfer aims at the new replica; after a bounce any replica will do.
    assert moves.transfers[0] == "d"
    assert moves.transfers[1:] == ["", ""]


def test_the_source_stops_being_the_preferred_leader_before_leadership_moves() -> None:
    node = FakeNode(["a", "b", "c"])
    vnode = FakeVnode(["a", "b", "c"], leader="a")
    Bouncing(node, vnode, source="a", bounces=0)._execute(placement.Move(shard=0, source="a", target="d"))
    # Added first, then reordered so the balancer no longer hands leadership to "a".
    assert node.proposed[0] == ["a", "b", "c", "d"]
    assert node.proposed[1][0] != "a" and node.proposed[1][-1] == "a"


def test_a_refusal_for_another_reason_is_not_retried() -> None:
    node = FakeNode(["a", "b", "c"])
    vnode = FakeVnode(["a", "b", "c"], leader="b")

    class Refusing(Bouncing):
        def _change(self, shard: int, node_id: str, add: bool) -> None:
            if not add:
                raise errors.error(Reason.MEMBERSHIP_REFUSED, "refused for a reason of its own")
            super()._change(shard, node_id, add)

    with pytest.raises(MqdsError) as caught:
        Refusing(node, vnode, source="a", bounces=0)._execute(placement.Move(shard=0, source="a", target="d"))
    assert caught.value.reason == Reason.MEMBERSHIP_REFUSED
