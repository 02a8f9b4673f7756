"""Local mqds-server processes and clusters of them: start, kill -9, restart, wipe, partition.

Used by the demo, the tests, the benchmarks and ``mqds cluster``. Every wait
is bounded; a process that dies during start-up raises with the end of its
log. :class:`LocalCluster` is the harness the integration tests share: it
starts N real ``mqds-server`` processes on loopback that form one cluster,
and answers who leads what, kills and restarts nodes, wipes their data,
partitions them (through the nodes' fault-injection hook, which drops Raft
traffic between the two sides), and checks that replicas converged.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mqds.client import Client
from mqds.server.raft.group import META_GROUP
from mqds.server.raft.transport import NODE_HEADER, SECRET_HEADER
from mqds.server.raft.v1 import raft_pb2 as rpb
from mqds.server.raft.v1 import raft_pb2_grpc as rpb_grpc
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc

T = TypeVar("T")

SERVER = str(Path(sys.executable).with_name("mqds-server"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


READY_SERVICE = "mqds.v1.Storage"


def wait_serving(address: str, timeout_s: float, service: str = READY_SERVICE) -> bool:
    """Poll the gRPC health service until ``service`` is SERVING or the time is up.

    The node's own readiness is the ``mqds.v1.Storage`` service (joined, every
    replica has a leader); ``""`` is liveness (the process serves at all).
    """
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    return False


class NodeProcess:
    """One mqds-server process with a fixed node id, port and data directory."""

    def __init__(
        self,
        data_dir: Path,
        *,
        node_id: str = "n1",
        port: int | None = None,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.node_id = node_id
        self.port = port or free_port()
        self.args = list(args)
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"{node_id}-{self.port}.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            SERVER,
            "--node-id",
            self.node_id,
            "--listen",
            self.address,
            "--data-dir",
            str(self.data_dir),
            *self.args,
        ]

    def launch(self) -> NodeProcess:
        """Start the process without waiting for it."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
            )
        return self

    def wait(self, timeout_s: float = 30, service: str = READY_SERVICE) -> NodeProcess:
        """Until the node reports ``service`` SERVING (by default: ready to serve)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mqds-server exited with {self.proc.returncode}:\n{self.output()}")
            if wait_serving(self.address, 0.5, service):
                return self
        self.kill()
        raise TimeoutError(f"mqds-server {self.node_id} not serving after {timeout_s}s:\n{self.output()}")

    def start(self, timeout_s: float = 30, service: str = READY_SERVICE) -> NodeProcess:
        """Start the process and wait until it is ready (``service=""``: only until it runs)."""
        return self.launch().wait(timeout_s, service)

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """kill -9: no shutdown code runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout_s: float = 20) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
                raise
        return int(self.proc.returncode)

    def restart(self, timeout_s: float = 30) -> NodeProcess:
        self.kill()
        return self.start(timeout_s)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pause(self) -> None:
        """SIGSTOP: the process stays, but does nothing (a long GC pause, a frozen VM)."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGCONT)


def wait_until(what: str, check: Callable[[], T | None], timeout_s: float, interval_s: float = 0.1) -> T:
    """Poll ``check`` until it returns something truthy; TimeoutError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except (grpc.RpcError, OSError) as err:
            last_error = err
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            raise TimeoutError(f"{what} did not happen within {timeout_s:g}s{detail}")
        time.sleep(interval_s)


