"""The receiving end of Raft over TCP: accept peers' connections, check their handshake, hand frames on.

One thread accepts; each accepted connection gets a thread of its own that
runs the handshake (``tcp_wire``, TLS first where it is on: all of it within
``HANDSHAKE_TIMEOUT_S`` of the accept) and then
reads frames and hands them to ``receive(sender, address, frames)``, the
router's, which decodes them and runs the cycles of the groups they touched on
this same thread (``cycles.run_cycles``). So a frame costs one wake-up (this
thread's, out of ``recv``), where a gRPC stream cost the server's poller thread
and a handler thread; and the frames that arrived while the thread was busy
are handed on together (``tcp_wire.FrameReader``), so their groups' cycles
share one log sync. A connection that fails the handshake, sends a frame over
``max_frame_bytes`` or goes silent past TCP keepalive is closed; the peer
reconnects.

Connections still in their handshake hold a thread each, so they are
bounded: ``MAX_HANDSHAKES`` on the node and ``MAX_HANDSHAKES_PER_ADDRESS``
from one source address (an IPv6 one by its /64), so that slow connections
from one address cannot take the slots a restarted peer at another address
needs. More are closed at once, before a byte is read.
"""

from __future__ import annotations

import contextlib
import ipaddress
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
"""The whole handshake, from the accept to ``ACCEPTED`` (TLS included): one deadline, not one per read."""
MAX_HANDSHAKES = 32
"""Connections that have not finished their handshake; more are closed at once (a flood costs no threads)."""
MAX_HANDSHAKES_PER_ADDRESS = 8
"""Of those, from one source address (IPv6: one /64). Peers' handshakes take milliseconds; nodes that share
an address (a cluster on one host) open at most one connection to this node each at a time."""


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
        receive: Callable[[str, str, list[bytes]], None],
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
        self._handshaking_from: dict[str, int] = {}
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
            deadline = tcp_wire.Deadline(HANDSHAKE_TIMEOUT_S)
            source = source_key(peer)
            with self._lock:
                busy = (
                    self._handshaking >= MAX_HANDSHAKES
                    or self._handshaking_from.get(source, 0) >= MAX_HANDSHAKES_PER_ADDRESS
                )
                if not busy:
                    self._handshaking += 1
                    self._handshaking_from[source] = self._handshaking_from.get(source, 0) + 1
            if busy:
                self.refused += 1
                sock.close()
                continue
            threading.Thread(
                target=self._serve, args=(sock, peer, source, deadline), name="raft-recv", daemon=True
            ).start()

    def _handshake_over(self, source: str) -> None:
        """One connection from ``source`` finished its handshake, or ended in it (holding _lock)."""
        self._handshaking -= 1
        left = self._handshaking_from[source] - 1
        if left:
            self._handshaking_from[source] = left
        else:
            del self._handshaking_from[source]

    def _serve(self, raw: socket.socket, peer: object, source: str, deadline: tcp_wire.Deadline) -> None:
        sock = raw
        sender = ""
        handshaking = True
        with self._lock:
            if self._closed:
                self._handshake_over(source)
                raw.close()
                return
            self._connections.add(raw)
        try:
            keepalive(raw)
            try:
                if self._tls is not None:
                    # The TLS handshake runs inside wrap_socket, bounded as a whole by the
                    # socket's timeout (CPython's do_handshake keeps one deadline across its waits).
                    deadline.arm(raw)
                    sock = self._tls.wrap_socket(raw, server_side=True)
                sender, address = self._handshake(sock, deadline)
            except TimeoutError:
                raise LinkRefused(f"the handshake did not finish within {deadline.seconds:g} s") from None
            threading.current_thread().name = f"raft-recv-{sender}"
            with self._lock:
                self._handshake_over(source)
                handshaking = False
                # A peer that reconnected: its old connection is dead to it.
                old = self._by_sender.get(sender)
                self._by_sender[sender] = raw
            if old is not None:
                _shut(old)
            sock.settimeout(None)
            reader = tcp_wire.FrameReader(sock, self._max_frame_bytes)
            while not self._closed:
                frames = reader.read()
                if not frames:
                    return  # closed by the peer
                self._receive(sender, address, frames)
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
                    self._handshake_over(source)
                if sender and self._by_sender.get(sender) is raw:
                    del self._by_sender[sender]
            with contextlib.suppress(OSError):
                sock.close()

    def _handshake(self, sock: socket.socket, deadline: tcp_wire.Deadline) -> tuple[str, str]:
        if not self._secret and not self._dev_mode:
            raise LinkRefused("this node has no cluster_secret and is not in dev_mode: it accepts no peers")
        challenge = os.urandom(tcp_wire.CHALLENGE_BYTES)
        tcp_wire.send_all(sock, challenge, deadline)
        body = tcp_wire.read_sized(sock, tcp_wire.HELLO_MAX_BYTES, deadline)
        hello = tcp_wire.check_hello(body, self._secret, challenge)
        tcp_wire.send_all(sock, tcp_wire.ACCEPTED, deadline)
        return hello.node_id, hello.address


def source_key(peer: object) -> str:
    """What the per-address bound counts by: the IPv4 address, or an IPv6 address's /64 (one host's usual share)."""
    host = peer[0] if isinstance(peer, tuple) and peer else str(peer)
    try:
        ip = ipaddress.ip_address(str(host).split("%", 1)[0])
    except ValueError:
        return str(host)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def _shut(sock: socket.socket) -> None:
    """Wake whoever blocks on ``sock`` (its reader thread closes it)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
