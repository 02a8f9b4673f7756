"""Raft messages between nodes: the router.

Each node keeps one link to every peer it knows: by default a TCP connection
written by the thread that sends (:mod:`mqds.server.raft.tcp_link`, received by
:mod:`mqds.server.raft.tcp_listener`), or, with ``raft_transport = "grpc"`` or
for a peer that takes no TCP, a long-lived ``Raft.Stream`` call
(:class:`~mqds.server.raft.grpc_link.GrpcPeerLink`, with a thread of its own).
Groups hand the router their encoded messages once their journal is synced
(a leader's appends before), a pass's groups all at once; the router sends
each peer its share in one frame (``send``). On the gRPC stream every message queued
for a peer, whatever its group, goes out in one ``Frame`` (each frame costs a
handful of thread hand-offs in gRPC on both ends). A message nobody waits for
(a heartbeat, a follower's answer that repeats its last one:
``Outgoing.lazy``) waits up to ``linger_s`` for company; any other message for
that peer sends it at once. Envelopes are built at the wire level (tag,
length, bytes), so a message is serialised once, by the group that sent it.

Receiving, from either link, goes through ``_receive_frames``: each frame is
parsed with protobuf, each message decoded by the restricted decoder
(:mod:`mqds.server.raft.codec`) and appended to its group's inbox; then the
cycles of the groups they touched run on the receiving thread
(:mod:`mqds.server.raft.cycles`), once for all the frames that arrived
together. A frame or message that does not parse, or
names a group this node does not host, is dropped and counted; it never
reaches pysyncobj.

Peers authenticate with the cluster secret: in the call metadata (compared in
constant time) on gRPC, with an HMAC proof in the TCP handshake; without a
secret only ``dev_mode`` lets them in. When the node serves TLS, its links to
peers are TLS too (the credentials come from :mod:`mqds.server.tls`).
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.server.raft import codec
from mqds.server.raft.cluster_auth import ClusterAuth
from mqds.server.raft.cycles import run_cycles
from mqds.server.raft.group import RaftGroup
from mqds.server.raft.grpc_link import GrpcPeerLink
from mqds.server.raft.outbox import Sends
from mqds.server.raft.tcp_link import TcpPeerLink
from mqds.server.raft.tcp_listener import TcpListener
from mqds.server.raft.v1 import raft_pb2 as rpb
from mqds.server.wire import ENVELOPE_GROUP_TAG, ENVELOPE_MESSAGE_TAG, FRAME_MESSAGES_TAG, varint

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 512 * 1024 * 1024),
    ("grpc.max_send_message_length", 512 * 1024 * 1024),
    # Notice a peer that vanished without closing its connection (a
    # partition, a paused process) within a few seconds.
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def envelope(group: int, raw_message: bytes) -> bytes:
    """A serialised ``Frame.messages`` item (tag included) for an encoded RaftMessage."""
    # One join: concatenating twice copied a message of tens of MiB twice.
    head = ENVELOPE_GROUP_TAG + varint(group) + ENVELOPE_MESSAGE_TAG + varint(len(raw_message))
    return b"".join((FRAME_MESSAGES_TAG, varint(len(head) + len(raw_message)), head, raw_message))


class PeerRouter:
    """Every Raft message a node sends or receives goes through here."""

    def __init__(
        self,
        auth: ClusterAuth,
        group_lookup: Callable[[int], RaftGroup | None],
        credentials: grpc.ChannelCredentials | None = None,
        linger_s: float = 0.0,
        transport: str = "tcp",
        tls_client: ssl.SSLContext | None = None,
    ) -> None:
        self.auth = auth
        self.transport = transport
        """How this node sends Raft messages: "tcp" (``tcp_link``) or "grpc" (the ``Raft.Stream`` call)."""
        self.tls_client = tls_client
        """The TLS context of Raft TCP connections to peers (None: plaintext)."""
        self._listener: TcpListener | None = None
        self.linger_s = linger_s
        """How long a lazy message (a heartbeat, a repeated answer) may wait for company (raft_heartbeat_linger_s)."""
        self._credentials = credentials
        self.node_id = auth.node_id
        self._lookup = group_lookup
        self._links: dict[str, GrpcPeerLink | TcpPeerLink] = {}
        self._addresses: dict[str, str] = {}
        self._lock = threading.Lock()
        self._blocked: frozenset[str] = frozenset()
        self._isolated = False
        self._listeners: list[Callable[[str, bool], None]] = []
        # Dropped incoming traffic, by cause (metrics and node status).
        self.dropped_frames = 0
        """Frames that did not parse (every message in them lost)."""
        self.dropped_malformed = 0
        """Messages the restricted decoder refused."""
        self.dropped_unknown_group = 0
        """Messages for a group this node does not host (a replica moved away, or not opened yet)."""
        self.dropped_overflow = 0
        """Outgoing messages dropped because a peer's queue grew past its bound (Raft resends)."""

    @property
    def dropped_messages(self) -> int:
        """Incoming messages dropped one by one: malformed or for a group not hosted here."""
        return self.dropped_malformed + self.dropped_unknown_group

    def peer_links(self) -> dict[str, bool]:
        """Each peer this node keeps a Raft link to, and whether the link is up (and not blocked)."""
        return {node_id: self.is_connected(node_id) for node_id in list(self._links)}

    def open_channel(self, address: str) -> grpc.Channel:
        """A channel to a peer: TLS when the node serves TLS (``credentials``), plaintext otherwise."""
        if self._credentials is None:
            return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.secure_channel(address, self._credentials, options=CHANNEL_OPTIONS)

    # -- address book ----------------------------------------------------------

    def set_address(self, node_id: str, address: str) -> None:
        """Learn (or update) where a peer listens; opens a link to it."""
        if node_id == self.node_id or not address:
            return
        with self._lock:
            if self._addresses.get(node_id) == address:
                return
            self._addresses[node_id] = address
            link = self._links.get(node_id)
            if link is None:
                link_class = TcpPeerLink if self.transport == "tcp" else GrpcPeerLink
                self._links[node_id] = link_class(self, node_id, address)
            else:
                link.address = address
        log.info("peer %s is at %s", node_id, address)

    def forget(self, node_id: str) -> None:
        with self._lock:
            self._addresses.pop(node_id, None)
            link = self._links.pop(node_id, None)
        if link is not None:
            link.close()

    def address_of(self, node_id: str) -> str | None:
        if node_id == self.node_id:
            return self.auth.address
        return self._addresses.get(node_id)

    def on_link_change(self, listener: Callable[[str, bool], None]) -> None:
        self._listeners.append(listener)

    def link_changed(self, node_id: str, connected: bool) -> None:
        for listener in self._listeners:
            listener(node_id, connected)

    def is_connected(self, node_id: str) -> bool:
        link = self._links.get(node_id)
        return link is not None and link.connected and node_id not in self._blocked and not self._isolated

    def close(self) -> None:
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.close()
        if self._listener is not None:
            self._listener.close()

    # -- Raft over TCP (the receiving end) ----------------------------------------

    def listen_tcp(self, listen: str, max_frame_bytes: int, tls_server: ssl.SSLContext | None) -> int:
        """Take peers' Raft connections on ``listen`` (host:port, port 0: any); the port bound."""
        self._listener = TcpListener(
            listen, self.auth.secret, self.auth.dev_mode, self._receive_tcp, max_frame_bytes, tls_server
        )
        return self._listener.port

    @property
    def tcp_port(self) -> int:
        """The port peers send Raft traffic to over TCP (``Raft.LinkAddress``); 0 when this node takes none."""
        return self._listener.port if self._listener is not None else 0

    @property
    def refused_connections(self) -> int:
        return self._listener.refused if self._listener is not None else 0

    def _receive_tcp(self, sender: str, address: str, frames: list[bytes]) -> None:
        if sender in self._blocked or self._isolated:
            return
        if address and sender != self.node_id and self._addresses.get(sender) != address:
            self.set_address(sender, address)
        self._receive_frames(sender, frames)

    def isolate(self) -> None:
        """Drop all Raft traffic to and from every peer from now on: a node whose disk failed leaves its groups.

        Its groups can no longer log or vote, but a leader's heartbeats need
        no log write: without this they would go on, and no follower would
        elect a leader that can write.
        """
        self._isolated = True
        for node_id in list(self._links):
            self.link_changed(node_id, False)

    # -- faults (tests) --------------------------------------------------------

    def block(self, node_ids: list[str]) -> None:
        """Drop all Raft traffic to and from these peers (an empty list heals)."""
        before = self._blocked
        self._blocked = frozenset(node_ids)
        for node_id in before | self._blocked:
            if (node_id in before) != (node_id in self._blocked):
                link = self._links.get(node_id)
                self.link_changed(node_id, link is not None and link.connected and node_id not in self._blocked)

    # -- sending ---------------------------------------------------------------

    def send(self, sends: Sends) -> None:
        """The messages of a pass's (or a lone cycle's) groups: each peer's in one frame, lazy only if all are."""
        if self._isolated:
            return
        by_peer: dict[str, list[bytes]] = {}
        urgent: set[str] = set()
        for group, messages in sends:
            for node_id, raw, lazy in messages:
                by_peer.setdefault(node_id, []).append(envelope(group, raw))
                if not lazy:
                    urgent.add(node_id)
        blocked = self._blocked
        for node_id, items in by_peer.items():
            link = self._links.get(node_id)
            if link is not None and node_id not in blocked:
                link.enqueue(items, lazy=node_id not in urgent)

    # -- receiving (the server side of Raft.Stream) ------------------------------

    def serve_stream(self, frames: Iterator[bytes], context: grpc.ServicerContext) -> rpb.StreamClosed:
        sender, address = self.auth.check(context)
        if not sender:
            raise errors.error(Reason.INVALID_REQUEST, "Raft stream without a node id")
        if address and sender != self.node_id:
            self.set_address(sender, address)
        for raw in frames:
            if sender in self._blocked or self._isolated:
                continue
            self._receive_frames(sender, [raw])
        return rpb.StreamClosed()

    def _receive_frames(self, sender: str, raws: list[bytes]) -> None:
        """Frames from ``sender``, in order: every message delivered, then the groups touched run, once each."""
        touched: dict[int, RaftGroup] = {}
        for raw in raws:
            self._deliver_frame(sender, raw, touched)
        # Their cycles run here, sharing one log write, instead of handing each group to the scheduler (cycles.py).
        run_cycles(touched.values())

    def _deliver_frame(self, sender: str, raw: bytes, touched: dict[int, RaftGroup]) -> None:
        try:
            frame = rpb.Frame.FromString(raw)
        except Exception as err:  # DecodeError, or RuntimeError from upb
            self.dropped_frames += 1
            log.warning("dropped a Raft frame from %s that does not parse: %s", sender, err)
            return
        for env in frame.messages:
            group = self._lookup(env.group)
            if group is None:
                self.dropped_unknown_group += 1
                continue
            try:
                message = codec.decode_message(env.message)
            except codec.MalformedMessage as err:
                self.dropped_malformed += 1
                log.warning("dropped a malformed Raft message from %s for group %d: %s", sender, env.group, err)
                continue
            # A snapshot's transfer marks its group for the scheduler's long lane (``RaftGroup.deliver``):
            # run_cycles then hands it on, with whatever follows it in the frame.
            group.deliver(sender, message, env.message.echo, wake=False, sequence=env.message.sequence)
            touched.setdefault(env.group, group)


def raft_stream_handler(router: PeerRouter) -> Any:
    """The gRPC method handler of Raft.Stream: frames arrive as bytes, parsed by the router.

    Each peer's stream holds a thread for as long as its link is up: the
    node's guard runs the streams on its peer pool, not on the workers that
    serve calls, whose count must not depend on the size of the cluster. A
    caller without the cluster secret is refused at once.
    """

    def handle(frames: Iterator[bytes], context: grpc.ServicerContext) -> rpb.StreamClosed:
        try:
            return router.serve_stream(frames, context)
        except errors.MqdsError as err:
            context.abort_with_status(errors.to_status(err))
            raise  # not reached: abort raises

    return grpc.stream_unary_rpc_method_handler(
        handle, request_deserializer=lambda b: b, response_serializer=rpb.StreamClosed.SerializeToString
    )
