"""Raft over TCP between real nodes: who may connect, what a hostile peer can do, and mixed transports.

Every other integration test runs its cluster over the TCP transport too (it
is the default); these check what only the transport itself does: the port is
handed out only to nodes with the cluster secret, a connection must prove the
secret before a byte of Raft is read, garbage and oversized frames cost the
sender its connection and nothing else, and a node sending over the gRPC stream
(``raft_transport = "grpc"``) still forms one cluster with the others.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mqds.client import Client, Message
from mqds.server.raft import tcp_wire
from mqds.server.raft.cluster_auth import NODE_HEADER, SECRET_HEADER
from mqds.server.raft.v1 import raft_pb2 as rpb
from mqds.server.raft.v1 import raft_pb2_grpc as rpb_grpc
from mqds.tools.localproc import LocalCluster

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path / "c", 3, n_shards=4) as c:
        c.start()
        yield c


def messages(sender: str, start: int, end: int) -> list[Message]:
    return [Message(f"dev/{sender}/seq", str(i).encode(), sender=sender, qos=1) for i in range(start, end)]


def check_every_acked_message(client: Client, acked: dict[str, list[int]]) -> None:
    """Every acknowledged message is stored once, in order."""
    for sender, seqs in acked.items():
        stored = [int(m.payload) for m in client.replay(f"dev/{sender}/#")]
        assert stored == seqs, f"{sender}: stored {len(stored)} of {len(seqs)} acknowledged, or out of order"


def _raft_port(cluster: LocalCluster, node_id: str) -> int:
    channel = grpc.insecure_channel(cluster.nodes[node_id].address)
    answer = rpb_grpc.RaftStub(channel).LinkAddress(
        rpb.LinkAddressRequest(), timeout=5, metadata=[(SECRET_HEADER, cluster.secret), (NODE_HEADER, "test")]
    )
    channel.close()
    assert answer.port > 0
    return int(answer.port)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    return sock


def _closed_by_peer(sock: socket.socket, within_s: float = 5.0) -> bool:
    sock.settimeout(within_s)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_only_a_node_with_the_secret_learns_the_raft_port(cluster: LocalCluster) -> None:
    channel = grpc.insecure_channel(cluster.nodes["n1"].address)
    raft = rpb_grpc.RaftStub(channel)
    for metadata in ([], [(SECRET_HEADER, "wrong"), (NODE_HEADER, "x")]):
        with pytest.raises(grpc.RpcError) as info:
            raft.LinkAddress(rpb.LinkAddressRequest(), timeout=5, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()
    assert _raft_port(cluster, "n1") != int(cluster.nodes["n1"].address.rpartition(":")[2])


def test_a_connection_without_the_secret_is_closed_and_the_node_serves_on(cluster: LocalCluster) -> None:
    port = _raft_port(cluster, "n1")
    before = cluster.status("n1").replicas
    # A wrong proof: closed right after the hello, before any frame is read.
    with _connect(port) as sock:
        challenge = tcp_wire.read_exactly(sock, tcp_wire.CHALLENGE_BYTES)
        sock.sendall(tcp_wire.hello(b"not-the-secret", challenge, "n2", cluster.nodes["n2"].address))
        forged = rpb.RaftMessage()
        forged.append_entries.term = 10**6
        frame = rpb.Frame(messages=[rpb.Envelope(group=0, message=forged)]).SerializeToString()
        with contextlib.suppress(OSError):  # already closed
            sock.sendall(tcp_wire.frame_header(len(frame)) + frame)
        assert _closed_by_peer(sock)
    # Garbage instead of a hello, and a hello claiming to be huge.
    for opening in (b"GET / HTTP/1.1\r\n\r\n", tcp_wire.frame_header(1 << 30)):
        with _connect(port) as sock:
            tcp_wire.read_exactly(sock, tcp_wire.CHALLENGE_BYTES)
            sock.sendall(opening)
            assert _closed_by_peer(sock)
    # Far more silent connections than handshakes it takes: the extra ones are closed at once.
    silent = [_connect(port) for _ in range(40)]
    try:
        closed = sum(_closed_by_peer(s, within_s=0.5) for s in silent)
        assert closed >= 40 - 32
    finally:
        for s in silent:
            s.close()
    with cluster.client(timeout_s=30) as client:
        client.store_batch(messages("after-hostile", 0, 20))
        check_every_acked_message(client, {"after-hostile": list(range(20))})
    assert all(r.term < 10**6 for r in cluster.status("n1").replicas)
    assert len(before) == len(cluster.status("n1").replicas)


def test_a_peer_with_the_secret_sending_garbage_loses_only_its_connection(cluster: LocalCluster) -> None:
    port = _raft_port(cluster, "n1")
    dropped_before = cluster.status("n1").dropped_raft_messages
    with _connect(port) as sock:
        challenge = tcp_wire.read_exactly(sock, tcp_wire.CHALLENGE_BYTES)
        # A node id of its own: one claiming to be n2 would replace n2's connection, and n2's next one its.
        sock.sendall(tcp_wire.hello(cluster.secret.encode(), challenge, "intruder", ""))
        assert tcp_wire.read_exactly(sock, 1) == tcp_wire.ACCEPTED
        unknown = rpb.RaftMessage()
        unknown.append_entries.entries.add(command=b"\x03\x80\x02K\x07.", index=1, term=1)
        for frame in (
            b"\xff\xfe garbage",
            rpb.Frame(messages=[rpb.Envelope(group=0, message=unknown)]).SerializeToString(),
            rpb.Frame(messages=[rpb.Envelope(group=12345, message=rpb.RaftMessage())]).SerializeToString(),
        ):
            sock.sendall(tcp_wire.frame_header(len(frame)) + frame)
        # A frame longer than any Raft entry: the connection ends before its body is read.
        sock.sendall(tcp_wire.frame_header(2**31))
        assert _closed_by_peer(sock)
    deadline = time.monotonic() + 10
    while cluster.status("n1").dropped_raft_messages < dropped_before + 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.status("n1").dropped_raft_messages >= dropped_before + 3
    with cluster.client(timeout_s=30) as client:
        client.store_batch(messages("after-garbage", 0, 20))
        check_every_acked_message(client, {"after-garbage": list(range(20))})


def test_a_node_on_the_grpc_stream_and_nodes_on_tcp_form_one_cluster(tmp_path: Path) -> None:
    with LocalCluster(tmp_path / "c", 3, n_shards=4) as cluster:
        cluster.nodes["n3"].args += ["--raft-transport", "grpc"]
        cluster.start()
        with cluster.client(timeout_s=30) as client:
            client.store_batch(messages("mixed", 0, 50))
            # Every replica, n3's included, has everything: traffic flowed both ways.
            cluster.assert_replicas_identical(timeout_s=60)
            cluster.kill("n1")
            client.store_batch(messages("mixed", 50, 100))
            check_every_acked_message(client, {"mixed": list(range(100))})
            cluster.start_node("n1")
            cluster.assert_replicas_identical(timeout_s=60)
