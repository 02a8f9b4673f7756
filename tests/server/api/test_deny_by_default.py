"""Every method of a live node, as the method table says: authenticated, counted and bounded.

The methods come from the table the node applies (``mqds.server.api.methods``),
which ``tests/server/api/test_methods.py`` checks against the services' descriptors;
here each one is called on a real node with no token, a forged one, each
role's and the cluster secret, and the defects the table's rules fixed are
reproduced as an attacker did (issue 44's cases 1, 2, 3 and 11).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from harness import ServerProcess, rss_bytes

from mqds.client import Client, ConnectionSettings, Message
from mqds.server.api.methods import METHODS, SERVED, Role
from mqds.server.raft.cluster_auth import NODE_HEADER, SECRET_HEADER
from mqds.v1 import storage_pb2 as pb

pytestmark = pytest.mark.integration

SECRET = "deny-by-default-secret-0123456789"
TOKENS = {"reader": "reader-token-0123456789", "broker": "broker-token-0123456789", "admin": "admin-token-0123456789"}
RANK = {"reader": 0, "broker": 1, "admin": 2}
REFUSED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED}
# Sent with the secret, an empty request of these would change the cluster's own state (membership, the
# metadata log): their refusals are checked, their handlers are the adversarial suite's (never with proof).
NOT_SENT_WITH_PROOF = {
    "/mqds.server.raft.v1.Raft/ChangeMembership",
    "/mqds.server.raft.v1.Raft/TransferLeadership",
    "/mqds.server.raft.v1.Raft/ProposeMeta",
}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    base = tmp_path_factory.mktemp("deny")
    tokens = base / "tokens"
    tokens.write_text("".join(f"{role} {token}\n" for role, token in TOKENS.items()))
    proc = ServerProcess(
        base / "n1",
        args=["--auth-tokens-file", str(tokens), "--n-shards", "2", "--fault-injection", "true"],
        env={"MQDS_CLUSTER_SECRET": SECRET},
    ).start()
    yield proc
    proc.kill()


def _types() -> dict[str, Any]:
    return {f"/{service.full_name}/{method.name}": method for service in SERVED for method in service.methods}


def _call(channel: grpc.Channel, path: str, metadata: list[tuple[str, str]]) -> grpc.StatusCode:
    """One call of ``path`` with an empty request (one message, for a stream), answered or refused."""
    method = _types()[path]
    raw = message_factory.GetMessageClass(method.input_type)().SerializeToString()
    try:
        if method.client_streaming and method.server_streaming:
            for _ in channel.stream_stream(path)(iter([raw]), timeout=3, metadata=metadata):
                pass
        elif method.client_streaming:
            channel.stream_unary(path)(iter([raw]), timeout=3, metadata=metadata)
        elif method.server_streaming:
            for _ in channel.unary_stream(path)(raw, timeout=3, metadata=metadata):
                pass
        else:
            channel.unary_unary(path)(raw, timeout=3, metadata=metadata)
    except grpc.RpcError as err:
        code = err.code()
        assert code not in NEVER, (path, metadata, code, err.details())
        return code
    return grpc.StatusCode.OK


def test_every_method_with_no_token_a_forged_one_each_role_and_the_secret(node: ServerProcess) -> None:
    credentials: dict[str, list[tuple[str, str]]] = {
        "none": [],
        "forged": [("authorization", "Bearer forged-token-0123456789")],
        **{role: [("authorization", f"Bearer {token}")] for role, token in TOKENS.items()},
        "secret": [(SECRET_HEADER, SECRET), (NODE_HEADER, "tester")],
        "wrong-secret": [(SECRET_HEADER, "not-the-secret-0123456789"), (NODE_HEADER, "tester")],
    }
    wrong: list[tuple[str, str, str]] = []
    with grpc.insecure_channel(node.address) as channel:
        for path, entry in sorted(METHODS.items()):
            if entry.role is Role.NOBODY:
                with pytest.raises(grpc.RpcError) as unserved:
                    channel.unary_unary(path)(b"", timeout=3)
                assert unserved.value.code() == grpc.StatusCode.UNIMPLEMENTED
                continue
            for who, metadata in credentials.items():
                if who == "secret" and path in NOT_SENT_WITH_PROOF:
                    continue
                code = _call(channel, path, metadata)
                if entry.role is Role.ANYONE:
                    allowed = True
                elif entry.role is Role.NODE:
                    allowed = who == "secret"
                elif who == "secret":
                    allowed = True
                elif who in RANK:
                    allowed = RANK[who] >= RANK[entry.role.value]
                else:
                    allowed = False
                if allowed and code in REFUSED:
                    wrong.append((path, who, f"refused: {code.name}"))
                if not allowed:
                    expected = grpc.StatusCode.PERMISSION_DENIED if who in RANK else grpc.StatusCode.UNAUTHENTICATED
                    if entry.role is Role.NODE:
                        expected = grpc.StatusCode.UNAUTHENTICATED  # tokens are no node's proof
                    if code != expected:
                        wrong.append((path, who, f"{code.name}, not {expected.name}"))
    assert not wrong, "\n".join(f"{p} as {w}: {why}" for p, w, why in wrong)


def test_follow_needs_a_reader_token(node: ServerProcess) -> None:
    """Issue 44, case 1: a Follow with no token, or a made-up one, read a broker's messages."""
    broker = ConnectionSettings(timeout_s=15, auth_token=TOKENS["broker"])
    with Client([node.address], settings=broker) as client:
        (stored,) = client.store_batch([Message("deny/follow", b"secret payload", sender="b1")])
    start = pb.FollowStart(id=1, topic_filter="#", shard=stored.shard, credit=1000, stale_ok=True)
    request = pb.FollowRequest(start=start)
    with grpc.insecure_channel(node.address) as channel:
        follow = channel.stream_stream(
            "/mqds.v1.Storage/Follow",
            request_serializer=pb.FollowRequest.SerializeToString,
            response_deserializer=pb.FollowResponse.FromString,
        )
        for metadata in ([], [("authorization", "Bearer made-up-token-0123456789")]):
            with pytest.raises(grpc.RpcError) as refused:
                for _ in follow(iter([request]), timeout=5, metadata=metadata):
                    pass
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # A reader's is served: the same start reads the message.
        requests: queue.SimpleQueue[pb.FollowRequest | None] = queue.SimpleQueue()
        requests.put(request)
        call = follow(iter(requests.get, None), timeout=15, metadata=[("authorization", f"Bearer {TOKENS['reader']}")])
        try:
            for answer in call:
                assert not answer.HasField("failure"), answer.failure
                if answer.messages:
                    assert answer.messages[0].payload == b"secret payload"
                    break
        finally:
            call.cancel()


