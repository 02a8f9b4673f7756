"""The node's method table covers everything the node serves, and the guard refuses what it does not list.

Deny by default: a method of a served service without an entry, or a repeated
field of a request without a limit, fails here, so the next method (or the
next field of a request) cannot ship open. The services come from their
descriptors, not from a list kept by hand.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from repo_paths import ROOT

from mqds.server.api.guard import ApiGuard, CallLimits
from mqds.server.api.methods import FIELD_LIMITS, METHODS, SERVED, Elsewhere, Lane, Role, request_types
from mqds.server.api.request_bounds import FieldBounds
from mqds.server.api.server import grpc_server
from mqds.server.config import NodeConfig
from mqds.server.raft.cluster_auth import ClusterAuth
from mqds.server.raft.v1 import raft_pb2
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb


def _served_methods() -> set[str]:
    return {f"/{service.full_name}/{method.name}" for service in SERVED for method in service.methods}


def test_every_method_of_every_served_service_has_an_entry_and_no_entry_is_stale() -> None:
    served = _served_methods()
    assert served - set(METHODS) == set(), "methods the node serves without an entry in methods.METHODS"
    assert set(METHODS) - served == set(), "entries for methods the node does not serve"


def test_the_port_adds_only_health_and_reflection_to_the_nodes_services() -> None:
    """``grpc_server`` registers health and reflection beside the node's own handlers, both in the table.

    That the node's handlers serve every method of the table is the live test's
    part (``test_auth.py`` calls each one on a node).
    """
    server = grpc_server(NodeConfig(node_id="n1"), (), [], health.HealthServicer())
    state = server._state  # type: ignore[attr-defined]
    added = {handler.service_name() for handler in state.generic_handlers}
    added |= {path.strip("/").split("/")[0] for path in state.registered_method_handlers}
    assert added == {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    assert added <= {service.full_name for service in SERVED}


def test_every_repeated_field_of_every_request_has_a_limit() -> None:
    """Every repeated field and map a request can hold, at any depth, is counted or names what bounds it."""
    needed = set()
    for service in SERVED:
        for method in service.methods:
            for message in request_types(method.input_type):
                for field in message.fields:
                    if field.is_repeated:
                        needed.add(f"{message.full_name}.{field.name}")
    assert needed - set(FIELD_LIMITS) == set(), "repeated request fields without an entry in FIELD_LIMITS"
    assert set(FIELD_LIMITS) - needed == set(), "FIELD_LIMITS entries for no request field"
    for name, entry in FIELD_LIMITS.items():
        if isinstance(entry, Elsewhere):
            assert len(entry.why) > 20, f"{name}: say what bounds it"


def test_the_limits_are_applied_where_the_request_is_decoded() -> None:
    config = NodeConfig(node_id="n1", follow_max_subscriptions=100, n_shards=4)
    follow = FieldBounds.of(pb.FollowRequest.DESCRIPTOR, FIELD_LIMITS, config)
    assert follow is not None
    follow.check(pb.FollowRequest(credit=pb.FollowCredit(id=1, messages=1, also=list(range(100)))))
    with pytest.raises(
        Exception, match=r"FollowCredit.also holds 101 entries; at most 100 \(follow_max_subscriptions\)"
    ):
        follow.check(pb.FollowRequest(credit=pb.FollowCredit(id=1, messages=1, also=list(range(101)))))
    with pytest.raises(Exception, match=r"FollowStart\.also holds 5,000 entries"):
        follow.check(pb.FollowRequest(start=pb.FollowStart(id=1, also=[7] * 5000)))
    # Nested in repeated elements: each session's own lists are counted too.
    shared = FieldBounds.of(spb.FetchMessagesSharedRequest.DESCRIPTOR, FIELD_LIMITS, config)
    assert shared is not None
    request = spb.FetchMessagesSharedRequest(sessions=[spb.SharedFetchSession(), spb.SharedFetchSession()])
    request.sessions[1].shards.extend([0] * 5)
    with pytest.raises(Exception, match=r"sessions\[1\]: SharedFetchSession.shards holds 5 entries; at most 4"):
        shared.check(request)
    # A batch over max_batch_messages keeps its reason (a client splits on BATCH_TOO_LARGE).
    batch = FieldBounds.of(pb.StoreBatchRequest.DESCRIPTOR, FIELD_LIMITS, NodeConfig(max_batch_messages=2))
    assert batch is not None
    with pytest.raises(Exception, match="BATCH_TOO_LARGE"):
        batch.check(pb.StoreBatchRequest(messages=[pb.Message()] * 3))
    # A Raft frame is bytes until the router parses it: nothing to count before that.
    assert FieldBounds.of(raft_pb2.Frame.DESCRIPTOR, FIELD_LIMITS, config) is None


def test_internal_methods_are_the_nodes_alone_and_probes_need_nothing() -> None:
    for path, entry in METHODS.items():
        if path.startswith("/mqds.server.raft.v1.Raft/"):
            assert entry.role is Role.NODE and entry.lane in (Lane.INTERNAL, Lane.PEER), path
        elif entry.role in (Role.ANYONE, Role.NOBODY):
            assert path.startswith("/grpc.health.v1.Health/"), path
        if entry.lane is Lane.PROBE:
            assert entry.role in (Role.ANYONE, Role.NOBODY), path
    streaming = {
        f"/{s.full_name}/{m.name}" for s in SERVED for m in s.methods if m.client_streaming or m.server_streaming
    }
    # A held stream never runs on the workers unary calls and peers need.
    assert {p for p in streaming if METHODS[p].lane not in (Lane.STREAM, Lane.PEER)} == set()


def _serve(guard: ApiGuard, handlers: dict[str, Any], service: str = "mqds.v1.Storage") -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=(guard,))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_a_method_without_an_entry_is_refused_and_never_reaches_its_handler() -> None:
    """A method the server has a handler for, missing from the table: refused before its handler runs."""
    reached = threading.Event()

    def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
        reached.set()
        return b""

    table = {p: m for p, m in METHODS.items() if p != "/mqds.v1.Storage/GetFences"}
    guard = ApiGuard({}, ClusterAuth("n1", "", "", False), CallLimits(), methods=table)
    server, address = _serve(guard, {"GetFences": grpc.unary_unary_rpc_method_handler(handler)})
    try:
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary("/mqds.v1.Storage/GetFences")(b"", timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "serves no method /mqds.v1.Storage/GetFences" in (refused.value.details() or "")
            # Health answers: it is in the table.
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        time.sleep(0.2)
        assert not reached.is_set()
        assert guard.rejected["UNKNOWN_METHOD"] == 1
    finally:
        server.stop(None)


def test_garbage_to_a_library_handler_is_invalid_argument_not_internal() -> None:
    """gRPC answers INTERNAL when a deserializer raises; the guard's never does, for any handler."""
    guard = ApiGuard({}, ClusterAuth("n1", "", "", False), CallLimits(), config=NodeConfig(node_id="n1"))
    server, address = _serve(guard, {})
    try:
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary("/grpc.health.v1.Health/Check")(b"\xff" * 24, timeout=5)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
            assert "not a valid Check's request" in (refused.value.details() or "")
    finally:
        server.stop(None)


