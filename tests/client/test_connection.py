"""Client connection settings: validation, and the auth token on every call (an in-process gRPC server)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from tls_certs import TestCA

from mqds.client import Client, ConnectionSettings, Message, aio
from mqds.client import errors as E
from mqds.client.connection import resolve_settings
from mqds.client.core.retry import MIN_RETRY_S
from mqds.client.sync.routing import Backoff, Fanout, MapRefresh, MapWait, RoutingTable, ShardRetry
from mqds.protocol import errors as perrors
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc
from mqds.v1 import storage_pb2 as pb
from mqds.v1 import storage_pb2_grpc as pb_grpc


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"timeout_s": 0}, "timeout_s must be a positive"),
        ({"keepalive_time_s": -1}, "keepalive_time_s must be a positive"),
        ({"keepalive_timeout_s": 0}, "keepalive_timeout_s"),
        ({"max_send_message_bytes": 0}, "max_send_message_bytes"),
        ({"max_receive_message_bytes": 1.5}, "max_receive_message_bytes"),
        ({"tls_client_cert": b"x"}, "go together"),
        ({"tls_client_key": "key.pem"}, "go together"),
        ({"tls_server_name": "node.example"}, "needs TLS"),
        ({"tls": True, "tls_server_name": ""}, "non-empty"),
        ({"auth_token": "Bearer abc"}, "without spaces"),
        ({"auth_token": ""}, "non-empty"),
        ({"auth_token": "caf\u00e9"}, "ASCII"),
    ],
)
def test_bad_settings_are_refused_with_a_clear_message(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError) as exc:
        ConnectionSettings(**changes)
    assert words in str(exc.value)


def test_tls_files_are_read_when_the_client_is_created(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    with pytest.raises(ValueError, match=r"cannot read tls_ca file .*missing\.pem"):
        Client("127.0.0.1:1", settings=ConnectionSettings(tls_ca=tmp_path / "missing.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match=r"tls_ca file .*junk\.pem is not PEM"):
        aio.Client("127.0.0.1:1", settings=ConnectionSettings(tls_ca=str(tmp_path / "junk.pem")))
    issued = ca.issue("client")
    with pytest.raises(ValueError, match="tls_client_key is not a PEM private key"):
        Client(
            "127.0.0.1:1",
            settings=ConnectionSettings(tls_ca=ca.pem, tls_client_cert=issued.cert_pem, tls_client_key=issued.cert_pem),
        )
    # Paths, PEM bytes and PEM text are all accepted.
    for value in (ca.file, str(ca.file), ca.pem, ca.pem.decode()):
        Client("127.0.0.1:1", settings=ConnectionSettings(tls_ca=value)).close()


def test_secrets_stay_out_of_the_repr() -> None:
    text = repr(ConnectionSettings(auth_token="s3cret-token", tls=True))
    assert "s3cret-token" not in text


def test_the_older_keyword_arguments_override_the_settings() -> None:
    base = ConnectionSettings(timeout_s=5, auth_token="t")
    resolved = resolve_settings(base, 7.0, 1000)
    assert (resolved.timeout_s, resolved.max_send_message_bytes, resolved.max_receive_message_bytes) == (
        7.0,
        1000,
        1000,
    )
    assert resolved.auth_token == "t"
    assert resolve_settings(base, None, None) is base
    client = Client("127.0.0.1:1", timeout_s=3)
    assert client.timeout_s == 3 and client.settings.timeout_s == 3
    client.close()


class _Recorder(clpb_grpc.ClusterServicer, pb_grpc.StorageServicer):
    """A one-node, one-shard stand-in for mqds that records each call's metadata."""

    def __init__(self) -> None:
        self.address = ""
        self.calls: list[tuple[str, dict[str, str]]] = []
        # GetClusterMap fails with these first (a node not in a cluster yet), then answers after this pause.
        self.map_errors: list[perrors.MqdsError] = []
        self.map_delay_s = 0.0

    def _record(self, method: str, context: grpc.ServicerContext) -> None:
        self.calls.append((method, dict(context.invocation_metadata())))

    def GetClusterMap(self, request: Any, context: grpc.ServicerContext) -> clpb.ClusterMap:
        self._record("GetClusterMap", context)
        if self.map_errors:
            context.abort_with_status(perrors.to_status(self.map_errors.pop(0)))
        time.sleep(self.map_delay_s)
        cmap = clpb.ClusterMap(cluster_id="fake", n_shards=1, version=1, meta_leader="f1")
        cmap.nodes.add(id="f1", address=self.address)
        cmap.vnodes.add(shard=0, replicas=["f1"], leader="f1", term=1)
        return cmap

    def ListGenerations(self, request: Any, context: grpc.ServicerContext) -> pb.ListGenerationsResponse:
        self._record("ListGenerations", context)
        return pb.ListGenerationsResponse(generations=[pb.Generation(shard=0, generation=1, current=True)])

    def StoreBatch(self, request: Any, context: grpc.ServicerContext) -> pb.StoreBatchResponse:
        self._record("StoreBatch", context)
        return pb.StoreBatchResponse(
            positions=[pb.MessagePosition(shard=0, timestamp_us=i + 1) for i in range(len(request.messages))]
        )


