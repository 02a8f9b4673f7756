"""The cluster-metadata state machine: membership, addresses and vnode placement.

The state is small (a ``ClusterMap``), so every applied command rewrites it
whole to ``<data_dir>/meta/state`` atomically, with the applied index inside;
the snapshot payload is the state itself. A new cluster starts from a
*genesis* state that every founding node computes identically from the same
peer list, at applied index 0; every later change is a logged
``MetaCommand``. A command that breaks a rule (an unknown node, removing a
node that still holds replicas) is refused the same way on every replica and
changes nothing; the proposer gets the error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.server.cluster import placement
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.durable import make_dirs, write_atomically
from mqds.v1 import cluster_pb2 as clpb

log = logging.getLogger(__name__)

STATE_FORMAT = 1
ACTIVE = clpb.NODE_STATE_ACTIVE
LEAVING = clpb.NODE_STATE_LEAVING


def genesis(peers: Mapping[str, str], n_shards: int, replication_factor: int) -> cpb.ClusterState:
    """The first state of a new cluster; identical on every founder given the same inputs."""
    ids = sorted(peers)
    digest = hashlib.sha256(
        "|".join([*(f"{n}={peers[n]}" for n in ids), str(n_shards), str(replication_factor)]).encode()
    ).hexdigest()[:16]
    cmap = clpb.ClusterMap(cluster_id=digest, n_shards=n_shards, replication_factor=replication_factor)
    for node in ids:
        cmap.nodes.add(id=node, address=peers[node], state=ACTIVE)
    for shard, replicas in sorted(placement.initial_placement(ids, n_shards, replication_factor).items()):
        cmap.vnodes.add(shard=shard, replicas=replicas)
    return cpb.ClusterState(format=STATE_FORMAT, applied_index=0, map=cmap)


class MetaMachine:
    """The replicated cluster map of this node's metadata replica."""

    def __init__(self, path: str, initial: cpb.ClusterState | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        make_dirs(os.path.dirname(path))
        if os.path.exists(path):
            with open(path, "rb") as fh:
                state = cpb.ClusterState.FromString(fh.read())
            if state.format != STATE_FORMAT:
                raise errors.error(Reason.STORAGE_ERROR, f"{path}: metadata format {state.format} is not supported")
        elif initial is not None:
            state = initial
            self._persist(state)
        else:
            raise errors.error(Reason.STORAGE_ERROR, f"{path}: no cluster metadata and no genesis to start from")
        self._state = state

    def _persist(self, state: cpb.ClusterState) -> None:
        write_atomically(self.path, state.SerializeToString())

    def on_change(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    # -- reading ---------------------------------------------------------------

    @property
    def state(self) -> cpb.ClusterState:
        """A copy of the state."""
        with self._lock:
            copy = cpb.ClusterState()
            copy.CopyFrom(self._state)
            return copy

    @property
    def map(self) -> clpb.ClusterMap:
        return self.state.map

    @property
    def applied_index(self) -> int:
        return int(self._state.applied_index)

    # -- the state machine -----------------------------------------------------

    def apply(self, command: bytes, index: int) -> Any:
        if index <= self._state.applied_index:
            return None
        cmd = cpb.MetaCommand.FromString(command)
        state = self.state
        try:
            result = _apply(state.map, cmd)
        except errors.MqdsError as err:
            result = err
        state.applied_index = index
        state.map.version = index
        self._persist(state)
        with self._lock:
            self._state = state
        self._changed()
        return result

    def skip(self, index: int) -> None:
        """An entry that changed nothing in the map (a no-op, a membership change): its index is recorded."""
        state = self.state
        state.applied_index = index
        self._persist(state)
        with self._lock:
            self._state = state

    def snapshot(self) -> bytes:
        return self.state.SerializeToString()

    def install(self, payload: bytes, index: int, source: str, members: list[str]) -> None:
        state = cpb.ClusterState.FromString(payload)
        if state.format != STATE_FORMAT:
            raise errors.error(Reason.STORAGE_ERROR, f"metadata snapshot of format {state.format} is not supported")
        self._persist(state)
        with self._lock:
            self._state = state
        self._changed()


def _node(cmap: clpb.ClusterMap, node_id: str) -> clpb.ClusterNode:
    for node in cmap.nodes:
        if node.id == node_id:
            return node
    raise errors.error(Reason.UNKNOWN_NODE, f"node {node_id!r} is not a member of the cluster")


def _apply(cmap: clpb.ClusterMap, cmd: cpb.MetaCommand) -> Any:
    kind = cmd.WhichOneof("kind")
    if kind == "set_address":
        _node(cmap, cmd.set_address.node_id).address = cmd.set_address.address
        return None
    if kind == "add_node":
        add = cmd.add_node
        if any(n.id == add.node_id for n in cmap.nodes):
            node = _node(cmap, add.node_id)
            node.address = add.address
            return None
        cmap.nodes.add(id=add.node_id, address=add.address, state=ACTIVE)
        return None
    if kind == "set_state":
        _node(cmap, cmd.set_state.node_id).state = cmd.set_state.state
        return None
    if kind == "remove_node":
        node_id = cmd.remove_node.node_id
        _node(cmap, node_id)
        holding = [v.shard for v in cmap.vnodes if node_id in v.replicas]
        if holding:
            raise errors.error(
                Reason.MEMBERSHIP_REFUSED,
                f"node {node_id} still holds replicas of shards {holding}; move them first (leave or forget)",
            )
        if len(cmap.nodes) == 1:
            raise errors.error(Reason.MEMBERSHIP_REFUSED, "the last node of a cluster cannot be removed")
        kept = [n for n in cmap.nodes if n.id != node_id]
        del cmap.nodes[:]
        cmap.nodes.extend(kept)
        return None
    if kind == "set_replicas":
        sr = cmd.set_replicas
        ids = {n.id for n in cmap.nodes}
        unknown = [r for r in sr.replicas if r not in ids]
        if unknown:
            raise errors.error(Reason.UNKNOWN_NODE, f"replicas on unknown nodes {unknown}")
        if len(set(sr.replicas)) != len(sr.replicas):
            raise errors.error(Reason.MEMBERSHIP_REFUSED, f"two replicas of shard {sr.shard} on one node")
        for vnode in cmap.vnodes:
            if vnode.shard == sr.shard:
                del vnode.replicas[:]
                vnode.replicas.extend(sr.replicas)
                return None
        raise errors.error(Reason.UNKNOWN_SHARD, f"shard {sr.shard} does not exist")
    if kind == "set_retention":
        cmap.retention.CopyFrom(cmd.set_retention.policy)
        return None
    raise errors.error(Reason.INTERNAL, "metadata log entry with an unknown command")


def placement_of(cmap: clpb.ClusterMap) -> dict[int, list[str]]:
    return {v.shard: list(v.replicas) for v in cmap.vnodes}