def test_a_node_role_method_needs_the_secret_and_says_which_secret_was_wrong() -> None:
    def link(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b""

    guard = ApiGuard({"t" * 16: "admin"}, ClusterAuth("n1", "", "s" * 24, False), CallLimits())
    server, address = _serve(
        guard, {"LinkAddress": grpc.unary_unary_rpc_method_handler(link)}, "mqds.server.raft.v1.Raft"
    )
    call_path = "/mqds.server.raft.v1.Raft/LinkAddress"
    try:
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_unary(call_path)
            assert call(b"", timeout=5, metadata=[("x-mqds-cluster-secret", "s" * 24)]) == b""
            answers = {}
            for name, metadata in {
                "none": [],
                "wrong": [("x-mqds-cluster-secret", "w" * 24)],
                "admin-token": [("authorization", "Bearer " + "t" * 16)],
            }.items():
                with pytest.raises(grpc.RpcError) as refused:
                    call(b"", timeout=5, metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                answers[name] = refused.value.details() or ""
            assert "is not this cluster's" in answers["wrong"]
            assert "present the cluster secret" in answers["none"]
            assert answers["admin-token"] == answers["none"]  # a token is no node's proof
    finally:
        server.stop(None)


def test_streams_have_a_pool_and_a_bound_of_their_own() -> None:
    """Streams held open take no worker: unary calls go on with every stream slot taken."""
    release = threading.Event()

    def hold(requests: Any, context: grpc.ServicerContext) -> Any:
        release.wait(20)
        yield b""

    def quick(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b"ok"

    streams = futures.ThreadPoolExecutor(max_workers=4)
    control = futures.ThreadPoolExecutor(max_workers=2)
    limits = CallLimits(max_public_calls=2, max_public_streams=4, max_internal_calls=2)
    guard = ApiGuard({}, ClusterAuth("n1", "", "", False), limits, control_pool=control, stream_pool=streams)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=(guard,))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "mqds.v1.Storage",
                {
                    "Follow": grpc.stream_stream_rpc_method_handler(hold),
                    "GetFences": grpc.unary_unary_rpc_method_handler(quick),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channels = [
        grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(3)
    ]
    try:
        follow = channels[0].stream_stream("/mqds.v1.Storage/Follow")
        held = [follow(iter(()), timeout=30) for _ in range(4)]
        deadline = time.monotonic() + 5
        while guard.in_flight(Lane.STREAM) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert guard.in_flight(Lane.STREAM) == 4
        with pytest.raises(grpc.RpcError) as refused:
            next(channels[1].stream_stream("/mqds.v1.Storage/Follow")(iter(()), timeout=5))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_public_streams" in (refused.value.details() or "")
        for _ in range(10):
            assert channels[2].unary_unary("/mqds.v1.Storage/GetFences")(b"", timeout=2) == b"ok"
        release.set()
        for call in held:
            assert list(call) == [b""]
    finally:
        release.set()
        for channel in channels:
            channel.close()
        server.stop(None)


def test_docs_security_gives_each_methods_role_and_lane_as_the_table_does() -> None:
    """docs/security.md's table of methods says what the node's table says, row for row."""
    text = (ROOT / "docs" / "security.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`") and "/" in cells[0]:
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    wrong = []
    for path, entry in METHODS.items():
        service, name = path.strip("/").split("/")
        short = f"{service.rsplit('.', 1)[-1]}/{name}"
        if rows.get(short) != (entry.role.value, entry.lane.value):
            wrong.append(f"{short}: docs say {rows.get(short)}, the table ({entry.role.value}, {entry.lane.value})")
    assert not wrong, "\n".join(wrong)
