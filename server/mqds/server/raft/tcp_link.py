"""The sending end of Raft over TCP: one connection to each peer, written by the thread that sends.

A group's cycle (on a scheduler's worker, or a receiving thread running it: see
``cycles.py``) hands its messages to ``enqueue``, which writes the frame to the
peer's socket right there: no queue, no sender thread and no gRPC threads
between a cycle and the wire. The socket does not block; what the kernel does
not take at once waits in ``_pending``, and the link's own thread writes it as
the socket drains. That thread also connects (asking the peer over gRPC for
its Raft port, ``Raft.LinkAddress``, then the handshake of ``tcp_wire``),
sends lazy messages (heartbeats nobody waits for) once they waited
``linger_s``, and notices a closed or broken connection, after which it
reconnects with backoff. While the link is down messages are dropped (Raft
resends them), as they are when a peer stops reading and more than
``MAX_PENDING_BYTES`` wait: then the connection is dropped too, so what
reaches the peer is always whole frames.

A peer that takes no Raft traffic over TCP (``raft_transport`` "grpc", or a
node of an older version, which answers UNIMPLEMENTED) is sent to over the
gRPC stream instead (``grpc_link.GrpcPeerLink``), and asked again whenever
that link goes down. Either link sees the router that owns it through a
protocol of what it uses (``TcpRouter`` here, ``grpc_link.LinkRouter``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import select
import socket
import ssl
import threading
import time
from typing import Protocol

import grpc

from mqds.server.raft import tcp_wire
from mqds.server.raft.grpc_link import GrpcPeerLink, LinkRouter
from mqds.server.raft.tcp_listener import HANDSHAKE_TIMEOUT_S, keepalive
from mqds.server.raft.v1 import raft_pb2 as rpb

log = logging.getLogger(__name__)

MAX_PENDING_BYTES = 256 * 1024 * 1024
_JOIN_BELOW_BYTES = 64 * 1024
"""A frame smaller than this leaves with its header in one write; a larger one in two, uncopied."""
LINK_ADDRESS_METHOD = "/mqds.server.raft.v1.Raft/LinkAddress"
_CONNECT_TIMEOUT_S = 2.0
_RECONNECT_MIN_S = 0.05
_RECONNECT_MAX_S = 1.0
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError)


class TcpRouter(LinkRouter, Protocol):
    """What a TCP link uses of its router (:class:`mqds.server.raft.transport.PeerRouter`): a gRPC link's needs,
    and the TLS context of its connections."""

    @property
    def tls_client(self) -> ssl.SSLContext | None: ...


class TcpPeerLink:
    """The connection to one peer: ``enqueue`` writes at once; a thread connects, drains and lingers."""

    def __init__(self, router: TcpRouter, node_id: str, address: str) -> None:
        self.router = router
        self.node_id = node_id
        self.address = address
        self.sent_frames = 0
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._broken = False
        self._pending: collections.deque[memoryview] = collections.deque()
        self._pending_bytes = 0
        self._lazy: list[bytes] = []
        self._lazy_since = 0.0
        self._closed = False
        self._fallback: GrpcPeerLink | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name=f"raft-link-{node_id}", daemon=True)
        self._thread.start()

    # -- what the router uses ------------------------------------------------------

    @property
    def connected(self) -> bool:
        fallback = self._fallback
        if fallback is not None:
            return fallback.connected
        return self._sock is not None and not self._broken

    def enqueue(self, items: list[bytes], lazy: bool = False) -> None:
        """Send envelopes to this peer: now (with the lazy ones waiting), or, if ``lazy``, within ``linger_s``."""
        fallback = self._fallback
        if fallback is not None:
            fallback.enqueue(items, lazy)
            return
        with self._lock:
            if self._sock is None or self._broken:
                return
            if lazy and self.router.linger_s > 0:
                if not self._lazy:
                    self._lazy_since = time.monotonic()
                    self._wake()  # the link's thread sets its timer by the first lazy message
                self._lazy.extend(items)
                return
            if self._lazy:
                items = self._lazy + items
                self._lazy = []
            for frame in tcp_wire.frames(items):
                self._write(frame)

    def close(self) -> None:
        self._closed = True
        self._wake()
        fallback = self._fallback
        if fallback is not None:
            fallback.close()

    # -- writing (holding _lock) ------------------------------------------------------

    def _write(self, body: bytes) -> None:
        header = tcp_wire.frame_header(len(body))
        self.sent_frames += 1
        # A large frame's header goes as a write of its own: joining it to
        # the body would copy the body (tens of MiB for a large batch).
        parts = (header + body,) if len(body) < _JOIN_BELOW_BYTES else (header, body)
        for part in parts:
            data = memoryview(part)
            if not self._pending:
                data = data[self._send(data) :]
                if not data:
                    continue
                self._wake()  # the thread writes the rest when the socket drains
            self._pending.append(data)
            self._pending_bytes += len(data)
        if self._pending_bytes > MAX_PENDING_BYTES:
            log.warning(
                "raft link to %s: more than %d bytes unsent; dropping the connection", self.node_id, MAX_PENDING_BYTES
            )
            self.router.dropped_overflow += len(self._pending)
            self._fail()

    def _send(self, data: memoryview) -> int:
        """Write what the socket takes now; the byte count (0 if none, or if the connection broke)."""
        if self._sock is None or self._broken:
            return len(data)
        try:
            return self._sock.send(data)
        except _WOULD_BLOCK:
            return 0
        except OSError as err:
            log.debug("raft link to %s: write failed: %s", self.node_id, err)
            self._fail()
            return len(data)

    def _flush(self) -> None:
        while self._pending and not self._broken:
            head = self._pending[0]
            sent = self._send(head)
            if self._broken:
                return
            self._pending_bytes -= sent
            if sent < len(head):
                self._pending[0] = head[sent:]
                return
            self._pending.popleft()

    def _fail(self) -> None:
        self._broken = True
        self._pending.clear()
        self._pending_bytes = 0
        self._lazy = []
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    # -- the link's thread --------------------------------------------------------------

    def _run(self) -> None:
        backoff = _RECONNECT_MIN_S
        channel: grpc.Channel | None = None
        channel_address = ""
        while not self._closed:
            address = self.address
            if channel is None or channel_address != address:
                if channel is not None:
                    channel.close()
                channel, channel_address = self.router.open_channel(address), address
            try:
                port = self._link_port(channel)
            except grpc.RpcError as err:
                log.debug("raft link to %s: no Raft port yet: %s", self.node_id, err.code())
                time.sleep(backoff)
                backoff = min(backoff * 2, _RECONNECT_MAX_S)
                continue
            if port == 0:
                self._over_grpc(address)
                continue
            sock = self._connect(address, port)
            if sock is None:
                time.sleep(backoff)
                backoff = min(backoff * 2, _RECONNECT_MAX_S)
                continue
            backoff = _RECONNECT_MIN_S
            self._serve(sock, address)
        if channel is not None:
            channel.close()

    def _link_port(self, channel: grpc.Channel) -> int:
        """The peer's Raft TCP port (0: it takes Raft traffic on the gRPC stream only)."""
        ask = channel.unary_unary(
            LINK_ADDRESS_METHOD,
            request_serializer=rpb.LinkAddressRequest.SerializeToString,
            response_deserializer=rpb.LinkAddressResponse.FromString,
        )
        try:
            answer = ask(rpb.LinkAddressRequest(), timeout=_CONNECT_TIMEOUT_S, metadata=self.router.auth.metadata())
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                return 0  # a node of a version before Raft over TCP
            raise
        return int(answer.port)

    def _over_grpc(self, address: str) -> None:
        """Send over the gRPC stream while that link stays up (or for a while, until it comes up)."""
        fallback = GrpcPeerLink(self.router, self.node_id, address)
        self._fallback = fallback
        log.info("raft link to %s: the peer takes no Raft over TCP; using the gRPC stream", self.node_id)
        came_up = False
        deadline = time.monotonic() + 10.0
        while not self._closed and self.address == address:
            if fallback.connected:
                came_up = True
            elif came_up or time.monotonic() > deadline:
                break  # down again (the peer restarted, maybe upgraded): ask again
            time.sleep(0.5)
        self._fallback = None
        fallback.close()
        if fallback.connected:
            self.router.link_changed(self.node_id, False)

    def _connect(self, address: str, port: int) -> socket.socket | None:
        host = address.rpartition(":")[0].strip("[]")
        sock: socket.socket | None = None
        try:
            sock = socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S)
            keepalive(sock)
            # As on the accepting end, the whole handshake has one deadline: a
            # peer trickling its bytes cannot hold this link's thread longer.
            deadline = tcp_wire.Deadline(HANDSHAKE_TIMEOUT_S)
            tls = self.router.tls_client
            if tls is not None:
                deadline.arm(sock)
                sock = tls.wrap_socket(sock, server_hostname=host)
            challenge = tcp_wire.read_exactly(sock, tcp_wire.CHALLENGE_BYTES, deadline)
            auth = self.router.auth
            tcp_wire.send_all(sock, tcp_wire.hello(auth.secret, challenge, auth.node_id, auth.address), deadline)
            if tcp_wire.read_exactly(sock, 1, deadline) != tcp_wire.ACCEPTED:
                raise tcp_wire.LinkRefused("the peer did not accept the handshake")
        except (OSError, EOFError, ssl.SSLError, tcp_wire.LinkRefused) as err:
            log.debug("raft link to %s (%s:%d): cannot connect: %s", self.node_id, host, port, err)
            if sock is not None:
                sock.close()
            return None
        sock.setblocking(False)
        return sock

    def _serve(self, sock: socket.socket, address: str) -> None:
        with self._lock:
            self._sock, self._broken = sock, False
        log.info("raft link to %s (%s) up (tcp)", self.node_id, address)
        self.router.link_changed(self.node_id, True)
        try:
            while not self._closed and not self._broken and self.address == address:
                with self._lock:
                    writing = bool(self._pending)
                    due = self._lazy_since + self.router.linger_s if self._lazy else None
                timeout = 0.5 if due is None else max(0.0, due - time.monotonic())
                readable, writable, _ = select.select([sock, self._wake_r], [sock] if writing else [], [], timeout)
                if self._wake_r in readable:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                with self._lock:
                    if sock in readable:
                        self._notice_close(sock)
                    if writable:
                        self._flush()
                    if self._lazy and time.monotonic() >= self._lazy_since + self.router.linger_s:
                        lazy, self._lazy = self._lazy, []
                        for frame in tcp_wire.frames(lazy):
                            self._write(frame)
        finally:
            with self._lock:
                self._sock = None
                self._broken = False
                self._pending.clear()
                self._pending_bytes = 0
                self._lazy = []
            with contextlib.suppress(OSError):
                sock.close()
            log.info("raft link to %s (%s) down", self.node_id, address)
            self.router.link_changed(self.node_id, False)

    def _notice_close(self, sock: socket.socket) -> None:
        """The peer sends nothing after the handshake: readable means closed (or TLS housekeeping)."""
        try:
            data = sock.recv(4096)
        except _WOULD_BLOCK:
            return
        except OSError:
            self._fail()
            return
        if not data:
            self._fail()
