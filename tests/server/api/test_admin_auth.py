"""Administration needs proof even without a tokens file, and no caller can starve a node's workers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from mqds.client import Client, ConnectionSettings, Message
from mqds.client import errors as E
from mqds.protocol.errors import Reason, from_rpc_error
from mqds.server.api.guard import ApiGuard, CallLimits
from mqds.server.api.methods import Lane
from mqds.server.raft.cluster_auth import SECRET_HEADER, ClusterAuth
from mqds.tools.local_cluster import LocalCluster
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc
from mqds.v1 import storage_pb2 as pb
from mqds.v1 import storage_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

MQDS = str(Path(sys.executable).with_name("mqds"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # No tokens file (the default of the shipped deployments); no leader balancing, so leaders stay put.
    args = ["--leader-balance-interval-s", "0"]
    with LocalCluster(tmp_path_factory.mktemp("admin") / "c", 3, n_shards=4, args=args) as c:
        c.start()
        yield c


class Listener:
    """A plain TCP port standing for an attacker's address: counts who connects to it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def meta_leader_address(cluster: LocalCluster) -> str:
    return cluster.nodes[cluster.cluster_map().meta_leader].address


def nodes_of(cluster: LocalCluster) -> list[tuple[str, str, int]]:
    return sorted((n.id, n.address, n.state) for n in cluster.cluster_map().nodes)


