"""Every method the node serves, in one table: who may call it, where it runs, what bounds it.

Deny by default. The guard (``guard.py``) looks every call up here before
anything else: a method missing from :data:`METHODS` is refused
(UNIMPLEMENTED, UNKNOWN_METHOD), never passed through, whatever service it
belongs to; a method listed here is authenticated for its :class:`Role`,
counted and bounded in its :class:`Lane`, and its request (each message of a
stream too) is refused over its byte bound before it is parsed and over the
field limits of :data:`FIELD_LIMITS` after, before a handler sees it.
``tests/server/api/test_methods.py`` enumerates the services the node serves from
their descriptors, and fails for a method without an entry here, or a
repeated field of a request without a limit, so the next method cannot ship
open. docs/security.md gives the same table for people.

An entry that opts out of something says so, with why: health probes
(:attr:`Lane.PROBE`) are not counted, since a prober must never be refused;
the Raft stream's frames are bounded by bytes only (``Role.NODE`` callers,
parsed by the Raft router).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from google.protobuf import descriptor as pbd
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from mqds.protocol.delivery import MAX_BACKOFF
from mqds.protocol.errors import Reason
from mqds.protocol.limits import MAX_SESSIONS_PER_CALL
from mqds.protocol.retention import MAX_RULES
from mqds.server.auth import ADMIN, READ, WRITE
from mqds.server.raft.v1 import raft_pb2 as rpb
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb

if TYPE_CHECKING:
    from mqds.server.config import NodeConfig


class Role(enum.Enum):
    """Who may make a call."""

    ANYONE = "anyone"
    """No credentials: health probes (a kubelet or load balancer carries none)."""
    READ = READ
    """With a tokens file a reader token or better; without one, anyone (the API is on a private address)."""
    WRITE = WRITE
    """With a tokens file a broker token or better; without one, anyone."""
    ADMIN = ADMIN
    """An admin token, or the cluster secret; never open without one of them (but in dev_mode)."""
    NODE = "node"
    """The cluster's nodes only: the cluster secret (or dev_mode without one). Tokens do not count."""
    NOBODY = "nobody"
    """Refused to everyone (UNKNOWN_METHOD): a method of a served service's descriptor the node does not serve."""


class Lane(enum.Enum):
    """Where a call runs and which bound counts it (``guard.py``; DESIGN.md, "Workers, limits and refusals")."""

    PROBE = "probe"
    """The control pool, not counted: a health probe is never refused nor queued behind calls."""
    OBSERVE = "observe"
    """The control pool; counted per client (``max_calls_per_client``): status and the map answer on a busy node."""
    UNARY = "unary"
    """The server's workers; counted in ``max_public_calls`` and per client."""
    STREAM = "stream"
    """The stream pool (``max_public_streams`` threads); counted there and per client: a held stream takes no
    worker a unary call or a peer needs."""
    INTERNAL = "internal"
    """The server's workers left over by ``max_public_calls``; counted against them, so peers always find one."""
    PEER = "peer"
    """The peer pool (Raft streams, snapshots): counted against its threads."""


class RequestBytes(enum.Enum):
    """A request's byte bound (of each message, for a stream), checked before it is parsed."""

    DATA = "data"
    """``max_request_bytes``: requests that carry messages or records."""
    CONTROL = "control"
    """:data:`CONTROL_REQUEST_BYTES` (or ``max_request_bytes`` when smaller): every other request."""
    FRAME = "frame"
    """The port's receive limit: Raft frames, which carry entries up to twice the entry limit."""


CONTROL_REQUEST_BYTES = 4 * 1024 * 1024
"""The largest request that carries no messages: a thousand sessions' names and filters fit many times over,
and a flood of small repeated values costs the parser at most this (a 50 MB credit request once took a node
from 83 MiB to 1.9 GiB)."""

REFLECTION_MAX_S = 60.0
"""A server-reflection stream is cut after this long (tools ask, get their answer and close)."""


@dataclass(frozen=True)
class Method:
    """How one method is served."""

    role: Role
    lane: Lane
    request_bytes: RequestBytes = RequestBytes.CONTROL
    max_duration_s: float | None = None
    """A stream is cut after this long (None: it lasts as long as the caller keeps it)."""
    own_cap: bool = False
    """Server reflection: also bounded by a cap of its own (a quarter of ``max_public_streams``)."""


def _service(descriptor: pbd.ServiceDescriptor, **methods: Method) -> dict[str, Method]:
    names = {m.name for m in descriptor.methods}
    unknown = set(methods) - names
    assert not unknown, f"{descriptor.full_name} has no {sorted(unknown)}"
    return {f"/{descriptor.full_name}/{name}": method for name, method in methods.items()}


def _read(lane: Lane = Lane.UNARY) -> Method:
    return Method(Role.READ, lane)


def _write(request_bytes: RequestBytes = RequestBytes.CONTROL) -> Method:
    return Method(Role.WRITE, Lane.UNARY, request_bytes)