def _serve(servicer: _Recorder, port: int = 0) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    clpb_grpc.add_ClusterServicer_to_server(servicer, server)
    pb_grpc.add_StorageServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    servicer.address = f"127.0.0.1:{port}"
    server.start()
    return server


@pytest.fixture
def recorder() -> Iterator[_Recorder]:
    servicer = _Recorder()
    server = _serve(servicer)
    yield servicer
    server.stop(0)


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_the_auth_token_travels_with_every_call(recorder: _Recorder) -> None:
    settings = ConnectionSettings(auth_token="tok-123", timeout_s=10)
    with Client(recorder.address, settings=settings) as client:
        client.cluster_map()
        client.list_generations()
        client.store_batch([Message(topic="t", payload=b"x", sender="s")])

    async def use_aio() -> None:
        async with aio.Client(recorder.address, settings=settings) as client:
            await client.cluster_map()
            await client.list_generations()
            await client.store_batch([Message(topic="t", payload=b"x", sender="s")])

    asyncio.run(asyncio.wait_for(use_aio(), 30))
    methods = [method for method, _ in recorder.calls]
    assert methods.count("GetClusterMap") >= 2 and "ListGenerations" in methods and "StoreBatch" in methods
    assert all(md.get("authorization") == "Bearer tok-123" for _, md in recorder.calls), recorder.calls

    recorder.calls.clear()
    with Client(recorder.address, timeout_s=10) as client:
        client.list_generations()
    assert recorder.calls and all("authorization" not in md for _, md in recorder.calls)


# -- a client started before its cluster ------------------------------------------


def _refused(address: str = "a:1") -> perrors.MqdsError:
    return perrors.error(E.Reason.UNAVAILABLE, f"no mqds node answered at {address} ({address}: connection refused)")


def test_waiting_for_a_map_backs_off_until_the_deadline_then_names_the_last_cause() -> None:
    wait = MapWait(time.monotonic() + 0.5, Backoff(initial_s=0.02, max_s=0.05))
    assert wait.timeout_s() > 0.4
    pauses = []
    with pytest.raises(E.UnavailableError) as exc:
        while True:
            pauses.append(wait.failed(_refused()))
            time.sleep(pauses[-1])
            wait.timeout_s()
    # Retried with the backoff's pauses for about the whole deadline, not once.
    assert len(pauses) >= 5 and all(0 <= p <= 0.05 for p in pauses), pauses
    assert time.monotonic() - wait.started >= 0.35
    message = exc.value.message
    assert message.startswith("no mqds node answered at a:1 (a:1: connection refused); still none after ")
    assert f"{wait.attempts} attempts" in message and exc.value.retriable


def test_waiting_for_a_map_tries_once_however_short_the_deadline_and_stops_on_a_refused_credential() -> None:
    wait = MapWait(time.monotonic() - 1, Backoff())
    assert wait.timeout_s() == pytest.approx(0.1)  # the first refresh is always tried
    with pytest.raises(E.UnavailableError, match="a:1: connection refused"):
        wait.failed(_refused())
    patient = MapWait(time.monotonic() + 60, Backoff())
    denied = perrors.error(E.Reason.UNAUTHENTICATED, "bad token")
    with pytest.raises(E.AuthenticationError) as exc:
        patient.failed(denied)
    assert exc.value is denied


def test_callers_waiting_behind_a_failed_refresh_share_its_failure() -> None:
    table = RoutingTable(["a:1", "b:2"])
    asked_at = time.monotonic()
    refresh = MapRefresh(table)
    for address in refresh.next_addresses():
        refresh.answer(address, None, "connection refused")
    with pytest.raises(E.UnavailableError) as exc:
        refresh.finish()
    assert "a:1, b:2" in exc.value.message
    assert table.shared_failure(asked_at) is exc.value  # asked while it ran: gets its answer
    assert table.shared_failure(time.monotonic() + 1) is None  # asked after: refreshes again
    assert "a:1: connection refused" in table.refresh_busy().message


