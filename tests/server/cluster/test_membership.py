"""Replica moves when leadership comes back to the replica being removed.

The metadata leader moves leadership off a replica and then asks the vnode's
leader to remove it; between the two an election or the leader balancer can
make that replica leader again. The move must then try again, not fail.
And a node that loses the metadata leadership in the middle of a move stops.
"""

from __future__ import annotations

import types

import pytest

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.server.cluster import membership as membership_mod
from mqds.server.cluster import meta as meta_mod
from mqds.server.cluster import placement, vnode_steps
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.v1 import cluster_pb2 as clpb


class FakeVnode:
    """A vnode's Raft group as the move sees it: a leader and members."""

    def __init__(self, members: list[str], leader: str) -> None:
        self.members = list(members)
        self.leader = leader


class FakeMetaGroup:
    """The metadata group on the node running the move: it leads for ``leads_for`` more proposals."""

    def __init__(self, node: FakeNode, leads_for: int) -> None:
        self.node = node
        self.leads_for = leads_for

    @property
    def is_leader(self) -> bool:
        return self.leads_for > 0

    def not_leader_error(self) -> MqdsError:
        return errors.error(Reason.NOT_LEADER, "this node is not the leader of meta; its leader is z", leader="z")

    def propose(self, body: bytes) -> types.SimpleNamespace:
        """Logged and applied here at once (a leader applies before the proposal's wait returns)."""
        assert self.is_leader, "a metadata change proposed by a node that does not lead"
        self.leads_for -= 1
        command = cpb.MetaCommand.FromString(body)
        assert command.WhichOneof("kind") == "set_replicas", command
        vnode = next(v for v in self.node.meta.map.vnodes if v.shard == command.set_replicas.shard)
        del vnode.replicas[:]
        vnode.replicas.extend(command.set_replicas.replicas)
        self.node.proposed.append(list(command.set_replicas.replicas))
        return types.SimpleNamespace(wait=lambda _timeout_s: None)


class FakeNode:
    """Just what Membership reads and proposes: the map and the metadata log."""

    def __init__(self, replicas: list[str], leads_for: int = 1000) -> None:
        cmap = clpb.ClusterMap(n_shards=1, replication_factor=len(replicas))
        cmap.vnodes.add(shard=0, replicas=replicas)
        self.meta = types.SimpleNamespace(map=cmap)
        self.meta_group = FakeMetaGroup(self, leads_for)
        self.config = types.SimpleNamespace(write_timeout_s=10.0)
        self.proposed: list[list[str]] = []


class BouncingSteps(vnode_steps.VnodeSteps):
    """A vnode whose Raft group hands leadership back to ``source`` ``bounces`` times."""

    def __init__(self, moves: membership_mod.Membership, vnode: FakeVnode, source: str, bounces: int) -> None:
        super().__init__(moves.node, moves._meta_leader)
        self.vnode = vnode
        self.source = source
        self.bounces = bounces
        self.transfers: list[str] = []

    def leader(self, shard: int) -> str:
        return self.vnode.leader

    def wait_caught_up(self, shard: int, target: str) -> None:
        assert target in self.vnode.members

    def transfer(self, shard: int, target: str) -> None:
        self.transfers.append(target)
        self.vnode.leader = target or next(m for m in self.vnode.members if m != self.vnode.leader)

    def change(self, shard: int, node_id: str, add: bool) -> None:
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


def bouncing(
    node: FakeNode, vnode: FakeVnode, source: str, bounces: int, steps: type[BouncingSteps] = BouncingSteps
) -> membership_mod.Membership:
    """A Membership of ``node`` whose steps on the vnode are ``steps``."""
    moves = membership_mod.Membership(node)  # type: ignore[arg-type]
    moves.steps = steps(moves, vnode, source, bounces)
    return moves


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(membership_mod.time, "sleep", lambda _s: None)
    monkeypatch.setattr(vnode_steps.time, "sleep", lambda _s: None)


def test_a_move_succeeds_when_leadership_returns_to_the_source_before_its_removal() -> None:
    node = FakeNode(["a", "b", "c"])
    vnode = FakeVnode(["a", "b", "c"], leader="a")
    moves = bouncing(node, vnode, source="a", bounces=2)
    moves._execute(placement.Move(shard=0, source="a", target="d"))
    assert vnode.members == ["b", "c", "d"]
    assert vnode.leader != "a"
    # The target takes the source's place, so it becomes the preferred leader.
    assert meta_mod.placement_of(node.meta.map)[0] == ["d", "b", "c"]
    # The first transfer aims at the new replica; after a bounce any replica will do.
    transfers = moves.steps.transfers  # type: ignore[attr-defined]
    assert transfers[0] == "d"
    assert transfers[1:] == ["", ""]


def test_the_source_stops_being_the_preferred_leader_before_leadership_moves() -> None:
    node = FakeNode(["a", "b", "c"])
    vnode = FakeVnode(["a", "b", "c"], leader="a")
    bouncing(node, vnode, source="a", bounces=0)._execute(placement.Move(shard=0, source="a", target="d"))
    # Added first, then reordered so the balancer no longer hands leadership to "a".
    assert node.proposed[0] == ["a", "b", "c", "d"]
    assert node.proposed[1][0] != "a" and node.proposed[1][-1] == "a"


def test_a_refusal_for_another_reason_is_not_retried() -> None:
    node = FakeNode(["a", "b", "c"])
    vnode = FakeVnode(["a", "b", "c"], leader="b")

    class Refusing(BouncingSteps):
        def change(self, shard: int, node_id: str, add: bool) -> None:
            if not add:
                raise errors.error(Reason.MEMBERSHIP_REFUSED, "refused for a reason of its own")
            super().change(shard, node_id, add)

    with pytest.raises(MqdsError) as caught:
        bouncing(node, vnode, source="a", bounces=0, steps=Refusing)._execute(
            placement.Move(shard=0, source="a", target="d")
        )
    assert caught.value.reason == Reason.MEMBERSHIP_REFUSED


def test_a_node_that_loses_metadata_leadership_stops_the_move() -> None:
    # Its next step would be decided from its own map, which misses what the
    # new leader commits: it must stop (the caller retries on the new
    # leader), not forward more changes there.
    node = FakeNode(["a", "b", "c"], leads_for=1)
    vnode = FakeVnode(["a", "b", "c"], leader="b")
    with pytest.raises(MqdsError) as caught:
        bouncing(node, vnode, source="a", bounces=0)._execute(placement.Move(shard=0, source="a", target="d"))
    assert caught.value.reason == Reason.NOT_LEADER and caught.value.retriable
    assert node.proposed == [["a", "b", "c", "d"]], "nothing was written after leadership was lost"
    assert vnode.members == ["a", "b", "c"], "no Raft membership change after leadership was lost"
