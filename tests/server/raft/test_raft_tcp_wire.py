"""The Raft TCP handshake and framing (``mqds.server.raft.tcp_wire``), against a real socket pair."""

from __future__ import annotations

import socket

import pytest

from mqds.server.raft import tcp_wire
from mqds.server.raft.tcp_wire import LinkRefused

SECRET = b"the-cluster-secret"


def test_a_node_that_knows_the_secret_passes_and_says_who_it_is() -> None:
    challenge = b"c" * tcp_wire.CHALLENGE_BYTES
    framed = tcp_wire.hello(SECRET, challenge, "n2", "10.0.0.2:7101")
    hello = tcp_wire.check_hello(framed[4:], SECRET, challenge)
    assert (hello.node_id, hello.address) == ("n2", "10.0.0.2:7101")
    assert SECRET not in framed  # the secret itself never travels


@pytest.mark.parametrize(
    ("secret", "challenge", "node_id", "address"),
    [
        (b"another-secret", b"c" * 32, "n2", "10.0.0.2:7101"),  # a different secret
        (SECRET, b"d" * 32, "n2", "10.0.0.2:7101"),  # a recorded hello replayed to a new challenge
        (SECRET, b"c" * 32, "n3", "10.0.0.2:7101"),  # the proof of another node
        (SECRET, b"c" * 32, "n2", "10.0.0.9:7101"),  # another address
        (b"", b"c" * 32, "n2", "10.0.0.2:7101"),  # no proof at all
    ],
)
def test_a_hello_without_a_valid_proof_is_refused(secret: bytes, challenge: bytes, node_id: str, address: str) -> None:
    forged = tcp_wire.hello(secret, challenge, node_id, address)[4:]
    # What the accepting node checks: its own challenge, the id and address the hello names.
    from mqds.server.raft.v1 import raft_pb2 as rpb

    named = rpb.LinkHello.FromString(forged)
    named.node_id, named.address = "n2", "10.0.0.2:7101"
    with pytest.raises(LinkRefused, match="cluster secret"):
        tcp_wire.check_hello(named.SerializeToString(), SECRET, b"c" * 32)


def test_garbage_and_anonymous_hellos_are_refused() -> None:
    with pytest.raises(LinkRefused, match="does not parse"):
        tcp_wire.check_hello(b"\xff\xff\xff", SECRET, b"c" * 32)
    with pytest.raises(LinkRefused, match="without a node id"):
        tcp_wire.check_hello(b"", SECRET, b"c" * 32)


def test_frames_keep_order_and_split_only_between_messages() -> None:
    small = [bytes([i]) * 1000 for i in range(10)]
    assert tcp_wire.frames(small) == [b"".join(small)]
    big = b"B" * (tcp_wire.FRAME_TARGET_BYTES + 10)
    d = b"d" * (tcp_wire.FRAME_TARGET_BYTES - 300)
    items = [b"a" * 100, big, b"c" * 100, d, b"e" * 100, b"f" * 200]
    out = tcp_wire.frames(items)
    assert b"".join(out) == b"".join(items)
    assert out == [b"a" * 100, big, b"c" * 100 + d + b"e" * 100, b"f" * 200]


def test_sized_reads_stop_at_the_limit_and_at_a_closed_connection() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(tcp_wire.frame_header(5) + b"hello" + tcp_wire.frame_header(10_000))
        assert tcp_wire.read_sized(b, 100) == b"hello"
        with pytest.raises(LinkRefused, match="over the limit"):
            tcp_wire.read_sized(b, 100)
        a.sendall(b"ab")
        a.close()
        with pytest.raises(EOFError):
            tcp_wire.read_exactly(b, 3)


def framed(*bodies: bytes) -> bytes:
    return b"".join(tcp_wire.frame_header(len(body)) + body for body in bodies)


def test_frames_that_arrived_together_are_read_together() -> None:
    """What a node that fell behind finds waiting is handed on at once: its groups then share one log sync."""
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        reader = tcp_wire.FrameReader(b, max_frame_bytes=1 << 20)
        a.sendall(framed(b"first", b"", b"third" * 30))
        assert reader.read() == [b"first", b"", b"third" * 30]


def test_a_frame_in_pieces_is_handed_on_whole_and_a_frame_cut_short_not_at_all() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        reader = tcp_wire.FrameReader(b, max_frame_bytes=1 << 20, read_bytes=64)
        big = bytes(range(256)) * 40  # longer than a read: comes in pieces
        whole = framed(big, b"next")
        a.sendall(whole[:3])  # not even the whole length
        a.sendall(whole[3:700])
        a.sendall(whole[700:])
        got: list[bytes] = []
        while len(got) < 2:
            got += reader.read()
        assert got == [big, b"next"]
        a.sendall(framed(b"cut")[:-1])
        a.close()
        assert reader.read() == []  # the peer closed


def test_a_frame_over_the_limit_ends_the_connection_before_its_bytes_are_read() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        reader = tcp_wire.FrameReader(b, max_frame_bytes=100)
        a.sendall(framed(b"fine") + tcp_wire.frame_header(101))
        assert reader.read() == [b"fine"]  # what came whole before it is handed on
        with pytest.raises(LinkRefused, match="101 bytes, over the limit of 100"):
            reader.read()