def test_garbage_to_fetch_snapshot_is_invalid_argument_not_internal(node: ServerProcess) -> None:
    """Issue 44, case 11: garbage bytes to the internal FetchSnapshot answered INTERNAL."""
    with grpc.insecure_channel(node.address) as channel:
        fetch = channel.unary_stream("/mqds.server.raft.v1.Raft/FetchSnapshot")
        with pytest.raises(grpc.RpcError) as bad:
            list(fetch(b"\xff" * 24, timeout=5, metadata=[(SECRET_HEADER, SECRET)]))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad.value.details()
        assert "FetchSnapshot" in (bad.value.details() or "")
        with pytest.raises(grpc.RpcError) as anonymous:
            list(fetch(b"\xff" * 24, timeout=5))
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_credit_request_of_millions_of_ids_is_refused_before_anything_is_built(node: ServerProcess) -> None:
    """Issue 44, case 3: a 50 MB FollowCredit of fifty million ids took a node from 83 MiB to 1.9 GiB.

    One with a million ids (a megabyte) is refused for its count, one of fifty
    megabytes for its size, each before the node builds anything from them. gRPC
    itself reads a message whole before the guard sees it (its slices, then the
    bytes handed to the deserializer, and what the stream's window let in of the
    next one), so the node may hold the raw request two or three times over; never
    the objects parsed from it, which were forty times its size.
    """
    assert node.pid is not None
    before = rss_bytes(node.pid)
    reader = [("authorization", f"Bearer {TOKENS['reader']}")]
    counted = pb.FollowRequest(credit=pb.FollowCredit(id=1, messages=1, also=[1] * 1_000_000)).SerializeToString()
    huge = pb.FollowRequest(credit=pb.FollowCredit(id=1, messages=1, also=[2**40] * 8_000_000)).SerializeToString()
    assert len(counted) < 2**21 and len(huge) > 40 * 2**20
    answers = {}
    with grpc.insecure_channel(node.address, options=[("grpc.max_send_message_length", 64 * 2**20)]) as channel:
        follow = channel.stream_stream("/mqds.v1.Storage/Follow")
        for name, raw in (("count", counted), ("bytes", huge)):
            with pytest.raises(grpc.RpcError) as refused:
                for _ in follow(iter([raw, raw, raw]), timeout=30, metadata=reader):
                    pass
            answers[name] = (refused.value.code(), refused.value.details() or "")
    assert answers["count"][0] == grpc.StatusCode.INVALID_ARGUMENT, answers
    assert "FollowCredit.also holds 1,000,000 entries; at most 10,000 (follow_max_subscriptions)" in answers["count"][1]
    assert answers["bytes"][0] == grpc.StatusCode.INVALID_ARGUMENT, answers
    assert "4 MiB for a request that carries no messages" in answers["bytes"][1]
    grown = rss_bytes(node.pid) - before
    held = 3 * len(huge)
    assert grown < held, f"the node grew by {grown / 2**20:.0f} MiB for a {len(huge) / 2**20:.0f} MiB request"


