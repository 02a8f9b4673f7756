"""What a connection that never finishes its handshake costs a Raft TCP listener (``tcp_listener.py``), on loopback.

The attacker's sockets are bound to 127.0.0.2 (all of 127/8 reaches ``lo``
on Linux), so the listener tells them from the real peer at 127.0.0.1. The
handshake limit is shortened for these tests so that they stay quick; the
node's own is ``HANDSHAKE_TIMEOUT_S``.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tls_certs import TestCA

from mqds.server.raft import tcp_listener, tcp_wire
from mqds.server.raft.tcp_listener import TcpListener, source_key

SECRET = b"the-cluster-secret"
LIMIT_S = 1.0
"""The handshake limit in these tests."""
SLACK_S = 4.0
"""How much later than the limit a 2-core machine under load may close a connection."""
ATTACKER = "127.0.0.2"


@pytest.fixture(autouse=True)
def short_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp_listener, "HANDSHAKE_TIMEOUT_S", LIMIT_S)


@pytest.fixture(autouse=True)
def attacker_address() -> None:
    probe = socket.socket()
    try:
        probe.bind((ATTACKER, 0))
    except OSError:
        pytest.skip(f"{ATTACKER} is not a local address here (127/8 routes to lo on Linux only)")
    finally:
        probe.close()


class Received:
    def __init__(self) -> None:
        self.frames: list[tuple[str, bytes]] = []
        self.event = threading.Event()

    def __call__(self, sender: str, address: str, frames: list[bytes]) -> None:
        self.frames.extend((sender, frame) for frame in frames)
        self.event.set()


@contextlib.contextmanager
def listening(tls: ssl.SSLContext | None = None) -> Iterator[tuple[TcpListener, Received]]:
    received = Received()
    listener = TcpListener("127.0.0.1:0", SECRET, False, received, 1 << 20, tls)
    try:
        yield listener, received
    finally:
        listener.close()


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    return sock


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the other end closes ``sock`` within ``seconds`` (what it sends is read and ignored)."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(4096):
                return True
        except (ConnectionResetError, ssl.SSLError, ssl.SSLEOFError):
            return True
        except TimeoutError:
            return False
    return False


def trickle(sock: socket.socket, data: bytes, every_s: float, stop: threading.Event) -> None:
    """Send ``data`` a byte at a time, each well within any per-read limit, until stopped or closed."""
    for i in range(len(data)):
        if stop.wait(every_s):
            return
        try:
            sock.sendall(data[i : i + 1])
        except OSError:
            return


def real_handshake(port: int, node_id: str = "n2") -> socket.socket:
    sock = connect(port)
    challenge = tcp_wire.read_exactly(sock, tcp_wire.CHALLENGE_BYTES)
    sock.sendall(tcp_wire.hello(SECRET, challenge, node_id, "127.0.0.1:7102"))
    assert tcp_wire.read_exactly(sock, 1) == tcp_wire.ACCEPTED
    return sock


def test_a_hello_sent_a_byte_at_a_time_is_cut_at_the_whole_handshake_deadline() -> None:
    stop = threading.Event()
    with listening() as (listener, _):
        sock = connect(listener.port, ATTACKER)
        started = time.monotonic()
        tcp_wire.read_exactly(sock, tcp_wire.CHALLENGE_BYTES)
        # A hello of 100 bytes, a byte every 0.3 s: every read is quick, the whole takes 30 s.
        body = tcp_wire.frame_header(100) + b"x" * 100
        sender = threading.Thread(target=trickle, args=(sock, body, 0.3, stop), daemon=True)
        sender.start()
        try:
            assert closed_within(sock, LIMIT_S + SLACK_S), "a trickled handshake outlived the handshake limit"
            assert time.monotonic() - started >= LIMIT_S * 0.8
        finally:
            stop.set()
            sender.join(5)
            sock.close()
        assert listener.refused >= 1


def test_a_tls_handshake_counts_against_the_same_deadline(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    node = ca.issue("node")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(node.cert_file, node.key_file)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(ca.file)
    stop = threading.Event()
    with listening(server) as (listener, _):
        # A TLS handshake record trickled in: never completes.
        raw = connect(listener.port, ATTACKER)
        started = time.monotonic()
        sender = threading.Thread(target=trickle, args=(raw, b"\x16\x03\x01\x02\x00" + b"\x01" * 512, 0.3, stop))
        sender.start()
        try:
            assert closed_within(raw, LIMIT_S + SLACK_S), "a trickled TLS handshake outlived the limit"
        finally:
            stop.set()
            sender.join(5)
            raw.close()
        # A TLS handshake done in time, then the hello trickled: the time TLS took counts too.
        stop.clear()
        raw = connect(listener.port, ATTACKER)
        started = time.monotonic()
        tls = client.wrap_socket(raw, server_hostname="localhost")
        tcp_wire.read_exactly(tls, tcp_wire.CHALLENGE_BYTES)
        body = tcp_wire.frame_header(100) + b"x" * 100
        sender = threading.Thread(target=trickle, args=(tls, body, 0.3, stop), daemon=True)
        sender.start()
        try:
            assert closed_within(tls, LIMIT_S + SLACK_S), "a trickled hello after TLS outlived the limit"
            assert time.monotonic() - started < LIMIT_S + SLACK_S
        finally:
            stop.set()
            sender.join(5)
            tls.close()
        # A real peer still gets in, over TLS.
        tls = client.wrap_socket(connect(listener.port), server_hostname="localhost")
        with tls:
            challenge = tcp_wire.read_exactly(tls, tcp_wire.CHALLENGE_BYTES)
            tls.sendall(tcp_wire.hello(SECRET, challenge, "n2", "127.0.0.1:7102"))
            assert tcp_wire.read_exactly(tls, 1) == tcp_wire.ACCEPTED


def test_silent_connections_from_one_address_leave_room_for_peers_at_others(monkeypatch: pytest.MonkeyPatch) -> None:
    # A limit far longer than the test: no connection here ends by its deadline.
    monkeypatch.setattr(tcp_listener, "HANDSHAKE_TIMEOUT_S", 30.0)
    with listening() as (listener, received):
        held = [connect(listener.port, ATTACKER) for _ in range(tcp_listener.MAX_HANDSHAKES + 8)]
        try:
            # Those over the per-address bound are closed at once; the rest wait for their deadline.
            time.sleep(1.0)
            still_open = sum(not closed_within(s, 0.05) for s in held)
            assert still_open == tcp_listener.MAX_HANDSHAKES_PER_ADDRESS
            # Meanwhile a peer at another address completes its handshake and is heard.
            peer = real_handshake(listener.port)
            with peer:
                frame = b"a raft frame"
                peer.sendall(tcp_wire.frame_header(len(frame)) + frame)
                assert received.event.wait(5)
                assert received.frames == [("n2", frame)]
        finally:
            for s in held:
                s.close()


def test_the_per_address_slots_come_back_when_handshakes_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp_listener, "HANDSHAKE_TIMEOUT_S", 2.0)
    with listening() as (listener, _):
        first = [connect(listener.port, ATTACKER) for _ in range(tcp_listener.MAX_HANDSHAKES_PER_ADDRESS)]
        for s in first:
            tcp_wire.read_exactly(s, tcp_wire.CHALLENGE_BYTES)  # each was taken in
        over = connect(listener.port, ATTACKER)
        assert closed_within(over, 1.0), "a connection over the per-address bound was taken in"
        over.close()
        for s in first:
            assert closed_within(s, 2.0 + SLACK_S)
            s.close()
        # Their deadlines freed the slots: the same address is taken in again.
        again = connect(listener.port, ATTACKER)
        with again:
            assert len(tcp_wire.read_exactly(again, tcp_wire.CHALLENGE_BYTES, tcp_wire.Deadline(5))) == 32


def test_addresses_are_counted_by_host_and_ipv6_by_its_64() -> None:
    assert source_key(("10.0.0.7", 5555)) == "10.0.0.7"
    assert source_key(("::ffff:10.0.0.7", 5555, 0, 0)) == "10.0.0.7"
    assert source_key(("2001:db8:1:2::5", 5555, 0, 0)) == source_key(("2001:db8:1:2:ffff::9", 1, 0, 0))
    assert source_key(("2001:db8:1:2::5", 5555, 0, 0)) != source_key(("2001:db8:1:3::5", 5555, 0, 0))
    assert source_key(("fe80::1%lo", 5555, 0, 1)) == "fe80::/64"