def _admin(request_bytes: RequestBytes = RequestBytes.CONTROL, lane: Lane = Lane.UNARY) -> Method:
    return Method(Role.ADMIN, lane, request_bytes)


def _node(lane: Lane = Lane.INTERNAL, request_bytes: RequestBytes = RequestBytes.CONTROL) -> Method:
    return Method(Role.NODE, lane, request_bytes)


_DATA = RequestBytes.DATA

STORAGE = pb.DESCRIPTOR.services_by_name["Storage"]
SESSIONS = spb.DESCRIPTOR.services_by_name["Sessions"]
CLUSTER = clpb.DESCRIPTOR.services_by_name["Cluster"]
RAFT = rpb.DESCRIPTOR.services_by_name["Raft"]
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
SERVED: tuple[pbd.ServiceDescriptor, ...] = (STORAGE, SESSIONS, CLUSTER, RAFT, HEALTH, REFLECTION)
"""Every service the node's port serves (``api/server.py`` registers exactly these)."""

METHODS: dict[str, Method] = {
    **_service(
        STORAGE,
        StoreBatch=_write(_DATA),
        StoreStream=Method(Role.WRITE, Lane.STREAM, _DATA),
        GetStreams=_read(),
        MakeIterator=_read(),
        Next=_read(),
        ListGenerations=_read(),
        GetFences=_read(),
        # A push subscription reads every message its filter matches: a reader's call, held open.
        Follow=Method(Role.READ, Lane.STREAM),
        # Generations and deletes change or destroy data for good; AddGeneration multiplies generations.
        AddGeneration=_admin(),
        DropGeneration=_admin(),
        DeleteMessages=_admin(),
        # A backup's export holds every client's state and message: admins only, as the restore.
        ExportShard=_admin(lane=Lane.STREAM),
        ImportShard=_admin(_DATA),
    ),
    **_service(
        SESSIONS,
        **dict.fromkeys(
            (
                "GetClientState",
                "ClientsOnNode",
                "GetSubscriptions",
                "GetRetained",
                "GetReadPosition",
                "GetReadPositions",
                "FetchMessages",
                "FetchMessagesShared",
            ),
            _read(),
        ),
        **dict.fromkeys(
            (
                "ClientConnected",
                "ClientDisconnected",
                "Subscribe",
                "Unsubscribe",
                "Ack",
                "ForgetReadPosition",
                "StartReadPosition",
                "StartReadPositions",
                "ForgetSession",
                "JoinShareGroup",
                "LeaveShareGroup",
            ),
            _write(),
        ),
        Retain=_write(_DATA),
        # It names every client, its subscriptions and where it reads, and the callers of push subscriptions:
        # admins only, as ExportShard. Its lag counts are what a reader could count with FetchMessages.
        ListConsumers=_admin(),
        ConsumerLag=_read(),
        # A broker's queue reader or share group takes messages: each step is a logged write (the deliveries).
        Deliver=_write(),
    ),
    **_service(
        CLUSTER,
        # Only what the node knows, never waiting on storage or Raft: answered on the busiest node.
        GetClusterMap=_read(Lane.OBSERVE),
        GetNodeStatus=_read(Lane.OBSERVE),
        # A digest scans a whole replica.
        GetReplicaDigest=_admin(),
        JoinNode=_admin(),
        LeaveNode=_admin(),
        ForgetNode=_admin(),
        Rebalance=_admin(),
        SetRetention=_admin(),
    ),
    **_service(
        RAFT,
        Stream=_node(Lane.PEER, RequestBytes.FRAME),
        FetchSnapshot=_node(Lane.PEER),
        ChangeMembership=_node(),
        TransferLeadership=_node(),
        ProposeMeta=_node(request_bytes=_DATA),
        InjectFault=_node(),
        LinkAddress=_node(),
    ),
    **_service(
        HEALTH,
        Check=Method(Role.ANYONE, Lane.PROBE),
        # grpc's health servicer does not implement it: refused here, not passed to a handler that fails.
        List=Method(Role.NOBODY, Lane.PROBE),
        # A watch is held open: a stream like any other, counted.
        Watch=Method(Role.ANYONE, Lane.STREAM),
    ),
    **_service(
        REFLECTION,
        # It describes the public API only (api/server.py): readers may use it.
        ServerReflectionInfo=Method(Role.READ, Lane.STREAM, max_duration_s=REFLECTION_MAX_S, own_cap=True),
    ),
}


# -- field limits ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limit:
    """The most entries a repeated field (or map) of a request may hold."""

    most: Callable[[NodeConfig], int]
    name: str
    """What the bound is called in the error (a setting's name, or the constant's)."""
    reason: Reason = Reason.INVALID_REQUEST


@dataclass(frozen=True)
class Elsewhere:
    """A repeated field bounded by another check, named here: the guard does not count it."""

    why: str