def refused_code(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    code: grpc.StatusCode = refused.value.code()
    return code


def test_membership_and_generation_calls_without_proof_are_refused_and_dial_nobody(cluster: LocalCluster) -> None:
    before = nodes_of(cluster)
    attacker = Listener()
    try:
        # Every node refuses, the metadata leader included (the one that would act).
        addresses = [meta_leader_address(cluster), *cluster.addresses]
        for address in addresses:
            with grpc.insecure_channel(address) as channel:
                stub = clpb_grpc.ClusterStub(channel)
                calls = {
                    "JoinNode": lambda stub=stub: stub.JoinNode(
                        clpb.JoinNodeRequest(node_id="intruder", address=attacker.address), timeout=10
                    ),
                    "LeaveNode": lambda stub=stub: stub.LeaveNode(clpb.LeaveNodeRequest(node_id="n2"), timeout=10),
                    "ForgetNode": lambda stub=stub: stub.ForgetNode(clpb.ForgetNodeRequest(node_id="n3"), timeout=10),
                    "Rebalance": lambda stub=stub: stub.Rebalance(clpb.RebalanceRequest(), timeout=10),
                }
                for name, call in calls.items():
                    assert refused_code(call) == grpc.StatusCode.UNAUTHENTICATED, name
        with Client(cluster.addresses, timeout_s=10) as anonymous:
            with pytest.raises(E.AuthenticationError, match="cluster secret"):
                anonymous.add_generation(0)
            with pytest.raises(E.AuthenticationError):
                anonymous.drop_generation(0, 1)
            # Reads and writes stay open without a tokens file.
            assert anonymous.store_batch([Message("admin/open", b"1", sender="s")])
        time.sleep(3)
        assert attacker.connections == 0, "a node dialled the address an unauthenticated JoinNode gave"
        assert nodes_of(cluster) == before
    finally:
        attacker.close()


def test_a_member_cannot_be_moved_by_a_join_even_with_the_secret(cluster: LocalCluster) -> None:
    leaders = cluster.leaders()
    before = nodes_of(cluster)
    attacker = Listener()
    try:
        settings = ConnectionSettings(timeout_s=15, cluster_secret=cluster.secret)
        with settings.open_channel(meta_leader_address(cluster)) as channel:
            stub = clpb_grpc.ClusterStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.JoinNode(
                    clpb.JoinNodeRequest(node_id="n2", address=attacker.address),
                    timeout=10,
                    metadata=settings.call_metadata(),
                )
            err = from_rpc_error(refused.value)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert err.reason is Reason.MEMBERSHIP_REFUSED and "already a member" in err.message
            # Nor may a new id take a member's address.
            with pytest.raises(grpc.RpcError) as taken:
                stub.JoinNode(
                    clpb.JoinNodeRequest(node_id="n9", address=cluster.nodes["n3"].address),
                    timeout=10,
                    metadata=settings.call_metadata(),
                )
            assert from_rpc_error(taken.value).reason is Reason.MEMBERSHIP_REFUSED
        time.sleep(3)
        assert attacker.connections == 0
        assert nodes_of(cluster) == before
        assert cluster.leaders() == leaders
    finally:
        attacker.close()


def test_with_the_secret_admin_calls_work_from_the_client_and_the_cli(cluster: LocalCluster) -> None:
    with Client(cluster.addresses, settings=ConnectionSettings(timeout_s=20, cluster_secret=cluster.secret)) as admin:
        assert {g.shard for g in admin.add_generation()} == set(range(4))

    endpoints = ",".join(cluster.addresses)
    env = {k: v for k, v in os.environ.items() if k != "MQDS_CLUSTER_SECRET"}
    n4 = cluster.add_node("n4")
    # Without the secret the CLI is refused, and says how to present it.
    refused = subprocess.run(
        [MQDS, "--endpoints", endpoints, "admin", "join", "n4", "--address", n4.address],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert refused.returncode != 0 and "cluster secret" in refused.stderr, refused.stderr
    assert "n4" not in [n.id for n in cluster.cluster_map().nodes]
    joined = subprocess.run(
        [MQDS, "--endpoints", endpoints, "admin", "join", "n4", "--address", n4.address],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "MQDS_CLUSTER_SECRET": cluster.secret},
    )
    assert joined.returncode == 0 and "node n4 joined" in joined.stdout, joined.stderr
    assert cluster.secret not in joined.stdout + joined.stderr
    secret_file = n4.data_dir.parent / "secret.txt"
    secret_file.write_text(cluster.secret + "\n")
    left = subprocess.run(
        [MQDS, "--endpoints", endpoints, "admin", "leave", "n4", "--cluster-secret-file", str(secret_file)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert left.returncode == 0 and "node n4 left" in left.stdout, left.stderr
    cluster.nodes.pop("n4").stop()


def probe(address: str) -> str:
    """A liveness probe as the kubelet makes it: a new connection, 1 s to answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
        except grpc.RpcError as err:
            return str(err.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


class Prober:
    """Probes liveness every 0.1 s until stopped; what it saw."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.seen.append(probe(self.address))

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join()
        return self.seen


def test_held_reflection_streams_are_refused_and_starve_nothing(cluster: LocalCluster) -> None:
    """100 server-reflection streams held open, from one connection and from many: the extras are refused."""
    address = cluster.nodes["n1"].address
    release = threading.Event()

    def requests() -> Iterator[reflection_pb2.ServerReflectionRequest]:
        release.wait(60)
        return
        yield  # a generator that sends nothing until released

    one = grpc.insecure_channel(address)
    many = [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(50)]
    prober = Prober(address)
    try:
        streams = [reflection_pb2_grpc.ServerReflectionStub(one).ServerReflectionInfo(requests()) for _ in range(100)]
        streams += [
            reflection_pb2_grpc.ServerReflectionStub(many[i % 50]).ServerReflectionInfo(requests()) for i in range(100)
        ]
        started = time.monotonic()
        deadline = started + 10
        while sum(s.done() for s in streams) < 150 and time.monotonic() < deadline:
            time.sleep(0.05)
        done = [s for s in streams if s.done()]
        assert len(done) >= 150, f"only {len(done)} of 200 held streams were refused within 10 s"
        assert {s.code() for s in done} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert "reflection" in (done[0].details() or "")
        # Meanwhile a write and a read from other clients go through, on this very node too.
        with Client([address], timeout_s=5) as other:
            assert other.store_batch([Message("admin/starve", b"w", sender="s")])
            assert len(other.get_fences()) == 4
        time.sleep(1.5)
    finally:
        release.set()
        seen = prober.stop()
        one.close()
        for channel in many:
            channel.close()
    assert seen and set(seen) == {"SERVING"}, seen


GUARD_SECRET = "guard-test-secret-0123456789"


def _guard(public: int, per_client: int, workers: int, control: futures.ThreadPoolExecutor) -> ApiGuard:
    """The guard as the node builds it, without tokens, for a server of ``workers`` threads."""
    limits = CallLimits(max_public_calls=public, max_calls_per_client=per_client, max_internal_calls=workers - public)
    return ApiGuard({}, ClusterAuth("n1", "", GUARD_SECRET, False), limits, control_pool=control)


def _bound_named(details: str) -> str:
    """Which of the guard's bounds a refusal names ("" for neither)."""
    return next((b for b in ("max_calls_per_client", "max_public_calls") if f"({b})" in details), "")


class _LateWorkers(futures.ThreadPoolExecutor):
    """A server pool whose workers start each call late: what a loaded machine does to them.

    The guard takes a public slot on gRPC's polling thread and checks the
    client's own bound on the worker, so a burst from one connection can hold
    public slots until the workers have turned away its calls past its bound.
    """

    def __init__(self, max_workers: int, delay_s: float) -> None:
        super().__init__(max_workers=max_workers)
        self.delay_s = delay_s

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> futures.Future[Any]:
        def late() -> Any:
            time.sleep(self.delay_s)
            return fn(*args, **kwargs)

        return super().submit(late)


@pytest.mark.parametrize("worker_delay_s", [0.0, 0.05], ids=["workers-at-once", "workers-late"])
def test_slow_calls_are_bounded_per_client_and_in_all_and_health_never_waits(worker_delay_s: float) -> None:
    """The guard as the node builds it, on a real gRPC server, with a handler that holds each call.

    With the workers late, a burst's calls are refused for ``max_public_calls``
    while its calls past ``max_calls_per_client`` still hold public slots:
    which bound a refusal names is the machine's timing, how many calls get
    in is not.
    """
    release = threading.Event()

    def slow(request: bytes, context: grpc.ServicerContext) -> bytes:
        release.wait(20)
        return b""

    def quick(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b""

    workers, public, per_client = 32, 24, 16
    control = futures.ThreadPoolExecutor(max_workers=4)
    guard = _guard(public, per_client, workers, control)
    server = grpc.server(_LateWorkers(workers, worker_delay_s), interceptors=(guard,))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "mqds.v1.Storage",
                {
                    "GetFences": grpc.unary_unary_rpc_method_handler(slow),
                    "StoreBatch": grpc.unary_unary_rpc_method_handler(quick),
                },
            ),
        )
    )
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{port}"
    prober = Prober(address)
    channels: list[grpc.Channel] = []
    try:

        def channel() -> pb_grpc.StorageStub:
            channels.append(grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]))
            return pb_grpc.StorageStub(channels[-1])

        # One connection, 100 slow calls: max_calls_per_client get in, the rest are refused at once.
        one = channel()
        calls = [one.GetFences.future(pb.GetFencesRequest(), timeout=30) for _ in range(100)]
        started = time.monotonic()
        while sum(c.done() for c in calls) < 100 - per_client and time.monotonic() - started < 5:
            time.sleep(0.02)
        refused = [c for c in calls if c.done()]
        assert len(refused) == 100 - per_client
        assert {c.code() for c in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        # Which calls are refused, and for which bound, is not their order of
        # issue: calls started on a channel that is still connecting reach the
        # server in any order. What holds: the calls that took a public slot
        # past the client's bound were refused for the client's bound (at least
        # public - per_client of them), the rest for whichever bound they met.
        bounds = [_bound_named(c.details() or "") for c in refused]
        assert bounds.count("max_calls_per_client") >= public - per_client, bounds
        assert set(bounds) <= {"max_calls_per_client", "max_public_calls"}, bounds
        # Many connections, 100 more: only what is left of max_public_calls gets in.
        spread = [channel().GetFences.future(pb.GetFencesRequest(), timeout=30) for _ in range(100)]
        started = time.monotonic()
        while sum(c.done() for c in spread) < 100 - (public - per_client) and time.monotonic() - started < 5:
            time.sleep(0.02)
        turned_away = [c for c in spread if c.done()]
        assert len(turned_away) == 100 - (public - per_client)
        assert {c.code() for c in turned_away} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert any("max_public_calls" in (c.details() or "") for c in turned_away)
        assert guard.in_flight(Lane.UNARY) == public
        # Health answers at once (its own threads), and so does a refusal to yet another client.
        assert probe(address) == "SERVING"
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as late:
            channel().StoreBatch(pb.StoreBatchRequest(), timeout=5)
        assert late.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() - t0 < 1
        release.set()
        for c in calls + spread:
            if c not in refused and c not in turned_away:
                c.result()
        # The slots are given back: a write from another client succeeds.
        channel().StoreBatch(pb.StoreBatchRequest(), timeout=5)
        assert guard.in_flight(Lane.UNARY) == 0
    finally:
        release.set()
        seen = prober.stop()
        for ch in channels:
            ch.close()
        server.stop(None)
        control.shutdown(wait=False)
    assert seen and set(seen) == {"SERVING"}, seen


def test_status_and_the_map_answer_while_every_worker_and_public_slot_is_taken() -> None:
    """GetNodeStatus and GetClusterMap run on the control pool, outside max_public_calls.

    The chaos runner's readiness wait once saw GetNodeStatus time out for two
    minutes on a busy node: it queued behind the calls that held the server's
    workers (or was refused with every public slot taken), exactly when an
    operator needs ``mqds status``.
    """
    release = threading.Event()

    def slow(request: bytes, context: grpc.ServicerContext) -> bytes:
        release.wait(20)
        return b""

    workers, public, per_client = 16, 8, 8
    control = futures.ThreadPoolExecutor(max_workers=4)
    guard = _guard(public, per_client, workers, control)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), interceptors=(guard,))
    status = clpb.NodeStatus(node_id="n1", ready=True)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "mqds.v1.Storage", {"GetFences": grpc.unary_unary_rpc_method_handler(slow)}
            ),
            # An internal call (not a public method): it takes a worker, not a public slot.
            grpc.method_handlers_generic_handler(
                "mqds.server.raft.v1.Raft", {"LinkAddress": grpc.unary_unary_rpc_method_handler(slow)}
            ),
            grpc.method_handlers_generic_handler(
                "mqds.v1.Cluster",
                {
                    "GetNodeStatus": grpc.unary_unary_rpc_method_handler(
                        lambda request, context: status,
                        request_deserializer=clpb.GetNodeStatusRequest.FromString,
                        response_serializer=clpb.NodeStatus.SerializeToString,
                    ),
                    "GetClusterMap": grpc.unary_unary_rpc_method_handler(
                        lambda request, context: clpb.ClusterMap(n_shards=4),
                        request_deserializer=clpb.GetClusterMapRequest.FromString,
                        response_serializer=clpb.ClusterMap.SerializeToString,
                    ),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{port}"
    channels = [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(3)]
    try:
        storage = pb_grpc.StorageStub(channels[0])
        held = [storage.GetFences.future(pb.GetFencesRequest(), timeout=30) for _ in range(public)]
        hold = channels[1].unary_unary("/mqds.server.raft.v1.Raft/LinkAddress")
        secret = [(SECRET_HEADER, GUARD_SECRET)]
        held += [hold.future(b"", timeout=30, metadata=secret) for _ in range(workers - public)]
        wait_until = time.monotonic() + 5
        while guard.in_flight(Lane.UNARY) < public and time.monotonic() < wait_until:
            time.sleep(0.02)
        assert guard.in_flight(Lane.UNARY) == public
        time.sleep(0.3)  # the internal calls take the rest of the workers
        assert not any(c.done() for c in held)
        cluster = clpb_grpc.ClusterStub(channels[2])
        t0 = time.monotonic()
        for _ in range(20):
            assert cluster.GetNodeStatus(clpb.GetNodeStatusRequest(), timeout=2).node_id == "n1"
            assert cluster.GetClusterMap(clpb.GetClusterMapRequest(), timeout=2).n_shards == 4
        assert time.monotonic() - t0 < 2
        assert guard.in_flight(Lane.UNARY) == public  # they took no public slot, and gave back what they took
    finally:
        release.set()
        for ch in channels:
            ch.close()
        server.stop(None)
        control.shutdown(wait=False)
