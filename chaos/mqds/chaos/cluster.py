"""The cluster a chaos run drives: :class:`LocalCluster` with nodes in their own network namespaces.

With ``disk`` ("posix" or "journal") each node's data directory is a
:class:`~mqds.chaos.faultfs.FaultFs` (backing directory ``<base>/<node>.disk``),
mounted when the node's process is made, for the disk nemeses; :meth:`ChaosCluster.close_disks`
unmounts them. With a :class:`~mqds.chaos.network.NetnsNetwork` each node runs under
``ip netns exec`` (which execs, so the process id is the server's and
``kill -9``/``SIGSTOP`` reach it) and listens on its namespace's address; with
a :class:`~mqds.chaos.network.HookNetwork` the nodes are plain loopback
processes. Everything else (kill, restart, wipe, add_node, digests) is
:class:`mqds.tools.local_cluster.LocalCluster`.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from mqds.chaos.faultfs import FaultFs, FaultFsError
from mqds.chaos.network import HookNetwork, NetnsNetwork
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError
from mqds.server.raft.cluster_auth import NODE_HEADER, SECRET_HEADER
from mqds.server.raft.v1 import raft_pb2 as rpb
from mqds.server.raft.v1 import raft_pb2_grpc as rpb_grpc
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.processes import NodeProcess
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc

log = logging.getLogger(__name__)


class NetnsNodeProcess(NodeProcess):
    """A node that runs in a network namespace and listens on that namespace's address."""

    def __init__(self, data_dir: Path, *, host: str, netns: str, **kwargs: Any) -> None:
        super().__init__(data_dir, **kwargs)
        self.host = host
        self.netns_name = netns

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns_name, *super().command()]


class ChaosCluster(LocalCluster):
    """A LocalCluster whose nodes live on ``network`` (namespaces, or loopback with the fault hook)."""

    def __init__(
        self,
        base_dir: Path,
        n_nodes: int,
        *,
        network: HookNetwork | NetnsNetwork,
        n_shards: int,
        replication_factor: int = 3,
        args: Sequence[str] = (),
        disk: str = "off",
    ) -> None:
        # Set before LocalCluster.__init__, which creates the founders' processes.
        self.network = network
        self.paused: set[str] = set()
        self.disk = disk
        self.disks: dict[str, FaultFs] = {}
        for i in range(1, n_nodes + 1):
            network.add_host(f"n{i}")
        if isinstance(network, NetnsNetwork):
            # The nodes listen on the namespaces' addresses, which only this run's processes reach:
            # an open API there is the run's choice (a node on such an address otherwise needs tokens).
            args = [*args, "--insecure-open-api", "true"]
        try:
            super().__init__(
                base_dir,
                n_nodes,
                n_shards=n_shards,
                replication_factor=replication_factor,
                args=args,
                fault_injection=True,
            )
        except BaseException:
            self.close_disks()
            raise
        if isinstance(network, HookNetwork):
            network.inject = self.inject_fault

    def _peers(self) -> str:
        return ",".join(f"{node_id}={self.network.host(node_id)}:{port}" for node_id, port in self.founders.items())

    def _process(self, node_id: str, port: int) -> NodeProcess:
        base = super()._process(node_id, port)
        if self.disk != "off" and node_id not in self.disks:
            self.disks[node_id] = self._disk(node_id, base.data_dir).mount()
        if not isinstance(self.network, NetnsNetwork):
            return base
        self.network.add_host(node_id)
        return NetnsNodeProcess(
            base.data_dir,
            node_id=node_id,
            port=port,
            args=base.args,
            env=base.env,
            host=self.network.host(node_id),
            netns=self.network.netns(node_id) or "",
        )

    def _disk(self, node_id: str, data_dir: Path) -> FaultFs:
        backing = self.base_dir / f"{node_id}.disk"
        return FaultFs(backing, data_dir, log_path=self.base_dir / f"{node_id}.disk.log", metadata=self.disk)

    def wipe(self, node_id: str) -> None:
        """kill -9 a node and give it an empty disk (on a fault filesystem: a new one, nothing to come back)."""
        disk = self.disks.get(node_id)
        if disk is None:
            super().wipe(node_id)
            return
        self.nodes[node_id].kill()
        disk.unmount()
        shutil.rmtree(disk.backing, ignore_errors=True)
        disk.mount()

    def close_disks(self) -> None:
        """Unmount every fault filesystem (the nodes are stopped first); the backing directories stay."""
        for node_id, disk in sorted(self.disks.items()):
            try:
                disk.unmount()
            except FaultFsError as err:
                log.warning("chaos: unmounting %s's disk: %s", node_id, err)

    def live(self) -> list[str]:
        """Running nodes that are not paused (a paused node answers nothing; asking it only waits)."""
        return [n for n in super().live() if n not in self.paused]

    def pause(self, node_id: str) -> None:
        self.paused.add(node_id)
        self.nodes[node_id].pause()

    def resume(self, node_id: str) -> None:
        self.nodes[node_id].resume()
        self.paused.discard(node_id)

    def inject_fault(self, node_id: str, blocked: list[str]) -> None:
        """Tell one node to drop Raft traffic with ``blocked`` (the fault hook; [] heals)."""
        stub = rpb_grpc.RaftStub(self._channel(node_id))
        stub.InjectFault(
            rpb.InjectFaultRequest(blocked_peers=blocked),
            timeout=5,
            metadata=[(SECRET_HEADER, self.secret), (NODE_HEADER, "chaos")],
        )

    def hand_over_leadership(self, shard: int, leader: str) -> bool:
        """Ask ``leader`` to hand the leadership of ``shard`` to a caught-up follower; whether it did."""
        stub = rpb_grpc.RaftStub(self._channel(leader))
        try:
            stub.TransferLeadership(
                rpb.TransferLeadershipRequest(group=shard, node_id=""),
                timeout=10,
                metadata=[(SECRET_HEADER, self.secret), (NODE_HEADER, "chaos")],
            )
        except grpc.RpcError:
            return False
        return True

    def members(self) -> list[str]:
        """The node ids in the cluster map (as a live node answers)."""
        return [n.id for n in self.cluster_map().nodes]

    def placement(self) -> dict[int, list[str]]:
        return {v.shard: list(v.replicas) for v in self.cluster_map().vnodes}

    def admin(self, method: str, request: Any, timeout_s: float) -> clpb.MembershipResponse:
        """A membership call on the metadata leader (following NOT_LEADER hints), bounded by ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        last: MqdsError | None = None
        candidates = self.live()
        while time.monotonic() < deadline and candidates:
            node_id = candidates[0]
            try:
                stub = clpb_grpc.ClusterStub(self._channel(node_id))
                return getattr(stub, method)(request, timeout=max(1.0, deadline - time.monotonic()))
            except grpc.RpcError as rpc_err:
                err = errors.from_rpc_error(rpc_err)
            last = err
            if not err.retriable:
                raise err
            leader = err.metadata.get("leader")
            if leader and leader in self.nodes and leader != node_id:
                candidates = [leader, *[c for c in candidates if c != leader]]
            else:
                candidates = candidates[1:] + candidates[:1]
                time.sleep(0.3)
        raise last or TimeoutError(f"{method} did not finish within {timeout_s:g}s")
