"""N local mqds-server processes forming one cluster: the harness of the tests, the demo and the benchmarks.

:class:`LocalCluster` starts N real ``mqds-server`` processes on loopback
that form one cluster, and answers who leads what, kills and restarts nodes,
wipes their data, partitions them (through the nodes' fault-injection hook,
which drops Raft traffic between the two sides), and checks that replicas
converged.

A cluster can also outlive the program that started it (``mqds cluster up``):
:meth:`LocalCluster.up` starts the nodes detached (their own session, so a
Ctrl-C in the terminal does not reach them) and records ids, ports, pids,
arguments and the cluster secret in ``<dir>/cluster.json``;
:meth:`LocalCluster.load` reads it back in a later program, which then
stops, kills and restarts the nodes by pid (see :mod:`mqds.tools.processes`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc

from mqds.cli.secret import STATE_FILE
from mqds.client import Client, ConnectionSettings
from mqds.server.raft.cluster_auth import NODE_HEADER, SECRET_HEADER
from mqds.server.raft.group import META_GROUP
from mqds.server.raft.v1 import raft_pb2 as rpb
from mqds.server.raft.v1 import raft_pb2_grpc as rpb_grpc
from mqds.tools.channels import SecretMetadata
from mqds.tools.errors import LocalClusterError
from mqds.tools.ports import free_port, port_in_use
from mqds.tools.processes import NodeProcess
from mqds.tools.waiting import wait_until
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc

# What LocalCluster.save writes and LocalCluster.load reads, in the cluster's directory (the mqds admin
# commands read its secret and node addresses too: mqds.cli.secret).
STATE_FORMAT = 1


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
        ports: Sequence[int] | None = None,
        fault_injection: bool = True,
        detach: bool = False,
        connection: ConnectionSettings | None = None,
        metrics: bool = False,
    ) -> None:
        # Absolute: the nodes get their data directories on the command line,
        # and a later program (mqds cluster start) may run from elsewhere.
        self.base_dir = Path(base_dir).absolute()
        self.secret = secret or secrets.token_hex(16)
        self.n_shards = n_shards
        self.replication_factor = replication_factor
        self.args = list(args)
        self.fault_injection = fault_injection
        self.detach = detach
        # Each node serves Prometheus metrics on a free port of its own (NodeProcess.metrics_url).
        self.metrics = metrics
        # How the harness and its clients reach the nodes (TLS; pass the
        # nodes' TLS flags in args).
        self.connection = connection
        ids = [f"n{i}" for i in range(1, n_nodes + 1)]
        if ports is None:
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
            *(["--fault-injection"] if self.fault_injection else []),
            *self.args,
        ]
        return NodeProcess(
            self.base_dir / node_id,
            node_id=node_id,
            port=port,
            args=args,
            env={"MQDS_CLUSTER_SECRET": self.secret},
            detach=self.detach,
            connection=self.connection,
            metrics_port=free_port() if self.metrics else None,
        )

    # -- a cluster that outlives its program (mqds cluster) ----------------------

    @property
    def state_path(self) -> Path:
        return self.base_dir / STATE_FILE

    @staticmethod
    def recorded(base_dir: Path | str) -> bool:
        """Whether ``base_dir`` holds a cluster saved by :meth:`save`."""
        return (Path(base_dir) / STATE_FILE).is_file()

    def save(self) -> None:
        """Record nodes, ports, pids, arguments and the secret in ``<base_dir>/cluster.json`` (mode 0600)."""
        state = {
            "format": STATE_FORMAT,
            "n_shards": self.n_shards,
            "replication_factor": self.replication_factor,
            "fault_injection": self.fault_injection,
            "metrics": self.metrics,
            "args": self.args,
            "secret": self.secret,
            "founders": self.founders,
            "nodes": {
                node_id: {
                    "address": proc.address,
                    "pid": proc.pid if proc.running else None,
                    "log": proc.log_path.name,
                    "command": proc.command(),
                }
                for node_id, proc in self.nodes.items()
            },
        }
        self.base_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(state, out, indent=2)
            out.write("\n")
        os.replace(tmp, self.state_path)

    @classmethod
    def load(cls, base_dir: Path | str, *, detach: bool = True) -> LocalCluster:
        """The cluster recorded in ``base_dir``; nodes whose recorded process still runs are adopted."""
        base = Path(base_dir).absolute()
        path = base / STATE_FILE
        try:
            state = json.loads(path.read_text())
            if state.get("format") != STATE_FORMAT:
                raise ValueError(f"format {state.get('format')!r}, expected {STATE_FORMAT}")
            founders = {str(node_id): int(port) for node_id, port in state["founders"].items()}
            cluster = cls(
                base,
                len(founders),
                ports=list(founders.values()),
                n_shards=int(state["n_shards"]),
                replication_factor=int(state["replication_factor"]),
                args=[str(a) for a in state["args"]],
                secret=str(state["secret"]),
                fault_injection=bool(state["fault_injection"]),
                detach=detach,
                metrics=bool(state.get("metrics", False)),
            )
            for node_id, info in state["nodes"].items():
                proc = cluster.nodes.get(node_id)
                if proc is None:  # a node added after the cluster was created
                    port = int(str(info["address"]).rpartition(":")[2])
                    proc = cluster.nodes[node_id] = cluster._process(node_id, port)
                if info.get("pid"):
                    proc.adopt(int(info["pid"]))
        except FileNotFoundError:
            raise LocalClusterError(f"no local cluster recorded in {base} (no {STATE_FILE} there)") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise LocalClusterError(f"{path} is not a cluster state this version can read: {err!r}") from None
        return cluster

    @classmethod
    def up(
        cls,
        base_dir: Path | str,
        n_nodes: int | None = None,
        *,
        base_port: int | None = None,
        n_shards: int | None = None,
        replication_factor: int | None = None,
        timeout_s: float = 120,
        detach: bool = True,
        fault_injection: bool = False,
        args: Sequence[str] = (),
    ) -> LocalCluster:
        """What ``mqds cluster up`` does: start the cluster recorded in ``base_dir``, or create one there.

        A new cluster gets ``n_nodes`` (default 3) nodes n1, n2, ... on
        ``base_port``, ``base_port + 1``, ... (free ports when None). A
        recorded one restarts as it was, keeping nodes that still run; an
        argument that contradicts the record is an error rather than ignored.
        Returns once every vnode has a leader, with the state saved. ``args``
        are every node's extra command-line settings (``mqds cluster up
        --set``); a recorded cluster keeps its own.
        """
        base = Path(base_dir).absolute()
        if cls.recorded(base):
            cluster = cls.load(base, detach=detach)
            asked = {
                "nodes": (n_nodes, len(cluster.founders)),
                "base port": (base_port, min(cluster.founders.values())),
                "shards": (n_shards, cluster.n_shards),
                "replication factor": (replication_factor, cluster.replication_factor),
            }
            if args and list(args) != cluster.args:
                raise LocalClusterError(
                    f"{base} holds a cluster whose nodes run with {' '.join(cluster.args) or 'no extra settings'}, "
                    f"not {' '.join(args)}; leave --set and --config out to restart it as it was, or use another "
                    "directory for a new cluster"
                )
            for what, (wanted, actual) in asked.items():
                if wanted is not None and wanted != actual:
                    raise LocalClusterError(
                        f"{base} holds a cluster with {what} {actual}, not {wanted}; "
                        "leave the option out to restart it, or use another directory for a new cluster"
                    )
        else:
            cluster = cls(
                base,
                3 if n_nodes is None else n_nodes,
                base_port=base_port,
                n_shards=16 if n_shards is None else n_shards,
                replication_factor=3 if replication_factor is None else replication_factor,
                fault_injection=fault_injection,
                detach=detach,
                args=args,
            )
        for node_id, proc in cluster.nodes.items():
            if not proc.running and port_in_use(proc.port):
                raise LocalClusterError(
                    f"port {proc.port} (node {node_id}) is in use by another program"
                    + ("" if cluster.recorded(base) else "; choose other ports")
                )
        cluster.base_dir.mkdir(parents=True, exist_ok=True)
        launched = [proc.launch() for proc in cluster.nodes.values() if not proc.running]
        # Recorded at once: whatever happens next, the pids are known.
        cluster.save()
        try:
            for proc in launched:
                proc.wait(timeout_s)
            cluster.wait_ready(timeout_s)
        except (RuntimeError, TimeoutError) as err:
            for proc in launched:
                proc.kill()
            cluster.save()
            raise LocalClusterError(f"the cluster in {base} did not come up: {err}") from None
        except BaseException:  # Ctrl-C: leave nothing half-started behind
            for proc in launched:
                proc.kill()
            cluster.save()
            raise
        return cluster

    # -- lifecycle -------------------------------------------------------------

    def start(self, timeout_s: float = 60) -> LocalCluster:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        started = [proc.launch() for proc in self.nodes.values() if not proc.running]
        for proc in started:
            proc.wait(timeout_s)
        self.wait_ready(timeout_s)
        return self

    def stop(self) -> None:
        """Stop every node (SIGTERM to all at once, then kill those still running after a while)."""
        for proc in self.nodes.values():
            proc.resume()
            proc.terminate()
        for proc in self.nodes.values():
            try:
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
        return [p.address for p in list(self.nodes.values())]

    def live(self) -> list[str]:
        # A copy: a chaos nemesis may add a node from another thread meanwhile.
        return [node_id for node_id, p in list(self.nodes.items()) if p.running]

    def client(self, **kwargs: Any) -> Client:
        kwargs.setdefault("settings", self.connection)
        return Client(self.addresses, **kwargs)

    def admin_client(self, timeout_s: float = 30) -> Client:
        """A client presenting the cluster secret, as an operator's tools do: it may make admin calls."""
        base = self.connection or ConnectionSettings()
        return Client(
            self.addresses, settings=dataclasses.replace(base, timeout_s=timeout_s, cluster_secret=self.secret)
        )

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
        """A channel whose calls present the cluster secret: the harness inspects nodes as one of them
        (so it works when the nodes require client tokens, too)."""
        address = self.nodes[node_id].address
        channel = self._channels.get(address)
        if channel is None:
            raw = (self.connection or ConnectionSettings()).open_channel(address)
            channel = grpc.intercept_channel(raw, SecretMetadata(self.secret))
            self._channels[address] = channel
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
        return self._survey_leaders()[0]

    def _survey_leaders(self) -> tuple[dict[int, str], dict[str, str]]:
        """Each shard's leader as the live nodes say, and the live nodes that did not answer (with why)."""
        found: dict[int, str] = {}
        silent: dict[str, str] = {}
        for node_id in self.live():
            started = time.monotonic()
            try:
                status = self.status(node_id, timeout_s=2)
            except grpc.RpcError as err:
                silent[node_id] = f"{err.code().name} after {time.monotonic() - started:.1f}s"
                continue
            for replica in status.replicas:
                if replica.role == clpb.RAFT_ROLE_LEADER and replica.group != META_GROUP:
                    found[replica.group] = node_id
        return found, silent

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

    def wait_leaders_settled(self, timeout_s: float = 30) -> None:
        """Until every vnode is led by its preferred replica (the leader balancer is done); TimeoutError if not.

        A new cluster's leaders move to their preferred replicas in its first
        seconds (every ``leader_balance_interval_s``), and writes to a vnode
        pause during each move: a test or a benchmark that starts earlier sees
        those pauses.
        """

        def settled() -> bool:
            leaders = self.leaders()
            try:
                vnodes = self.cluster_map().vnodes
            except RuntimeError:  # no live node answered: not yet
                return False
            return all(leaders.get(v.shard) == v.replicas[0] for v in vnodes)

        wait_until("every vnode led by its preferred replica", settled, timeout_s, interval_s=0.25)

    def wait_ready(self, timeout_s: float = 60) -> None:
        """Until every vnode and the metadata group have a leader and every live node is serving."""

        why = ["not checked yet"]

        def ready() -> bool:
            leaders, silent = self._survey_leaders()
            if len(leaders) < self.n_shards:
                why[0] = f"vnodes without a leader: {sorted(set(range(self.n_shards)) - set(leaders))}"
                if silent:
                    why[0] += f" (GetNodeStatus unanswered by {silent})"
                return False
            for node_id in self.live():
                started = time.monotonic()
                try:
                    status = self.status(node_id, timeout_s=2)
                except grpc.RpcError as err:
                    why[0] = f"{node_id} did not answer GetNodeStatus: {err.code().name} after "
                    why[0] += f"{time.monotonic() - started:.1f}s"
                    raise
                if not status.ready:
                    why[0] = f"{node_id} answers but is not ready"
                    return False
            return True

        try:
            wait_until("every vnode having a leader", ready, timeout_s, interval_s=0.2)
        except TimeoutError as err:
            raise TimeoutError(f"{err}; last seen: {why[0]}") from None

    def digests(self, shard: int) -> dict[str, clpb.ReplicaDigest]:
        """Each live replica's digest of ``shard`` (an admin call: ``cluster_stub`` presents the cluster secret)."""
        out = {}
        for node_id in self.live():
            try:
                # A digest scans a whole replica: an admin call (the cluster secret).
                out[node_id] = self.cluster_stub(node_id).GetReplicaDigest(
                    clpb.GetReplicaDigestRequest(shard=shard), timeout=30, metadata=[(SECRET_HEADER, self.secret)]
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