def _setting(name: str, reason: Reason = Reason.INVALID_REQUEST) -> Limit:
    return Limit(lambda config: int(getattr(config, name)), name, reason)


def _constant(value: int, name: str) -> Limit:
    return Limit(lambda config: value, name)


_SHARDS = _setting("n_shards")
MAX_THEN = 1000
"""NextRequest.then's most streams."""
MAX_SKIPPED_GENERATIONS = 65_536
"""ExportShardRequest.skip's most generations (a year of hourly generations is 8,760)."""
MAX_IMPORT_RECORDS = 262_144
"""ImportRecords' most keys (and values) in one call (the client sends 1 MiB of records a call)."""
MAX_BLOCKED_PEERS = 1024

FIELD_LIMITS: dict[str, Limit | Elsewhere] = {
    "mqds.v1.StoreBatchRequest.messages": _setting("max_batch_messages", Reason.BATCH_TOO_LARGE),
    "mqds.v1.Message.properties": Elsewhere(
        "checked with each message (at most 1,024 and 64 KiB), which fails alone and not its whole batch"
    ),
    "mqds.v1.GetStreamsRequest.shards": _SHARDS,
    "mqds.v1.NextRequest.then": _constant(MAX_THEN, "NextRequest.then's 1,000 streams"),
    "mqds.v1.AddGenerationRequest.shards": _SHARDS,
    "mqds.v1.ListGenerationsRequest.shards": _SHARDS,
    "mqds.v1.GetFencesRequest.shards": _SHARDS,
    "mqds.v1.ExportShardRequest.skip": _constant(MAX_SKIPPED_GENERATIONS, "65,536 generations"),
    "mqds.v1.ImportRecords.keys": _constant(MAX_IMPORT_RECORDS, "262,144 records a call"),
    "mqds.v1.ImportRecords.values": _constant(MAX_IMPORT_RECORDS, "262,144 records a call"),
    "mqds.v1.FollowStart.also": _setting("follow_max_subscriptions"),
    "mqds.v1.FollowCredit.also": _setting("follow_max_subscriptions"),
    "mqds.v1.ClientsOnNodeRequest.shards": _SHARDS,
    "mqds.v1.GetRetainedRequest.shards": _SHARDS,
    "mqds.v1.ReadPositionsRequest.pairs": _constant(MAX_SESSIONS_PER_CALL, "1,000 sessions a call"),
    "mqds.v1.FetchMessagesRequest.shards": _SHARDS,
    "mqds.v1.FetchMessagesRequest.after_us": _SHARDS,
    "mqds.v1.FetchMessagesSharedRequest.shards": _SHARDS,
    "mqds.v1.FetchMessagesSharedRequest.sessions": _constant(MAX_SESSIONS_PER_CALL, "1,000 sessions a call"),
    "mqds.v1.SharedFetchSession.after_us": _SHARDS,
    "mqds.v1.SharedFetchSession.shards": _SHARDS,
    "mqds.v1.ListConsumersRequest.shards": _SHARDS,
    "mqds.v1.ListConsumersRequest.starts": _SHARDS,
    "mqds.v1.ConsumerLagRequest.shards": _SHARDS,
    "mqds.v1.ConsumerLagRequest.items": _constant(MAX_SESSIONS_PER_CALL, "1,000 sessions a call"),
    "mqds.v1.LagItem.after_us": _SHARDS,
    "mqds.v1.DeliverRequest.shards": _SHARDS,
    "mqds.v1.DeliveryPolicy.backoff_ms": _constant(MAX_BACKOFF, "100 backoff waits"),
    "mqds.v1.RetentionPolicy.rules": _constant(MAX_RULES, "256 retention rules"),
    "mqds.server.raft.v1.Frame.messages": Elsewhere(
        "a Raft frame is bytes until the Raft router parses it, after the caller proved the cluster secret; "
        "the port's receive limit bounds it"
    ),
    "mqds.server.raft.v1.AppendEntries.entries": Elsewhere("inside a Raft frame: bounded by the frame's bytes"),
    "mqds.server.raft.v1.InjectFaultRequest.blocked_peers": _constant(MAX_BLOCKED_PEERS, "1,024 peers"),
}


def request_types(descriptor: pbd.Descriptor) -> Iterator[pbd.Descriptor]:
    """``descriptor`` and every message type it holds, each once (map entries excluded)."""
    seen: set[str] = set()
    todo = [descriptor]
    while todo:
        current = todo.pop()
        if current.full_name in seen:
            continue
        seen.add(current.full_name)
        yield current
        for field in current.fields:
            nested = field.message_type
            if nested is not None and not nested.GetOptions().map_entry:
                todo.append(nested)


def counted_fields(descriptor: pbd.Descriptor) -> Iterator[pbd.FieldDescriptor]:
    """The repeated fields and maps of a message type (map entries hold no repeated field of their own)."""
    for field in descriptor.fields:
        if field.is_repeated:
            yield field