def test_a_node_without_a_map_yet_counts_as_no_answer() -> None:
    table = RoutingTable(["a:1"])
    refresh = MapRefresh(table)
    refresh.next_addresses()
    refresh.answer("a:1", clpb.ClusterMap(version=0, n_shards=0))
    with pytest.raises(E.UnavailableError, match="a:1: it has no cluster map yet"):
        refresh.finish()
    assert table.view.version < 0


def _start_later(servicer: _Recorder, port: int, after_s: float) -> tuple[threading.Timer, list[grpc.Server]]:
    servers: list[grpc.Server] = []
    timer = threading.Timer(after_s, lambda: servers.append(_serve(servicer, port)))
    timer.start()
    return timer, servers


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_a_client_started_before_its_node_waits_for_it(kind: str) -> None:
    port = _unused_port()
    servicer = _Recorder()
    # The node is up two seconds after the client's first call, and answers
    # "not in a cluster yet" twice before it has a map.
    servicer.map_errors = [perrors.error(E.Reason.NO_LEADER, "node f1 has not joined a cluster yet")] * 2
    timer, servers = _start_later(servicer, port, 2.0)
    address = f"127.0.0.1:{port}"
    try:
        started = time.monotonic()
        if kind == "sync":
            with Client(address, timeout_s=20) as client:
                generations = client.list_generations()
        else:

            async def first_call() -> Any:
                async with aio.Client(address, timeout_s=20) as client:
                    return await client.list_generations()

            generations = asyncio.run(asyncio.wait_for(first_call(), 30))
        elapsed = time.monotonic() - started
    finally:
        timer.cancel()
        timer.join()
        for server in servers:
            server.stop(0)
    assert [g.generation for g in generations] == [1]
    assert 1.9 < elapsed < 10, elapsed
    assert [m for m, _ in servicer.calls].count("GetClusterMap") >= 3


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_concurrent_first_calls_share_each_map_refresh(kind: str) -> None:
    port = _unused_port()
    servicer = _Recorder()
    servicer.map_delay_s = 0.3  # callers queue behind the refresh that reaches the node
    timer, servers = _start_later(servicer, port, 1.0)
    address = f"127.0.0.1:{port}"
    try:
        if kind == "sync":
            with Client(address, timeout_s=20) as client, futures.ThreadPoolExecutor(8) as pool:
                results = list(pool.map(lambda _: client.list_generations(), range(8)))
        else:

            async def first_calls() -> list[Any]:
                async with aio.Client(address, timeout_s=20) as client:
                    return list(await asyncio.gather(*(client.list_generations() for _ in range(8))))

            results = asyncio.run(asyncio.wait_for(first_calls(), 30))
    finally:
        timer.cancel()
        timer.join()
        for server in servers:
            server.stop(0)
    assert len(results) == 8
    # The node answered the map once; the other callers shared that refresh.
    assert [m for m, _ in servicer.calls].count("GetClusterMap") == 1, servicer.calls


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_a_refused_credential_is_not_waited_out(kind: str) -> None:
    servicer = _Recorder()
    servicer.map_errors = [perrors.error(E.Reason.UNAUTHENTICATED, "unknown token")] * 10
    server = _serve(servicer)
    try:
        started = time.monotonic()
        with pytest.raises(E.AuthenticationError):
            if kind == "sync":
                with Client(servicer.address, timeout_s=20) as client:
                    client.list_generations()
            else:

                async def call() -> None:
                    async with aio.Client(servicer.address, timeout_s=20) as client:
                        await client.list_generations()

                asyncio.run(asyncio.wait_for(call(), 30))
        assert time.monotonic() - started < 5
    finally:
        server.stop(0)


def test_an_overloaded_node_keeps_its_leaderships_and_the_map_is_not_refreshed() -> None:
    """OVERLOADED forgot the shard's leader and refreshed the map: a busy node (over its per-client or
    public call limit) made every caller that backed off refresh the cluster map too."""
    table = RoutingTable(["a:1"])
    table.view.addresses.update({"n1": "a:1", "n2": "b:2"})
    table.view.leaders.update({0: (1, "n1"), 1: (1, "n2")})
    busy = perrors.error(perrors.Reason.OVERLOADED, "this client already has 48 calls in flight here")
    deadline = time.monotonic() + 10
    retry = ShardRetry(table, 0, deadline, Backoff())
    assert retry.failed(busy) is True  # back off...
    assert retry.refresh_map is False and table.leader_of(0) == "a:1"  # ...same leader, no refresh
    gone = perrors.error(perrors.Reason.NO_LEADER, "no leader now")
    assert retry.failed(gone) and retry.refresh_map and table.leader_of(0) is None
    table.view.leaders[0] = (1, "n1")

    fan = Fanout(table, [0, 1], deadline, Backoff())
    groups, _ = fan.next_round() or ({}, 0.0)
    for group in groups.values():
        fan.failed(group, busy)
    assert fan.end_round() is True and fan.refresh_map is False
    assert fan.pending == [0, 1] and table.leader_of(0) == "a:1" and table.leader_of(1) == "b:2"


