"""Client authentication and roles on a real cluster, and the per-client call limit on a real gRPC server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from mqds.client import Client, ConnectionSettings, Message
from mqds.client import errors as E
from mqds.protocol.errors import Reason
from mqds.server.api.guard import ApiGuard, CallLimits
from mqds.server.auth import TokenFileError, load_tokens
from mqds.server.raft.cluster_auth import ClusterAuth
from mqds.tools.local_cluster import LocalCluster
from mqds.v1 import storage_pb2 as pb
from mqds.v1 import storage_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

READER = "reader-token-0123456789"
BROKER = "broker-token-0123456789"
ADMIN = "admin-token-0123456789ab"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    base = tmp_path_factory.mktemp("auth")
    tokens = base / "tokens"
    tokens.write_text(f"# role token\nreader {READER}\nbroker {BROKER}\nadmin {ADMIN}  # operators\n")
    with LocalCluster(base / "c", 3, n_shards=4, args=["--auth-tokens-file", str(tokens)]) as c:
        c.start()  # the nodes form the cluster among themselves: they present the cluster secret
        yield c


def client(cluster: LocalCluster, token: str | None) -> Client:
    return Client(cluster.addresses, settings=ConnectionSettings(timeout_s=15, auth_token=token))


def test_calls_without_a_valid_token_are_unauthenticated(cluster: LocalCluster) -> None:
    for token in (None, "not-a-token-we-know-at-all"):
        with client(cluster, token) as c, pytest.raises(E.AuthenticationError) as refused:
            c.store_batch([Message("auth/x", b"1", sender="s")])
        assert refused.value.reason is Reason.UNAUTHENTICATED
    # Health needs no token (probes have none).
    channel = grpc.insecure_channel(cluster.addresses[0])
    answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_each_role_may_make_its_calls_and_no_others(cluster: LocalCluster) -> None:
    with client(cluster, BROKER) as broker:
        (stored,) = broker.store_batch([Message("auth/roles", b"hello", sender="dev-1", qos=1)])
        broker.client_connected("dev-1", "broker-a")
        broker.subscribe("dev-1", "auth/#")
        with pytest.raises(E.PermissionDeniedError, match="needs the admin role"):
            broker.add_generation(0)
    with client(cluster, READER) as reader:
        assert [m.payload for m in reader.replay("auth/roles")] == [b"hello"]
        assert reader.subscriptions("dev-1") == {"auth/#": 1}
        assert len(reader.get_fences()) == 4
        with pytest.raises(E.PermissionDeniedError) as denied:
            reader.store_batch([Message("auth/roles", b"no", sender="dev-1")])
        assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(E.PermissionDeniedError):
            reader.ack("dev-1", "auth/#", stored)
    with client(cluster, ADMIN) as admin:
        assert admin.add_generation(0)[0].shard == 0
        assert admin.store_batch([Message("auth/roles", b"admin too", sender="dev-1")])


def reflect(address: str, token: str | None, **request: str) -> reflection_pb2.ServerReflectionResponse:
    metadata = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(**request)]), metadata=metadata, timeout=5
        )
        return next(iter(answers))


def test_reflection_needs_a_token_and_describes_only_the_public_api(cluster: LocalCluster) -> None:
    address = cluster.addresses[0]
    with pytest.raises(grpc.RpcError) as refused:
        reflect(address, None, list_services="")
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    listed = {s.name for s in reflect(address, READER, list_services="").list_services_response.service}
    assert "mqds.v1.Storage" in listed and not any("raft" in name for name in listed)
    internal = reflect(address, READER, file_containing_symbol="mqds.server.raft.v1.Raft")
    assert internal.HasField("error_response")
    public = reflect(address, READER, file_containing_symbol="mqds.v1.Storage")
    assert public.HasField("file_descriptor_response")


def test_token_file_mistakes_are_named(tmp_path: Path) -> None:
    cases = {
        "": "no tokens in it",
        "broker\n": "expected '<role> <token>'",
        "superuser 0123456789abcdef\n": "unknown role 'superuser'",
        "broker short\n": "at least 16 characters",
        "broker 0123456789abcdef\nadmin 0123456789abcdef\n": "listed twice",
    }
    for text, words in cases.items():
        path = tmp_path / "tokens"
        path.write_text(text)
        with pytest.raises(TokenFileError, match=words):
            load_tokens(str(path))
    with pytest.raises(TokenFileError, match="cannot read it"):
        load_tokens(str(tmp_path / "missing"))


def test_a_client_over_its_call_limit_is_refused_and_others_are_not() -> None:
    """The guard on a real gRPC server, in front of a handler that holds each call for a while."""
    release = threading.Event()

    def slow(request: bytes, context: grpc.ServicerContext) -> bytes:
        release.wait(10)
        return b""

    guard = ApiGuard({}, ClusterAuth("n1", "", "", False), CallLimits(max_calls_per_client=2))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=(guard,))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "mqds.v1.Storage", {"GetFences": grpc.unary_unary_rpc_method_handler(slow)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        one = pb_grpc.StorageStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        held = [one.GetFences.future(pb.GetFencesRequest(), timeout=15) for _ in range(2)]
        deadline = time.monotonic() + 5
        while sum(guard._in_flight.values()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as refused:
            one.GetFences(pb.GetFencesRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_calls_per_client" in (refused.value.details() or "")
        # Another connection (another client) is not affected.
        other = pb_grpc.StorageStub(
            grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        )
        late = other.GetFences.future(pb.GetFencesRequest(), timeout=15)
        release.set()
        late.result()
        for call in held:
            call.result()
        assert guard.rejected == {"OVERLOADED": 1}
    finally:
        release.set()
        server.stop(None)