def test_idle_streams_take_no_worker_from_unary_calls_or_peers(tmp_path: Path) -> None:
    """Issue 44, case 2: 70 idle Follow calls made StoreBatch, GetStreams and Raft/LinkAddress time out.

    A node with small pools: more idle Follow calls than it has workers, over
    three connections. It holds ``max_public_streams`` of them and refuses the
    rest at once; writes, reads and the peers' internal calls are answered
    meanwhile.
    """
    args = ["--grpc-workers", "16", "--max-public-calls", "8", "--max-public-streams", "8"]
    args += ["--max-calls-per-client", "8"]
    proc = ServerProcess(tmp_path / "n1", args=args, env={"MQDS_CLUSTER_SECRET": SECRET}).start()
    channels = [grpc.insecure_channel(proc.address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(4)]
    stop = threading.Event()
    calls: list[Any] = []

    def idle() -> Iterator[bytes]:
        """A request stream that stays open and sends nothing."""
        stop.wait(60)
        yield from ()

    try:
        for i in range(21):
            calls.append(channels[i % 3].stream_stream("/mqds.v1.Storage/Follow")(idle(), timeout=60))
        deadline = time.monotonic() + 10
        while sum(c.done() for c in calls) < 13 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # what a node lets in has reached its handlers by now
        # Writes, reads and a peer's internal call are answered with the node's streams all held.
        settings = ConnectionSettings(timeout_s=5, cluster_secret=SECRET)
        with Client([proc.address], settings=settings) as client:
            started = time.monotonic()
            assert client.store_batch([Message("idle/streams", b"1", sender="s")])[0].timestamp_us
            assert client.get_streams("idle/#")
            assert time.monotonic() - started < 5
        link = channels[3].unary_unary("/mqds.server.raft.v1.Raft/LinkAddress")
        assert link(b"", timeout=5, metadata=[(SECRET_HEADER, SECRET), (NODE_HEADER, "n9")]) is not None
        # It holds max_public_streams of the idle calls and turned the rest away at once.
        refused = [c for c in calls if c.done()]
        assert len(refused) == 13, f"{len(refused)} of 21 idle Follow calls were turned away"
        assert {c.code() for c in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert any("max_public_streams" in (c.details() or "") for c in refused)
    finally:
        stop.set()
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()
        proc.kill()