def _sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


def test_a_pause_that_overran_ends_the_call_with_the_error_it_was_retrying() -> None:
    """A node over its disk quota answers STORAGE_FULL and the client backs off and asks again until the
    deadline. On a busy machine a pause overran, and the next attempt went out with a few milliseconds
    left: the call then failed with that attempt's DEADLINE_EXCEEDED, and the caller never learned that
    the node was full (a CI run hit this with 8 ms left of a 4 s call). Now no retry starts with less
    than MIN_RETRY_S, and the call ends with the error it was retrying, in one-shard and fan-out calls."""
    table = RoutingTable(["a:1"])
    table.view.addresses.update({"n1": "a:1", "n2": "b:2"})
    table.view.leaders.update({0: (1, "n1"), 1: (1, "n2")})
    full = perrors.error(perrors.Reason.STORAGE_FULL, "node n1's data directory holds 34 MiB, over its quota")

    deadline = time.monotonic() + 1.0
    retry = ShardRetry(table, 0, deadline, Backoff(initial_s=0.01))
    retry.next_attempt()
    assert retry.failed(full) is True
    retry.backoff_s(full)  # a short pause was asked for...
    _sleep_until(deadline - MIN_RETRY_S / 2)  # ...and the machine slept far longer
    with pytest.raises(E.UnavailableError) as raised:
        retry.next_attempt()
    assert raised.value.reason is perrors.Reason.STORAGE_FULL

    deadline = time.monotonic() + 1.0
    fan = Fanout(table, [0, 1], deadline, Backoff(initial_s=0.01))
    groups, _ = fan.next_round() or ({}, 0.0)
    for group in groups.values():
        fan.failed(group, full)
    assert fan.end_round() is True and fan.backoff_s() is not None
    _sleep_until(deadline - MIN_RETRY_S / 2)
    assert fan.next_round() is None
    assert {shard: err.reason for shard, err in fan.failures.items()} == {
        0: perrors.Reason.STORAGE_FULL,
        1: perrors.Reason.STORAGE_FULL,
    }

    # No pause asked for when less than MIN_RETRY_S would be left after it; with time to spare, the retry goes.
    retry = ShardRetry(table, 0, time.monotonic() + MIN_RETRY_S, Backoff(initial_s=0.01))
    retry.failed(full)
    with pytest.raises(E.UnavailableError):
        retry.backoff_s(full)
    retry = ShardRetry(table, 0, time.monotonic() + 5, Backoff(initial_s=0.01))
    retry.failed(full)
    time.sleep(retry.backoff_s(full))
    assert retry.next_attempt()[0] == "a:1"
    # A call that has not failed yet still gets its one attempt, however short its deadline.
    assert ShardRetry(table, 0, time.monotonic() + 0.01, Backoff()).next_attempt()[0] == "a:1"


def _placed(replicas: list[str]) -> RoutingTable:
    table = RoutingTable(["a:1"])
    table.view.n_shards = 1
    table.view.addresses.update({"a": "a:1", "b": "b:2", "c": "c:3"})
    table.view.replicas[0] = replicas
    table.view.leaders[0] = (1, "b")
    return table


def test_any_replica_reads_start_at_replicas_in_turn() -> None:
    table = _placed(["a", "b", "c"])
    firsts = [ShardRetry(table, 0, time.monotonic() + 5, Backoff()).next_attempt()[0] for _ in range(2)]
    assert firsts == ["b:2", "b:2"]  # leader reads: always the leader
    spread = [ShardRetry(table, 0, time.monotonic() + 5, Backoff(), any_replica=True) for _ in range(6)]
    assert sorted(r.next_attempt()[0] for r in spread) == ["a:1", "a:1", "b:2", "b:2", "c:3", "c:3"]


def test_an_any_replica_read_moves_on_from_a_node_that_no_longer_hosts_the_shard() -> None:
    # The client's map still lists "a" after the replica moved; "a" answers NOT_HOSTED naming the
    # leader. Before: the leader hint was learned and the read went back to "a" until its deadline.
    table = _placed(["a", "b", "c"])
    for _ in range(3):
        retry = ShardRetry(table, 0, time.monotonic() + 5, Backoff(), any_replica=True)
        first, _ = retry.next_attempt()
        moved = perrors.error(E.Reason.NOT_HOSTED, "not here", leader="b", leader_address="b:2")
        assert retry.failed(moved) is True  # refresh the map, back off, then another replica
        assert retry.next_attempt()[0] != first
