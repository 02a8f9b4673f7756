"""The Raft TCP connection's bytes: the handshake that proves cluster membership, and frame framing.

A connection carries one node's Raft frames to another, one way (answers
travel on the connection the other node opens), the same ``Frame`` messages
as the gRPC ``Raft.Stream``. It opens with a handshake:

1. the accepting node sends ``CHALLENGE_BYTES`` random bytes;
2. the connecting node sends a ``LinkHello`` (length-prefixed): its id, its
   gRPC address and ``proof``, an HMAC-SHA256 of the challenge, id and address
   keyed with the cluster secret, so the secret itself never travels and a
   recorded handshake cannot be replayed;
3. the accepting node checks the proof (in constant time) and answers
   ``ACCEPTED``, or closes the connection.

Every read and write of the handshake, on either end, counts against one
``Deadline`` for the whole exchange (a TLS handshake before it too): a peer
that sends a byte now and then cannot stretch it, as it could when each read
had a limit of its own.

Then each frame is a 4-byte big-endian length and the frame's bytes. A length
over ``max_frame_bytes`` ends the connection (the sender sends nothing that
large: Raft entries are bounded by ``max_entry_bytes``).
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time

from mqds.server.raft.v1 import raft_pb2 as rpb

CHALLENGE_BYTES = 32
FRAME_TARGET_BYTES = 4 * 1024 * 1024
"""A frame takes messages up to this size; a larger message goes in a frame of its own."""
ACCEPTED = b"\x01"
HELLO_MAX_BYTES = 4096
_LENGTH = struct.Struct(">I")


class LinkRefused(Exception):
    """The other end broke the protocol or refused the handshake; the message says how."""


class Deadline:
    """One time limit for a whole exchange: each socket operation may take only what is left of it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def arm(self, sock: socket.socket) -> None:
        """Give ``sock``'s next operation what is left; TimeoutError once nothing is."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the handshake did not finish within {self.seconds:g} s")
        sock.settimeout(left)


def send_all(sock: socket.socket, data: bytes, deadline: Deadline | None = None) -> None:
    """``data`` written whole, within what is left of ``deadline``.

    ``sendall``'s timeout is a limit on the whole call (Python 3.5 on), not per
    write, so arming it once suffices.
    """
    if deadline is not None:
        deadline.arm(sock)
    sock.sendall(data)


def frame_header(length: int) -> bytes:
    return _LENGTH.pack(length)


def frames(items: list[bytes]) -> list[bytes]:
    """Envelopes packed, in order, into frames of at most ``FRAME_TARGET_BYTES`` (one larger envelope alone)."""
    out: list[bytes] = []
    current: list[bytes] = []
    size = 0
    for item in items:
        if current and size + len(item) > FRAME_TARGET_BYTES:
            out.append(b"".join(current))
            current, size = [], 0
        current.append(item)
        size += len(item)
    if current:
        out.append(b"".join(current))
    return out


def proof(secret: bytes, challenge: bytes, node_id: str, address: str) -> bytes:
    """What a connecting node sends to prove it knows ``secret``; empty without one."""
    if not secret:
        return b""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (challenge, node_id.encode("utf-8"), address.encode("utf-8")):
        mac.update(_LENGTH.pack(len(part)))
        mac.update(part)
    return mac.digest()


def hello(secret: bytes, challenge: bytes, node_id: str, address: str) -> bytes:
    """The connecting node's ``LinkHello``, length-prefixed."""
    body = rpb.LinkHello(
        node_id=node_id, address=address, proof=proof(secret, challenge, node_id, address)
    ).SerializeToString()
    return _LENGTH.pack(len(body)) + body


def check_hello(body: bytes, secret: bytes, challenge: bytes) -> rpb.LinkHello:
    """The hello of a connecting node; raises LinkRefused unless it parses and its proof holds."""
    try:
        message = rpb.LinkHello.FromString(body)
    except Exception as err:  # DecodeError, or RuntimeError from upb
        raise LinkRefused(f"a hello that does not parse: {err}") from None
    if not message.node_id:
        raise LinkRefused("a hello without a node id")
    if secret and not hmac.compare_digest(message.proof, proof(secret, challenge, message.node_id, message.address)):
        raise LinkRefused(f"{message.node_id!r} did not prove it knows the cluster secret (cluster_secret)")
    return message


def read_exactly(sock: socket.socket, count: int, deadline: Deadline | None = None) -> bytes:
    """``count`` bytes from a blocking socket; raises EOFError if it closes first, TimeoutError past ``deadline``."""
    view = memoryview(bytearray(count))
    got = 0
    while got < count:
        if deadline is not None:
            deadline.arm(sock)
        n = sock.recv_into(view[got:], count - got)
        if not n:
            raise EOFError("the connection closed")
        got += n
    return bytes(view)


def read_sized(sock: socket.socket, max_bytes: int, deadline: Deadline | None = None) -> bytes:
    """One length-prefixed message from a blocking socket; raises LinkRefused past ``max_bytes``."""
    (length,) = _LENGTH.unpack(read_exactly(sock, _LENGTH.size, deadline))
    if length > max_bytes:
        raise LinkRefused(f"a message of {length} bytes, over the limit of {max_bytes}")
    return read_exactly(sock, length, deadline) if length else b""


class FrameReader:
    """Reads a connection's frames: each read returns every whole frame received by then, at least one.

    A node that falls behind finds several frames waiting (several passes of
    the leader's); handing them on together lets the receiving thread run the
    cycles they touch once, around one log sync, instead of once per frame.
    It never waits for more than the first frame. A length over
    ``max_frame_bytes`` raises ``LinkRefused`` before the frame is read.
    """

    def __init__(self, sock: socket.socket, max_frame_bytes: int, read_bytes: int = 256 * 1024) -> None:
        self._sock = sock
        self._max_frame_bytes = max_frame_bytes
        self._read_bytes = read_bytes
        self._buffer = bytearray()

    def read(self) -> list[bytes]:
        """The frames received by now (at least one, waiting for it); an empty list once the peer closed."""
        buffer = self._buffer
        while True:
            frames, used = self._whole_frames()
            if used:
                del buffer[:used]
            if frames:
                return frames
            chunk = self._sock.recv(self._read_bytes)
            if not chunk:
                return []  # closed by the peer (a frame cut short included)
            buffer += chunk

    def _whole_frames(self) -> tuple[list[bytes], int]:
        """The whole frames at the buffer's start, and the bytes they take."""
        buffer = self._buffer
        frames: list[bytes] = []
        position = 0
        header = _LENGTH.size
        with memoryview(buffer) as view:
            while len(buffer) - position >= header:
                (length,) = _LENGTH.unpack_from(buffer, position)
                if length > self._max_frame_bytes:
                    if frames:
                        break  # the frames before it are handed on first
                    raise LinkRefused(f"a frame of {length} bytes, over the limit of {self._max_frame_bytes}")
                end = position + header + length
                if end > len(buffer):
                    break
                frames.append(bytes(view[position + header : end]))
                position = end
        return frames, position