class LocalCluster:
    """N mqds-server processes on 127.0.0.1 forming one cluster, for tests, demos and benchmarks."""

    def __init__(
        self,
        base_dir: Path,
        n_nodes: int = 3,
        *,
        base_port: int | None = None,
        n_shards: int = 16,
        replication_factor: int = 3,
        args: Sequence[str] = (),
        secret: str | None = None,
    ) -> None:
        self.base_dir = Path(base_dir)
        self.secret = secret or secrets.token_hex(16)
        self.n_shards = n_shards
        self.replication_factor = replication_factor
        self.args = list(args)
        ids = [f"n{i}" for i in range(1, n_nodes + 1)]
        ports = [base_port + i for i in range(n_nodes)] if base_port else [free_port() for _ in ids]
        self.nodes: dict[str, NodeProcess] = {}
        self.founders = dict(zip(ids, ports, strict=True))
        for node_id, port in self.founders.items():
            self.nodes[node_id] = self._process(node_id, port)
        self._channels: dict[str, grpc.Channel] = {}

    def _peers(self) -> str:
        return ",".join(f"{node_id}=127.0.0.1:{port}" for node_id, port in self.founders.items())

    def _process(self, node_id: str, port: int) -> NodeProcess:
        args = [
            "--peers",
            self._peers(),
            "--n-shards",
            str(self.n_shards),
            "--replication-factor",
            str(self.replication_factor),
            "--fault-injection",
            *self.args,
        ]
        return NodeProcess(
            self.base_dir / node_id,
            node_id=node_id,
            port=port,
            args=args,
            env={"MQDS_CLUSTER_SECRET": self.secret},
        )

    # -- lifecycle -------------------------------------------------------------

    def start(self, timeout_s: float = 60) -> LocalCluster:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        started = [proc.launch() for proc in self.nodes.values() if not proc.running]
        for proc in started:
            proc.wait(timeout_s)
        self.wait_ready(timeout_s)
        return self

    def stop(self) -> None:
        """Stop every node (SIGTERM, then kill after a while)."""
        for proc in self.nodes.values():
            try:
                if proc.running:
                    proc.resume()
                    proc.stop(timeout_s=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def kill_all(self) -> None:
        for proc in self.nodes.values():
            proc.resume()
            proc.kill()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()

    @property
    def addresses(self) -> list[str]:
        return [p.address for p in self.nodes.values()]

    def live(self) -> list[str]:
        return [node_id for node_id, p in self.nodes.items() if p.running]

    def client(self, **kwargs: Any) -> Client:
        return Client(self.addresses, **kwargs)

    def kill(self, node_id: str) -> None:
        """kill -9 a node."""
        self.nodes[node_id].kill()

    def restart(self, node_id: str, timeout_s: float = 60) -> None:
        self.nodes[node_id].restart(timeout_s)

    def start_node(self, node_id: str, timeout_s: float = 60) -> None:
        self.nodes[node_id].start(timeout_s)

    def wipe(self, node_id: str) -> None:
        """kill -9 a node and delete its data directory (start it again with start_node)."""
        proc = self.nodes[node_id]
        proc.kill()
        shutil.rmtree(proc.data_dir, ignore_errors=True)

    def add_node(self, node_id: str, timeout_s: float = 60) -> NodeProcess:
        """Start a new node that is not a founder: it runs, and waits for `join` to become ready."""
        proc = self._process(node_id, free_port())
        self.nodes[node_id] = proc
        return proc.start(timeout_s, service="")

    # -- inspection ------------------------------------------------------------------

    def _channel(self, node_id: str) -> grpc.Channel:
        address = self.nodes[node_id].address
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.insecure_channel(address)
        return channel

    def cluster_stub(self, node_id: str) -> clpb_grpc.ClusterStub:
        return clpb_grpc.ClusterStub(self._channel(node_id))

    def status(self, node_id: str, timeout_s: float = 5) -> clpb.NodeStatus:
        return self.cluster_stub(node_id).GetNodeStatus(clpb.GetNodeStatusRequest(), timeout=timeout_s)

    def cluster_map(self, node_id: str | None = None, timeout_s: float = 5) -> clpb.ClusterMap:
        for candidate in [node_id] if node_id else self.live():
            try:
                return self.cluster_stub(candidate).GetClusterMap(clpb.GetClusterMapRequest(), timeout=timeout_s)
            except grpc.RpcError:
                continue
        raise RuntimeError("no live node answered GetClusterMap")

    def replicas(self, shard: int) -> list[str]:
        cmap = self.cluster_map()
        return next(list(v.replicas) for v in cmap.vnodes if v.shard == shard)

    def leaders(self) -> dict[int, str]:
        """Each shard's leader, as the live nodes that lead them say (only shards with a leader)."""
        found: dict[int, str] = {}
        for node_id in self.live():
            try:
                status = self.status(node_id, timeout_s=2)
            except grpc.RpcError:
                continue
            for replica in status.replicas:
                if replica.role == clpb.RAFT_ROLE_LEADER and replica.group != META_GROUP:
                    found[replica.group] = node_id
        return found

    def leader(self, shard: int) -> str | None:
        return self.leaders().get(shard)

    def followers(self, shard: int) -> list[str]:
        leader = self.leader(shard)
        return [n for n in self.replicas(shard) if n != leader]

    def wait_for_leader(self, shard: int, timeout_s: float = 30, exclude: Iterable[str] = ()) -> str:
        excluded = set(exclude)
        return wait_until(
            f"a leader of shard {shard} outside {sorted(excluded)}",
            lambda: (lambda leader: leader if leader and leader not in excluded else None)(self.leader(shard)),
            timeout_s,
        )

    def wait_ready(self, timeout_s: float = 60) -> None:
        """Until every vnode and the metadata group have a leader and every live node is serving."""

        def ready() -> bool:
            leaders = self.leaders()
            if len(leaders) < self.n_shards:
                return False
            return all(self.status(n, timeout_s=2).ready for n in self.live())

        wait_until("every vnode having a leader", ready, timeout_s, interval_s=0.2)

    def digests(self, shard: int) -> dict[str, clpb.ReplicaDigest]:
        out = {}
        for node_id in self.live():
            try:
                out[node_id] = self.cluster_stub(node_id).GetReplicaDigest(
                    clpb.GetReplicaDigestRequest(shard=shard), timeout=30
                )
            except grpc.RpcError as err:
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND):
                    raise
        return out

    def assert_replicas_identical(self, timeout_s: float = 60, shards: Iterable[int] | None = None) -> None:
        """Every live replica of every vnode holds the same content at the same applied index."""
        for shard in shards if shards is not None else range(self.n_shards):
            expected = set(self.replicas(shard)) & set(self.live())

            def converged(s: int = shard, want: set[str] = expected) -> dict[str, clpb.ReplicaDigest] | None:
                digests = self.digests(s)
                if set(digests) < want:
                    return None
                values = {(d.applied_index, d.sha256) for d in digests.values()}
                return digests if len(values) == 1 else None

            try:
                wait_until(f"replicas of shard {shard} converging", converged, timeout_s, interval_s=0.2)
            except TimeoutError:
                detail = {n: (d.applied_index, d.sha256[:12], d.keys) for n, d in self.digests(shard).items()}
                raise AssertionError(f"replicas of shard {shard} differ: {detail}") from None

    # -- faults ---------------------------------------------------------------------

    def _inject(self, node_id: str, blocked: list[str]) -> None:
        stub = rpb_grpc.RaftStub(self._channel(node_id))
        stub.InjectFault(
            rpb.InjectFaultRequest(blocked_peers=blocked),
            timeout=5,
            metadata=[(SECRET_HEADER, self.secret), (NODE_HEADER, "harness")],
        )

    def partition(self, *sides: Iterable[str]) -> None:
        """Cut Raft traffic between the given groups of nodes (nodes not listed are cut from all)."""
        groups = [set(side) for side in sides]
        everyone = set(self.nodes)
        for node_id in self.live():
            mine = next((g for g in groups if node_id in g), {node_id})
            self._inject(node_id, sorted(everyone - mine))

    def heal(self) -> None:
        for node_id in self.live():
            self._inject(node_id, [])
