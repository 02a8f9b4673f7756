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
import select
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import grpc
import pytest

from mqds.client import Client, Message
from mqds.server.raft import tcp_wire
from mqds.server.raft.cluster_auth import NODE_HEADER, SECRET_HEADER
from mqds.server.raft.tcp_listener import HANDSHAKE_TIMEOUT_S, MAX_HANDSHAKES
from mqds.server.raft.v1 import raft_pb2 as rpb
from mqds.server.raft.v1 import raft_pb2_grpc as rpb_grpc
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.processes import NodeProcess
from mqds.tools.waiting import wait_until

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


class SlowHandshakes:
    """An attacker at ``source``: ``count`` connections to a Raft port, each sending a byte every ``every_s``.

    Every connection starts a hello (a length prefix, then bytes) and never
    finishes it; each one the node closes is opened again. What it records:
    how long each connection the node took in (sent it the challenge) lasted.
    """

    def __init__(self, port: int, source: str, count: int, every_s: float) -> None:
        self.port, self.source, self.count, self.every_s = port, source, count, every_s
        self.lifetimes: list[float] = []
        """Seconds each taken-in connection lasted, closed ones and (at the end) open ones alike."""
        self._open: dict[socket.socket, tuple[float, bool, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slow-handshakes", daemon=True)

    def __enter__(self) -> SlowHandshakes:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(10)
        now = time.monotonic()
        for sock, (opened, taken_in, _) in self._open.items():
            if taken_in:
                self.lifetimes.append(now - opened)
            sock.close()

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((self.source, 0))
            sock.settimeout(2)
            sock.connect(("127.0.0.1", self.port))
        except OSError:
            sock.close()
            return
        sock.setblocking(False)
        self._open[sock] = (time.monotonic(), False, 0)

    def _run(self) -> None:
        # A hello that claims 4,000 bytes: the length prefix, then "x"s, a byte at a time.
        body = tcp_wire.frame_header(4000) + b"x" * 4000
        next_byte = time.monotonic()
        while not self._stop.is_set():
            while len(self._open) < self.count and not self._stop.is_set():
                self._connect()
            readable, _, _ = select.select(list(self._open), [], [], 0.2)
            now = time.monotonic()
            for sock in readable:
                opened, taken_in, sent = self._open[sock]
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    self._open[sock] = (opened, True, sent)  # the challenge: taken in
                    continue
                if taken_in:
                    self.lifetimes.append(now - opened)
                del self._open[sock]
                sock.close()
            if now >= next_byte:
                next_byte = now + self.every_s
                for sock, (opened, taken_in, sent) in list(self._open.items()):
                    with contextlib.suppress(OSError):
                        sock.send(body[sent : sent + 1])
                        self._open[sock] = (opened, taken_in, sent + 1)


def _peer_up(proc: NodeProcess, peer: str) -> bool:
    assert proc.metrics_url is not None
    try:
        with urllib.request.urlopen(proc.metrics_url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return False
    return f'mqds_raft_peer_up{{peer="{peer}"}} 1.0' in text.splitlines()


def test_slow_handshakes_from_one_address_are_cut_and_lock_no_peer_out(tmp_path: Path) -> None:
    """More slow-handshake connections than the node takes, from 127.0.0.2, while n2 restarts.

    Each byte arrives well within any per-read limit; the node must still
    close each connection at its whole-handshake deadline, and take the
    restarted n2's connection (from 127.0.0.1) meanwhile.
    """
    probe = socket.socket()
    try:
        probe.bind(("127.0.0.2", 0))
    except OSError:
        pytest.skip("127.0.0.2 is not a local address here (127/8 routes to lo on Linux only)")
    finally:
        probe.close()
    with LocalCluster(tmp_path / "c", 3, n_shards=4, metrics=True) as cluster:
        cluster.start()
        port = _raft_port(cluster, "n1")
        cluster.kill("n2")
        with SlowHandshakes(port, "127.0.0.2", MAX_HANDSHAKES + 8, every_s=2.0) as attack:
            time.sleep(2 * 2.0)  # the attack holds what the node lets it
            cluster.start_node("n2")
            restarted = time.monotonic()
            wait_until("n2's Raft link to n1 up", lambda: _peer_up(cluster.nodes["n2"], "n1"), 30, interval_s=0.5)
            linked_after_s = time.monotonic() - restarted
            time.sleep(HANDSHAKE_TIMEOUT_S)  # long enough for the attack to be cut at least once
        assert attack.lifetimes, "the node took none of the slow connections in"
        assert max(attack.lifetimes) < HANDSHAKE_TIMEOUT_S + 5, (
            f"a slow handshake lasted {max(attack.lifetimes):.1f} s, over the {HANDSHAKE_TIMEOUT_S:g} s limit"
        )
        assert linked_after_s < 30
        with cluster.client(timeout_s=30) as client:
            client.store_batch(messages("after-slow", 0, 20))
            check_every_acked_message(client, {"after-slow": list(range(20))})
        cluster.assert_replicas_identical(timeout_s=60)
