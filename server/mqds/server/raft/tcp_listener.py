"""The receiving end of Raft over TCP: accept peers' connections, check their handshake, hand frames on.

One thread accepts; each accepted connection gets a thread of its own that
runs the handshake (``tcp_wire``; at most ``HANDSHAKE_TIMEOUT_S``) and then
reads frames and hands each to ``receive(sender, frame)``, the router's, which
decodes it and runs the cycles of the groups it touched on this same thread
(``cycles.run_cycles``). So a frame costs one wake-up (this thread's, out of
``recv``), where a gRPC stream cost the server's poller thread and a handler
thread. A connection that fails the handshake, sends a frame over
``max_frame_bytes`` or goes silent past TCP keepalive is closed; the peer
reconnects.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable

from mqds.server.raft import tcp_wire
from mqds.server.raft.tcp_wire import LinkRefused

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
MAX_HANDSHAKES = 32
"""Connections that have not finished their handshake; more are closed at once (a flood costs no threads)."""
_READ_BUFFER_BYTES = 256 * 1024


def keepalive(sock: socket.socket) -> None:
    """Notice a peer that vanished without closing (a partition, a paused process) within about 4 s."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 2)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpListener:
    """Accepts Raft connections on ``host:port`` (port 0: any free one; ``port`` says which)."""

    def __init__(
        self,
        listen: str,
        secret: bytes,
        dev_mode: bool,
        receive: Callable[[str, str, bytes], None],
        max_frame_bytes: int,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        host, _, port = listen.rpartition(":")
        self._secret = secret
        self._dev_mode = dev_mode
        self._receive = receive
        self._max_frame_bytes = max_frame_bytes
        self._tls = tls
        self._closed = False
        self._connections: set[socket.socket] = set()
        self._by_sender: dict[str, socket.socket] = {}
        self._handshaking = 0
        self._lock = threading.Lock()
        self.refused = 0
        """Connections closed for a failed handshake or a broken frame (metrics)."""
        self._sock = socket.create_server((host.strip("[]"), int(port)), family=_family(host), backlog=64)
        self.port: int = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="raft-accept", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and close every connection (their threads end)."""
        self._closed = True
        with self._lock:
            connections = list(self._connections)
        for sock in [self._sock, *connections]:
            _shut(sock)
            sock.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            with self._lock:
                busy = self._handshaking >= MAX_HANDSHAKES
                if not busy:
                    self._handshaking += 1
            if busy:
                self.refused += 1
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, peer), name="raft-recv", daemon=True).start()

    def _serve(self, raw: socket.socket, peer: object) -> None:
        sock = raw
        sender = ""
        handshaking = True
        with self._lock:
            if self._closed:
                self._handshaking -= 1
                raw.close()
                return
            self._connections.add(raw)
        try:
            keepalive(raw)
            raw.settimeout(HANDSHAKE_TIMEOUT_S)
            if self._tls is not None:
                sock = self._tls.wrap_socket(raw, server_side=True)
            sender, address = self._handshake(sock)
            threading.current_thread().name = f"raft-recv-{sender}"
            with self._lock:
                self._handshaking -= 1
                handshaking = False
                # A peer that reconnected: its old connection is dead to it.
                old = self._by_sender.get(sender)
                self._by_sender[sender] = raw
            if old is not None:
                _shut(old)
            sock.settimeout(None)
            reader = sock.makefile("rb", buffering=_READ_BUFFER_BYTES)
            header = tcp_wire.frame_header(0).__len__()
            while not self._closed:
                head = reader.read(header)
                if len(head) < header:
                    return  # closed by the peer
                length = int.from_bytes(head, "big")
                if length > self._max_frame_bytes:
                    raise LinkRefused(f"a frame of {length} bytes, over the limit of {self._max_frame_bytes}")
                frame = reader.read(length)
                if len(frame) < length:
                    return
                self._receive(sender, address, frame)
        except LinkRefused as err:
            self.refused += 1
            log.warning("closed a Raft connection from %s: %s", peer, err)
        except (OSError, EOFError, ssl.SSLError, ValueError) as err:
            if not self._closed:
                log.debug("Raft connection from %s ended: %s", peer, err)
        finally:
            with self._lock:
                self._connections.discard(raw)
                if handshaking:
                    self._handshaking -= 1
                if sender and self._by_sender.get(sender) is raw:
                    del self._by_sender[sender]
            with contextlib.suppress(OSError):
                sock.close()

    def _handshake(self, sock: socket.socket) -> tuple[str, str]:
        if not self._secret and not self._dev_mode:
            raise LinkRefused("this node has no cluster_secret and is not in dev_mode: it accepts no peers")
        challenge = os.urandom(tcp_wire.CHALLENGE_BYTES)
        sock.sendall(challenge)
        hello = tcp_wire.check_hello(tcp_wire.read_sized(sock, tcp_wire.HELLO_MAX_BYTES), self._secret, challenge)
        sock.sendall(tcp_wire.ACCEPTED)
        return hello.node_id, hello.address


def _shut(sock: socket.socket) -> None:
    """Wake whoever blocks on ``sock`` (its reader thread closes it)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
