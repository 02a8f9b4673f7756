"""Garbage at every public RPC and at the Raft endpoint: the node never dies and never loses or corrupts data.

Hypothesis generates request bytes (random, and mutations of valid requests)
for every unary method of the public services, and frames for the Raft
stream (with the cluster secret, so they get past authentication to the
decoder). After each batch the node must still answer health checks, and at
the end every message stored before must read back unchanged, and every
replica must still agree.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mqds.client import Client, Message
from mqds.server.raft.cluster_auth import NODE_HEADER, SECRET_HEADER
from mqds.tools.local_cluster import LocalCluster
from mqds.v1 import cluster_pb2, sessions_pb2, storage_pb2

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Methods that would legitimately destroy data when random bytes happen to
# parse as a valid request: they get bytes that can never parse (a field tag
# of number 0 is invalid), which still exercises their error path.
DESTRUCTIVE = {"DropGeneration", "LeaveNode", "ForgetNode", "Rebalance", "JoinNode"}
NEVER_PARSES = b"\x00\x00"

METHODS = [
    (f"/{service.full_name}/{method.name}", method.name)
    for module in (storage_pb2, sessions_pb2, cluster_pb2)
    for service in module.DESCRIPTOR.services_by_name.values()
    for method in service.methods
    if not method.client_streaming and not method.server_streaming
]

VALID = [
    storage_pb2.StoreBatchRequest(messages=[storage_pb2.Message(topic="fuzz/a", payload=b"x", sender="f")]),
    storage_pb2.GetStreamsRequest(topic_filter="fuzz/#"),
    storage_pb2.NextRequest(batch_size=10),
    sessions_pb2.RetainRequest(message=storage_pb2.Message(topic="fuzz/r", payload=b"r")),
    sessions_pb2.FetchMessagesRequest(topic_filter="#", max_count=5, shards=[0]),
]

request_bytes = st.one_of(
    st.binary(max_size=200),
    st.sampled_from([m.SerializeToString() for m in VALID]).flatmap(
        lambda raw: st.tuples(st.integers(0, max(0, len(raw) - 1)), st.binary(min_size=1, max_size=8)).map(
            lambda cut: raw[: cut[0]] + cut[1] + raw[cut[0] + len(cut[1]) :]
        )
    ),
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("fuzz") / "c", 3, n_shards=2) as c:
        c.start()
        yield c


def alive(address: str) -> bool:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == 1


def test_garbage_never_kills_a_node_or_touches_stored_data(cluster: LocalCluster) -> None:
    with Client(cluster.addresses, timeout_s=30) as client:
        before = client.store_batch([Message(f"keep/{i % 5}", f"v{i}".encode(), sender=f"k{i % 3}") for i in range(50)])
    target = cluster.addresses[0]
    channel = grpc.insecure_channel(target)
    calls = {path: channel.unary_unary(path) for path, _ in METHODS}
    raft = channel.stream_unary("/mqds.server.raft.v1.Raft/Stream")
    secret = [(SECRET_HEADER, cluster.secret), (NODE_HEADER, "fuzzer")]
    codes: set[grpc.StatusCode] = set()

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.sampled_from(METHODS), request_bytes)
    def public(method: tuple[str, str], raw: bytes) -> None:
        path, name = method
        try:
            calls[path](NEVER_PARSES if name in DESTRUCTIVE else raw, timeout=10)
            codes.add(grpc.StatusCode.OK)
        except grpc.RpcError as err:
            codes.add(err.code())
            assert err.code() != grpc.StatusCode.UNKNOWN, (path, err.details())

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.binary(max_size=300), min_size=1, max_size=5))
    def raft_frames(frames: list[bytes]) -> None:
        try:
            raft(iter(frames), timeout=5, metadata=secret)
        except grpc.RpcError as err:
            assert err.code() != grpc.StatusCode.UNKNOWN, err.details()

    public()
    raft_frames()
    assert all(alive(address) for address in cluster.addresses)
    assert grpc.StatusCode.INVALID_ARGUMENT in codes  # the garbage did reach the parsers
    with Client(cluster.addresses, timeout_s=30) as client:
        kept = {(m.topic, m.payload, m.timestamp_us) for m in client.replay("keep/#")}
        assert kept == {(m.topic, m.payload, m.timestamp_us) for m in before}
        assert client.store_batch([Message("keep/after", b"ok", sender="k0")])[0].timestamp_us
    cluster.assert_replicas_identical(timeout_s=60)
