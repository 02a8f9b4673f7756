"""Membership changes and replica moves, run by the leader of the metadata group.

A replica move of shard ``s`` from node ``a`` to node ``b`` never lets the
vnode drop below its replication factor, because it adds before it removes:

1. the metadata places ``s`` on ``b`` as well (``b`` opens an empty replica
   that stays quiet until the vnode's leader contacts it);
2. the vnode's leader adds ``b`` to the Raft group (a logged membership
   change) and ``b`` catches up, by snapshot if the log was compacted;
3. once ``b``'s log matches the leader's, leadership leaves ``a`` if it had it;
4. the leader removes ``a`` from the Raft group;
5. the metadata drops ``a`` from the placement, and ``a`` deletes its copy.

Every step checks the current state first, so a move interrupted by a crash
(of any node, including the metadata leader) can be run again from the top.
Moves run one at a time, under one lock, on the metadata leader, and only
while it leads: each step decides from the map this node holds, so the
metadata it writes is logged here and applied here before the next step
(see ``_propose``); a node that lost leadership stops with NOT_LEADER and
the caller retries on the new leader.

A move cut short between its two halves leaves the placement and the
vnode's Raft group naming different replicas; ``repair`` finishes it (it
runs before every rebalance and leave, and on the metadata leader every
``placement_repair_interval_s``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.server.cluster import meta as meta_mod
from mqds.server.cluster import placement
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.cluster.vnode_steps import STEP_TIMEOUT_S, VnodeSteps, VnodeStepsNode
from mqds.server.raft.group import META_GROUP, RaftGroup
from mqds.v1 import cluster_pb2 as clpb

if TYPE_CHECKING:
    from mqds.server.raft.transport import PeerRouter

log = logging.getLogger(__name__)


class MembershipNode(VnodeStepsNode, Protocol):
    """What membership changes use of the node they run on (``mqds.server.node.node.Node``)."""

    @property
    def node_id(self) -> str: ...

    @property
    def meta_group(self) -> RaftGroup | None: ...

    @property
    def router(self) -> PeerRouter: ...

    def cluster_map(self) -> clpb.ClusterMap: ...


class Membership:
    """join, leave, forget and rebalance, as the Cluster service exposes them."""

    def __init__(self, node: MembershipNode) -> None:
        self.node = node
        self.steps = VnodeSteps(node, self._meta_leader)
        self._lock = threading.Lock()
        # What the last periodic check found apart (see repair_if_needed).
        self._suspects: set[Divergence] = set()

    # -- the operations --------------------------------------------------------

    def join(self, node_id: str, address: str) -> clpb.MembershipResponse:
        self._check_id(node_id)
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise errors.error(Reason.INVALID_REQUEST, f"address {address!r} is not host:port")
        with self._leading():
            for member in self._map().nodes:
                # A join never moves a member: that would hand its Raft and
                # client traffic to whoever listens at the new address. A node
                # that really moved reports its new address itself (with the
                # cluster secret); otherwise it leaves (or is forgotten) first.
                if member.id == node_id and member.address != address:
                    raise errors.error(
                        Reason.MEMBERSHIP_REFUSED,
                        f"node {node_id} is already a member at {member.address}; a join cannot move it to "
                        f"{address}: restart it with --advertise {address} (it reports its new address), or "
                        f"'mqds admin leave {node_id}' (or forget) first",
                    )
                if member.id != node_id and member.address == address:
                    raise errors.error(Reason.MEMBERSHIP_REFUSED, f"address {address} is already node {member.id}'s")
            self._propose(cpb.MetaCommand(add_node=cpb.AddNode(node_id=node_id, address=address)))
            self.node.router.set_address(node_id, address)
            self._meta_member(node_id, add=True)
            log.info("node %s (%s) joined; run a rebalance to give it replicas", node_id, address)
            return self._response([], [])

    def leave(self, node_id: str) -> clpb.MembershipResponse:
        return self._remove(node_id, forget=False)

    def forget(self, node_id: str) -> clpb.MembershipResponse:
        return self._remove(node_id, forget=True)

    def rebalance(self) -> clpb.MembershipResponse:
        with self._leading():
            moves = self._repair() + self._converge()
            leader_moves = self._balance_leaders()
            return self._response(moves, leader_moves)

    # -- helpers -------------------------------------------------------------------

    @staticmethod
    def _check_id(node_id: str) -> None:
        if not node_id or not all(c.isalnum() or c in "-_." for c in node_id):
            raise errors.error(Reason.INVALID_REQUEST, f"node id {node_id!r}: use letters, digits, '-', '_' or '.'")

    def _leading(self) -> _Leading:
        return _Leading(self)

    def _meta_leader(self) -> RaftGroup:
        """The metadata group, as long as this node leads it; NOT_LEADER (or NO_LEADER) once it does not."""
        group = self.node.meta_group
        if group is None:
            raise errors.error(Reason.NO_LEADER, f"node {self.node.node_id} has not joined a cluster yet")
        if not group.is_leader:
            raise group.not_leader_error()
        return group

    def _propose(self, command: cpb.MetaCommand) -> Any:
        """Log a metadata change on this node's metadata group, which must lead; return once applied here.

        Never forwarded: the next step is decided from this node's map, so a
        change must be applied here before this returns. Forwarded to a new
        leader after this node lost leadership, a change was committed there
        before this replica applied it, and the next step, read from a map
        missing it, could repeat a move or put a removed replica back in the
        placement (a chaos run saw a join make six moves instead of three and
        leave one replica placed on a node outside its Raft group, waiting,
        empty, for a leader that never contacted it).
        """
        group = self._meta_leader()
        return group.propose(command.SerializeToString()).wait(self.node.config.write_timeout_s)

    def _map(self) -> clpb.ClusterMap:
        assert self.node.meta is not None
        return self.node.meta.map

    def _response(self, moves: list[str], leader_moves: list[str]) -> clpb.MembershipResponse:
        return clpb.MembershipResponse(moves=moves, leader_moves=leader_moves, map=self.node.cluster_map())

    def _remove(self, node_id: str, forget: bool) -> clpb.MembershipResponse:
        self._check_id(node_id)
        with self._leading():
            cmap = self._map()
            if not any(n.id == node_id for n in cmap.nodes):
                raise errors.error(Reason.UNKNOWN_NODE, f"node {node_id!r} is not a member of the cluster")
            if len(cmap.nodes) == 1:
                raise errors.error(Reason.MEMBERSHIP_REFUSED, "the last node of a cluster cannot leave")
            if node_id == self.node.node_id:
                # The metadata leader is the one leaving: hand the job over.
                self._hand_over_meta()
                raise self.node.meta_group.not_leader_error()  # type: ignore[union-attr]
            self._propose(cpb.MetaCommand(set_state=cpb.SetNodeState(node_id=node_id, state=meta_mod.LEAVING)))
            verb = "forgetting" if forget else "moving replicas off"
            log.info("%s node %s", verb, node_id)
            moves = self._repair() + self._converge()
            self._propose(cpb.MetaCommand(remove_node=cpb.RemoveNode(node_id=node_id)))
            self._meta_member(node_id, add=False)
            self.node.router.forget(node_id)
            log.info("node %s removed from the cluster", node_id)
            return self._response(moves, [])

    def _hand_over_meta(self) -> None:
        group = self.node.meta_group
        assert group is not None
        others = [m for m in group.members if m != self.node.node_id]
        for target in others:
            if group.match_index(target) >= group.last_log_index:
                group.transfer_leadership(target)
                return
        raise errors.error(Reason.NO_LEADER, "no other metadata replica is caught up to take over; retry")

    def _meta_member(self, node_id: str, add: bool) -> None:
        group = self.node.meta_group
        assert group is not None
        if add == (node_id in group.members):
            return
        self.steps.retry(lambda: group.change_membership(add, node_id).wait(self.node.config.write_timeout_s))

    def _converge(self) -> list[str]:
        done: list[str] = []
        rf = self._map().replication_factor
        while True:
            cmap = self._map()
            active = [n.id for n in cmap.nodes if n.state == meta_mod.ACTIVE]
            move = placement.next_move(meta_mod.placement_of(cmap), active, rf)
            if move is None:
                return done
            log.info("moving replica: %s", move)
            started = time.monotonic()
            self._execute(move)
            done.append(str(move))
            log.info("moved replica: %s in %.1fs", move, time.monotonic() - started)

    def _balance_leaders(self) -> list[str]:
        cmap = self._map()
        current = meta_mod.placement_of(cmap)
        balanced = placement.balance_leaders(current)
        for shard, replicas in sorted(balanced.items()):
            if replicas != current[shard]:
                self._set_replicas(shard, replicas)
        moved = []
        for shard, replicas in sorted(balanced.items()):
            leader = self.steps.leader(shard)
            target = replicas[0]
            if leader != target:
                self.steps.retry(functools.partial(self.steps.transfer, shard, target))
                moved.append(f"shard {shard}: {leader} -> {target}")
        return moved

    # -- placement and Raft groups that disagree ------------------------------------

    def repair_if_needed(self) -> list[str]:
        """The metadata leader's periodic check: repair what was found apart in two checks in a row.

        Two in a row, because a move running elsewhere (on a node that lost
        leadership and has not noticed yet) is apart for a moment between its
        steps; a move of this node's holds the lock, and then nothing is done.
        """
        group = self.node.meta_group
        if group is None or not group.is_leader:
            self._suspects = set()
            return []
        found = set(self._divergences())
        suspects, self._suspects = self._suspects, found
        if not found & suspects or not self._lock.acquire(blocking=False):
            return []
        try:
            done = self._repair(only=found & suspects)
        finally:
            self._lock.release()
        for line in done:
            log.warning("%s", line)
        return done

    def _divergences(self) -> list[Divergence]:
        """Where a vnode's placement and its Raft group (as its leader says) name different replicas.

        Placed-but-not-member first, so a repair adds before it removes.
        Vnodes without a leader now are skipped: the next check looks again.
        """
        cmap = self._map()
        groups: dict[int, tuple[int, list[str]]] = {}
        for node in cmap.nodes:
            try:
                status = self.node.cluster_stub(node.id).GetNodeStatus(
                    clpb.GetNodeStatusRequest(), timeout=5, metadata=self.node.auth.metadata()
                )
            except (grpc.RpcError, MqdsError):
                continue
            for replica in status.replicas:
                if replica.role != clpb.RAFT_ROLE_LEADER or replica.group == META_GROUP:
                    continue
                if replica.group not in groups or groups[replica.group][0] < replica.term:
                    groups[replica.group] = (replica.term, list(replica.members))
        placed, unplaced = [], []
        for vnode in cmap.vnodes:
            if vnode.shard not in groups:
                continue
            members = groups[vnode.shard][1]
            placed += [Divergence(vnode.shard, n, placed=True) for n in vnode.replicas if n not in members]
            unplaced += [Divergence(vnode.shard, n, placed=False) for n in members if n not in vnode.replicas]
        return placed + unplaced

    def _repair(self, only: set[Divergence] | None = None) -> list[str]:
        """Make each vnode's Raft group and its placement name the same replicas again.

        A move changes the two one after the other: the placement first when
        it adds a replica, the Raft group first when it removes one. Cut short
        in between (its metadata leader crashed or lost leadership), it leaves
        a replica placed on a node but outside the group, which waits, empty,
        for a leader that never contacts it, so that node never gets ready.
        Finishing the move: a placed non-member is added to the group when the
        vnode has no more placed replicas than its replication factor (an add
        cut short), and dropped from the placement when it has more or its
        node is leaving (a removal cut short); a member that is not placed is
        removed from the group. ``only``: act on these divergences alone.
        """
        done = []
        for diverged in self._divergences():
            if only is not None and diverged not in only:
                continue
            shard, node_id = diverged.shard, diverged.node_id
            cmap = self._map()
            replicas = meta_mod.placement_of(cmap)[shard]
            active = [n.id for n in cmap.nodes if n.state == meta_mod.ACTIVE]
            width = min(cmap.replication_factor, len(active))
            if diverged.placed:
                if node_id not in replicas:
                    continue  # changed meanwhile
                if len(replicas) > width or node_id not in active:
                    self._set_replicas(shard, [r for r in replicas if r != node_id])
                    done.append(f"repaired shard {shard}: {node_id} dropped from the placement (not in the Raft group)")
                    continue
                if self.steps.status(node_id, shard) is None:
                    continue  # down, or its replica is not open yet: the next check looks again
                self.steps.retry(functools.partial(self.steps.change, shard, node_id, add=True))
                self.steps.wait_caught_up(shard, node_id)
                done.append(f"repaired shard {shard}: {node_id} added to the Raft group (placed there)")
            else:
                if node_id in replicas:
                    continue
                self._remove_replica(shard, node_id, prefer="")
                done.append(f"repaired shard {shard}: {node_id} removed from the Raft group (not placed there)")
        return done

    def _set_replicas(self, shard: int, replicas: list[str]) -> None:
        self._propose(cpb.MetaCommand(set_replicas=cpb.SetReplicas(shard=shard, replicas=replicas)))

    def _execute(self, move: placement.Move) -> None:
        shard, source, target = move.shard, move.source, move.target
        replicas = meta_mod.placement_of(self._map())[shard]
        if target:
            if target not in replicas:
                self._set_replicas(shard, [*replicas, target])
            self.steps.retry(lambda: self.steps.change(shard, target, add=True))
            self.steps.wait_caught_up(shard, target)
        if source:
            self._remove_replica(shard, source, prefer=target)
        final = placement.apply_move({shard: replicas}, move)[shard]
        self._set_replicas(shard, final)

    def _remove_replica(self, shard: int, source: str, prefer: str) -> None:
        """Take ``source`` out of the vnode's Raft group, moving leadership off it first.

        Leadership can come back to ``source`` between the transfer and the
        removal (an election after a fault, or the leader balancer handing it
        to the vnode's preferred replica), and a leader cannot remove itself.
        So ``source`` is first made the least preferred replica in the map, and
        the transfer and the removal are retried together as one step, that
        refusal counting as retriable when leadership is back on ``source``.
        """
        replicas = meta_mod.placement_of(self._map())[shard]
        if replicas and replicas[0] == source:
            self._set_replicas(shard, [*(r for r in replicas if r != source), source])
        tries = 0

        def step() -> None:
            nonlocal tries
            tries += 1
            if self.steps.leader(shard) == source:
                # After a failed try any caught-up replica will do.
                self.steps.transfer(shard, prefer if tries == 1 else "")
            try:
                self.steps.change(shard, source, add=False)
            except MqdsError as err:
                if err.reason is Reason.MEMBERSHIP_REFUSED and self.steps.leader(shard) == source:
                    raise errors.error(
                        Reason.NO_LEADER, f"shard {shard}: leadership came back to {source} before its removal"
                    ) from err
                raise

        self.steps.retry(step)


@dataclass(frozen=True)
class Divergence:
    """A replica the placement and the vnode's Raft group disagree on."""

    shard: int
    node_id: str
    placed: bool  # True: placed on node_id, not a member of the group; False: a member, not placed


class _Leading:
    """Hold the membership lock while this node leads the metadata group."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership

    def __enter__(self) -> None:
        node = self.membership.node
        group = node.meta_group
        if group is None:
            raise errors.error(Reason.NO_LEADER, f"node {node.node_id} has not joined a cluster yet")
        if not group.is_leader:
            raise group.not_leader_error()
        if not self.membership._lock.acquire(timeout=STEP_TIMEOUT_S):
            raise errors.error(Reason.MEMBERSHIP_CHANGE_IN_PROGRESS, "another membership change is running")

    def __exit__(self, *exc: Any) -> None:
        self.membership._lock.release()
