"""Hostile requests against a live 3-node cluster, for every public and internal RPC.

Hypothesis builds well-formed but hostile requests from each method's protobuf
descriptor: deep and odd topics, edge-case numbers, unknown enum values,
repeated fields with thousands of (duplicate) entries, garbage bytes where
bytes go. They are sent without credentials, and with the cluster secret where
authentication would otherwise stop them before the code worth testing (never
to a call that would legitimately destroy data when the request happens to
make sense: those get no credentials and must be refused). After each batch
of examples the invariants a user relies on are checked:

- no answer is INTERNAL or UNKNOWN: bad input gets a status that says what
  was wrong;
- liveness answers within a second on every node;
- every node stays alive, and at the end ready, with every shard taking
  writes, node memory within a bound, and everything acknowledged before
  still there and the same on every replica.

The raw-bytes fuzzing of every method and of the Raft stream is in
``test_fuzz.py``; the hand-written requests that found the defects are in
``test_hostile_requests.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as pbd
from google.protobuf import message_factory
from google.protobuf.message import Message as PbMessage
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mqds.client import Client, Message
from mqds.protocol.sharding import shard_of
from mqds.server.auth import ADMIN, METHOD_ROLES
from mqds.server.raft.cluster_auth import NODE_HEADER, SECRET_HEADER
from mqds.server.raft.v1 import raft_pb2
from mqds.tools.localproc import LocalCluster
from mqds.v1 import cluster_pb2, sessions_pb2, storage_pb2

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_SHARDS = 2
# Calls that change or destroy state when the request makes sense: they are
# sent without credentials only, and must be refused. Every admin method but
# the export (a read) is one, taken from the node's own table, so a new admin
# call cannot be fuzzed with the secret by mistake: DeleteMessages, SetRetention
# and ImportShard, added after this list was first written, once deleted the
# messages the test then looked for (a full make test, 2026-11-29).
READ_ONLY_ADMIN = {"/mqds.v1.Storage/ExportShard"}
DESTRUCTIVE = {method for method, role in METHOD_ROLES.items() if role == ADMIN} - READ_ONLY_ADMIN | {
    "/mqds.server.raft.v1.Raft/ChangeMembership",
    "/mqds.server.raft.v1.Raft/TransferLeadership",
    "/mqds.server.raft.v1.Raft/ProposeMeta",
    "/mqds.server.raft.v1.Raft/InjectFault",
}
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
EXAMPLES_PER_METHOD = 10
# A node's resident memory may grow by this much over the whole run.
MAX_RSS_GROWTH_BYTES = 400 * 1024 * 1024


def _methods() -> list[tuple[str, pbd.MethodDescriptor]]:
    found = []
    for module in (storage_pb2, sessions_pb2, cluster_pb2, raft_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                if method.client_streaming:
                    continue  # the Raft stream: frames are fuzzed in test_fuzz.py
                found.append((f"/{service.full_name}/{method.name}", method))
    return found


METHODS = _methods()

# Values worth trying, by field type.
_TOPIC_LIKE = st.one_of(
    st.sampled_from(
        [
            "",
            "#",
            "+",
            "/",
            "$",
            "$SYS/#",
            "a/#/b",
            "a/+b",
            "\x00",
            "a\x00b",
            "x" * 70_000,
            "/".join(["d"] * 1_500),
            "/".join(["+"] * 1_200),
            "/".join(["+"] * 1_200) + "/#",
            "$" + "/x" * 1_000,
            "\ud7ff/\ue000",
        ]
    ),
    st.text(alphabet=st.sampled_from("ab/+#$\x00 é"), max_size=40),
)
_INTS = st.sampled_from([0, 1, -1, 2, 7, 2**31 - 1, -(2**31), 2**32 - 1, 2**63 - 1, -(2**63), 2**64 - 1])
_SIGNED = {pbd.FieldDescriptor.TYPE_INT32, pbd.FieldDescriptor.TYPE_SINT32, pbd.FieldDescriptor.TYPE_SFIXED32}
_SIGNED64 = {pbd.FieldDescriptor.TYPE_INT64, pbd.FieldDescriptor.TYPE_SINT64, pbd.FieldDescriptor.TYPE_SFIXED64}
_UNSIGNED = {pbd.FieldDescriptor.TYPE_UINT32, pbd.FieldDescriptor.TYPE_FIXED32}
_UNSIGNED64 = {pbd.FieldDescriptor.TYPE_UINT64, pbd.FieldDescriptor.TYPE_FIXED64}


def _fits(field: pbd.FieldDescriptor) -> Callable[[int], bool]:
    if field.type in _SIGNED:
        return lambda v: -(2**31) <= v < 2**31
    if field.type in _SIGNED64:
        return lambda v: -(2**63) <= v < 2**63
    if field.type in _UNSIGNED:
        return lambda v: 0 <= v < 2**32
    return lambda v: 0 <= v < 2**64


def _scalar(field: pbd.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    t = field.type
    if t == pbd.FieldDescriptor.TYPE_STRING:
        return _TOPIC_LIKE
    if t == pbd.FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.just(b"\xff" * 5000))
    if t == pbd.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (pbd.FieldDescriptor.TYPE_DOUBLE, pbd.FieldDescriptor.TYPE_FLOAT):
        return st.sampled_from([0.0, -1.0, 1e300, float("inf"), float("nan")])
    if t == pbd.FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values] + [99, -5])
    if t == pbd.FieldDescriptor.TYPE_MESSAGE:
        return _message(field.message_type, depth + 1)
    return _INTS.filter(_fits(field))


def _field(field: pbd.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    one = _scalar(field, depth)
    if not field.is_repeated:
        return one
    if field.type == pbd.FieldDescriptor.TYPE_MESSAGE:
        return st.lists(one, max_size=3 if depth else 30)
    # Few values, or thousands of the same small one (amplification: a
    # request of a few hundred KB that asks for the same thing again and again).
    small = st.sampled_from(["a", "#", "+"]) if field.type == pbd.FieldDescriptor.TYPE_STRING else one
    if field.type == pbd.FieldDescriptor.TYPE_BYTES:
        small = st.just(b"\x01")
    many = st.tuples(small, st.sampled_from([2_000, 50_000])).map(lambda p: [p[0]] * p[1])
    return st.one_of(st.lists(one, max_size=5), many)


def _message(descriptor: pbd.Descriptor, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    if depth > 2:
        return st.just({})
    fields = {f.name: _field(f, depth) for f in descriptor.fields}
    return st.fixed_dictionaries({}, optional=fields)


def _build(descriptor: pbd.Descriptor, values: dict[str, Any]) -> PbMessage:
    msg = message_factory.GetMessageClass(descriptor)()
    _fill(msg, values)
    return msg


def _fill(msg: PbMessage, values: dict[str, Any]) -> None:
    for name, value in values.items():
        field = msg.DESCRIPTOR.fields_by_name[name]
        if field.type == pbd.FieldDescriptor.TYPE_MESSAGE:
            if field.is_repeated:
                if field.message_type.GetOptions().map_entry:
                    continue  # maps: left empty
                for item in value:
                    _fill(getattr(msg, name).add(), item)
            else:
                _fill(getattr(msg, name), value)
            continue
        try:
            if field.is_repeated:
                getattr(msg, name).extend(value)
            else:
                setattr(msg, name, value)
        except (ValueError, TypeError):
            pass  # a value this field cannot hold (an unknown enum in proto2, a surrogate): left unset


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("adversarial") / "c", 3, n_shards=N_SHARDS) as c:
        c.start()
        yield c


def _live_within_1s(address: str) -> None:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    started = time.monotonic()
    answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    assert time.monotonic() - started < 1.0


def _one_sender_per_shard() -> list[str]:
    senders: dict[int, str] = {}
    i = 0
    while len(senders) < N_SHARDS:
        senders.setdefault(shard_of(f"w{i}", N_SHARDS), f"w{i}")
        i += 1
    return [senders[s] for s in range(N_SHARDS)]


def test_hostile_requests_get_clear_answers_and_take_nothing_down(cluster: LocalCluster) -> None:
    with Client(cluster.addresses, timeout_s=30) as client:
        before = client.store_batch([Message(f"keep/{i % 5}", f"v{i}".encode(), sender=f"k{i % 3}") for i in range(60)])
    rss_before = {n: _rss_bytes(p.pid) for n, p in cluster.nodes.items() if p.pid}
    channels = {address: grpc.insecure_channel(address) for address in cluster.addresses}
    secret = [(SECRET_HEADER, cluster.secret), (NODE_HEADER, "adversary")]
    seen: dict[str, set[grpc.StatusCode]] = {}
    examples = 0

    def call(address: str, path: str, raw: bytes, metadata: list[tuple[str, str]] | None) -> grpc.StatusCode:
        method = dict(METHODS)[path]
        channel = channels[address]
        try:
            if method.server_streaming:
                for _ in channel.unary_stream(path)(raw, timeout=10, metadata=metadata):
                    pass
            else:
                channel.unary_unary(path)(raw, timeout=10, metadata=metadata)
            return grpc.StatusCode.OK
        except grpc.RpcError as err:
            assert err.code() not in BAD, (path, metadata is not None, err.code(), err.details())
            return err.code()

    def examples_of(path: str, method: pbd.MethodDescriptor) -> None:
        @settings(max_examples=EXAMPLES_PER_METHOD, deadline=None, suppress_health_check=list(HealthCheck))
        @given(_message(method.input_type), st.sampled_from(range(3)), st.booleans())
        def hostile(values: dict[str, Any], node: int, with_secret: bool) -> None:
            nonlocal examples
            raw = _build(method.input_type, values).SerializeToString()
            assume(len(raw) < 4 * 1024 * 1024)
            trusted = with_secret and path not in DESTRUCTIVE
            code = call(cluster.addresses[node], path, raw, secret if trusted else None)
            seen.setdefault(path, set()).add(code)
            if path in DESTRUCTIVE:
                assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), (path, code)
            examples += 1
            if examples % 25 == 0:
                for a in cluster.addresses:
                    _live_within_1s(a)

        hostile()

    for path, method in METHODS:  # every method, a few examples each
        examples_of(path, method)
    # Every method was tried, and the requests reached the code behind authentication.
    assert set(seen) == {path for path, _ in METHODS}, sorted({p for p, _ in METHODS} - set(seen))
    assert any(grpc.StatusCode.INVALID_ARGUMENT in codes for codes in seen.values())

    for address in cluster.addresses:
        _live_within_1s(address)
    cluster.wait_ready(60)
    for node_id, proc in cluster.nodes.items():
        assert proc.running, f"{node_id} died:\n{proc.output()}"
        grown = _rss_bytes(proc.pid) - rss_before[node_id]
        assert grown < MAX_RSS_GROWTH_BYTES, f"{node_id} grew by {grown / 2**20:.0f} MiB"
    with Client(cluster.addresses, timeout_s=30) as client:
        for sender in _one_sender_per_shard():
            assert client.store_batch([Message("keep/after", sender.encode(), sender=sender)])[0].timestamp_us
        kept = {(m.topic, m.payload, m.timestamp_us) for m in client.replay("keep/#") if m.topic != "keep/after"}
        assert kept == {(m.topic, m.payload, m.timestamp_us) for m in before}
    cluster.assert_replicas_identical(timeout_s=60)
