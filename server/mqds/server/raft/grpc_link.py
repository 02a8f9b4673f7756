"""Raft messages to a peer over a long-lived gRPC stream (``Raft.Stream``): the link, and its frame queue.

The router (:mod:`mqds.server.raft.transport`) keeps one link to every peer:
this one with ``raft_transport = "grpc"``, and under a TCP link
(:mod:`mqds.server.raft.tcp_link`) for a peer that takes no Raft over TCP. A
link has a thread of its own that keeps the call open and sends what waits in
its :class:`FrameQueue`: every message queued for the peer, whatever its
group, in one ``Frame``, at once, or, when all of it is lazy (a heartbeat, a
repeated answer), once it waited ``linger_s`` for company. While the stream
is down nothing is queued (Raft resends).

A link sees its router through :class:`LinkRouter`, what it uses of it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import grpc

from mqds.server.raft.cluster_auth import ClusterAuth
from mqds.server.raft.v1 import raft_pb2 as rpb

log = logging.getLogger(__name__)

STREAM_METHOD = "/mqds.server.raft.v1.Raft/Stream"

# A peer's queue is cleared when it holds more than this (Raft resends).
_MAX_QUEUED_BYTES = 256 * 1024 * 1024
_RECONNECT_MIN_S = 0.05
_RECONNECT_MAX_S = 1.0


class LinkRouter(Protocol):
    """What a peer link uses of the router that owns it (:class:`mqds.server.raft.transport.PeerRouter`)."""

    dropped_overflow: int
    """Outgoing messages dropped because a peer's queue grew past its bound (a link adds to it)."""

    @property
    def auth(self) -> ClusterAuth: ...

    @property
    def linger_s(self) -> float: ...

    def open_channel(self, address: str) -> grpc.Channel: ...

    def link_changed(self, node_id: str, connected: bool) -> None: ...


class FrameQueue:
    """What waits to go to one peer, taken a frame at a time.

    Envelopes keep their order. ``take`` returns everything queued as one
    frame as soon as a message that is not lazy is queued, or once the oldest
    lazy one has waited ``linger_s``. Messages are accepted only while the
    queue is open (the link is up); closing it drops what waits (Raft resends).
    """

    def __init__(self, linger_s: float, max_bytes: int = _MAX_QUEUED_BYTES) -> None:
        self.linger_s = linger_s
        self._max_bytes = max_bytes
        self._items: collections.deque[bytes] = collections.deque()
        self._bytes = 0
        self._urgent = False
        self._lazy_since = 0.0
        self._open = False
        self._cond = threading.Condition()

    def put(self, items: list[bytes], lazy: bool = False) -> int:
        """Queue envelopes; the number of messages dropped because the queue grew past its bound."""
        with self._cond:
            if not self._open:
                return 0
            was_empty = not self._items
            self._items.extend(items)
            self._bytes += sum(len(item) for item in items)
            if self._bytes > self._max_bytes:
                dropped = len(self._items)
                self._clear()
                return dropped
            if not lazy or self.linger_s <= 0:
                self._urgent = True
                self._cond.notify()
            elif was_empty:
                # The first lazy message: the taker sets its timer by it.
                self._lazy_since = time.monotonic()
                self._cond.notify()
            return 0

    @property
    def is_open(self) -> bool:
        return self._open

    def set_open(self, open_: bool) -> bool:
        """Open or close the queue (closing drops what waits); whether that changed anything."""
        with self._cond:
            if self._open == open_:
                return False
            self._open = open_
            if not open_:
                self._clear()
            return True

    def wake(self) -> None:
        """Make a waiting ``take`` look at its ``stop`` condition again."""
        with self._cond:
            self._cond.notify_all()

    def take(self, stop: Callable[[], bool]) -> bytes | None:
        """The next frame, once it is due; None as soon as ``stop()`` is true (checked whenever woken)."""
        with self._cond:
            while True:
                if stop():
                    return None
                wait_s = 1.0
                if self._items:
                    if self._urgent:
                        break
                    wait_s = self._lazy_since + self.linger_s - time.monotonic()
                    if wait_s <= 0:
                        break
                self._cond.wait(wait_s)
            frame = b"".join(self._items)
            self._clear()
            return frame

    def _clear(self) -> None:
        self._items.clear()
        self._bytes = 0
        self._urgent = False


class GrpcPeerLink:
    """The outgoing stream to one peer, with its queue and thread."""

    def __init__(self, router: LinkRouter, node_id: str, address: str) -> None:
        self.router = router
        self.node_id = node_id
        self.address = address
        self.queue = FrameQueue(router.linger_s)
        self._closed = False
        self._call_done = threading.Event()
        self.sent_frames = 0
        self._thread = threading.Thread(target=self._run, name=f"raft-link-{node_id}", daemon=True)
        self._thread.start()

    @property
    def connected(self) -> bool:
        """Whether the stream to the peer is up (its queue takes messages only then)."""
        return self.queue.is_open

    def enqueue(self, items: list[bytes], lazy: bool = False) -> None:
        """Queue envelopes for this peer; unless ``lazy``, the link sends at once (with what waits)."""
        dropped = self.queue.put(items, lazy)
        if dropped:
            log.warning("raft link to %s: more than %d bytes queued; dropped them", self.node_id, _MAX_QUEUED_BYTES)
            self.router.dropped_overflow += dropped

    def close(self) -> None:
        self._closed = True
        self.queue.wake()

    def _stopped(self) -> bool:
        return self._closed or self._call_done.is_set()

    def _frames(self) -> Iterator[bytes]:
        while (frame := self.queue.take(self._stopped)) is not None:
            self.sent_frames += 1
            yield frame

    def _set_connected(self, connected: bool) -> None:
        if not self.queue.set_open(connected):
            return
        log.info("raft link to %s (%s) %s", self.node_id, self.address, "up" if connected else "down")
        self.router.link_changed(self.node_id, connected)

    def _run(self) -> None:
        backoff = _RECONNECT_MIN_S
        while not self._closed:
            address = self.address
            channel = self.router.open_channel(address)
            try:
                grpc.channel_ready_future(channel).result(timeout=1.0)
            except grpc.FutureTimeoutError:
                channel.close()
                time.sleep(backoff)
                backoff = min(backoff * 2, _RECONNECT_MAX_S)
                continue
            stream = channel.stream_unary(
                STREAM_METHOD, request_serializer=lambda b: b, response_deserializer=rpb.StreamClosed.FromString
            )
            self._call_done.clear()
            future = stream.future(self._frames(), metadata=self.router.auth.metadata())
            future.add_done_callback(lambda _: self._call_done.set())
            self._set_connected(True)
            backoff = _RECONNECT_MIN_S
            while not self._closed and not self._call_done.wait(0.5):
                if self.address != address:
                    break  # the peer moved: reconnect to its new address
            self._set_connected(False)
            future.cancel()
            self._call_done.set()
            self.queue.wake()
            if not self._closed:
                try:
                    future.result(timeout=0)
                except Exception as err:  # the reason the stream ended, for the log
                    log.debug("raft link to %s ended: %s", self.node_id, err)
            channel.close()
            if not self._closed:
                time.sleep(backoff)
