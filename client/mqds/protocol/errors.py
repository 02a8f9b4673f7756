"""The errors of mqds: one table, shared by every layer, mapped to gRPC here.

Each failure has a :class:`Reason`. The table :data:`REASONS` says, for each,
the gRPC status code it travels with, whether a client should retry it,
whether the client's idea of who leads the shard is stale, and the exception
class the caller sees. Servers raise :func:`error` with a reason and a message
that says what was wrong; :func:`to_status` turns it into a gRPC status whose
details carry a ``google.rpc.ErrorInfo`` (domain ``mqds``, the reason, and
metadata such as a leader hint); :func:`from_rpc_error` turns a failed call
back into the same exception on the client. Nothing else translates errors.

Domain outcomes that are not failures (a client without state, an empty
batch) are data in responses, never errors.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "mqds"


class MqdsError(Exception):
    """Base of every mqds error. ``reason`` says exactly what failed."""

    def __init__(self, reason: Reason, message: str, metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.metadata: dict[str, str] = dict(metadata or {})

    @property
    def info(self) -> ReasonInfo:
        return REASONS[self.reason]

    @property
    def retriable(self) -> bool:
        """True when the same call may succeed if tried again later."""
        return REASONS[self.reason].retriable

    @property
    def refresh_leader(self) -> bool:
        """True when the caller's routing information is stale."""
        return REASONS[self.reason].refresh_leader

    @property
    def code(self) -> grpc.StatusCode:
        return REASONS[self.reason].code

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.message}"


class InvalidArgumentError(MqdsError, ValueError):
    """The request is wrong and will stay wrong: fix it, do not retry."""


class NotFoundError(MqdsError, LookupError):
    """What the request names does not exist (any more)."""


class GenerationDroppedError(NotFoundError):
    """The generation an iterator or stream points into was dropped; call get_streams again."""


class FailedPreconditionError(MqdsError):
    """The request is valid but the state it needs does not hold."""


class UnavailableError(MqdsError):
    """The node cannot serve now; retry, possibly elsewhere."""


class NotLeaderError(UnavailableError):
    """The node is not the leader of the shard; ``leader`` and ``leader_address`` say who is, when known."""

    @property
    def leader(self) -> str | None:
        return self.metadata.get("leader") or None

    @property
    def leader_address(self) -> str | None:
        return self.metadata.get("leader_address") or None


class AuthenticationError(MqdsError):
    """The caller did not prove it may make this call (a wrong or missing cluster secret)."""


class PermissionDeniedError(MqdsError, PermissionError):
    """The caller's role does not allow this call (see the node's auth_tokens_file)."""


class DeadlineExceededError(MqdsError, TimeoutError):
    """The call did not finish in time; whether it took effect is unknown."""


class InternalError(MqdsError):
    """A failure inside the node (a bug or a storage fault)."""


class PartialBatchError(MqdsError):
    """Some shards' parts of a ``store_batch`` were stored and others were not.

    ``stored`` holds the stored messages (with ``timestamp_us`` and ``shard``
    set); ``failed`` pairs every other message with the error its shard's part
    failed with. ``reason`` and ``retriable`` are those of the failures (retriable
    only if every failure is). Retrying just the failed messages with the same
    ``sequence`` (``client.store_batch(err.failed_messages, sequence=err.sequence)``)
    cannot store a message twice, even where the outcome was unknown.
    """

    def __init__(self, stored: list[Any], failed: list[tuple[Any, MqdsError]], sequence: int) -> None:
        first = failed[0][1]
        shards = sorted({int(m.shard) for m, _ in failed if m.shard is not None})
        super().__init__(
            first.reason,
            f"{len(stored)} messages stored, {len(failed)} not (shards {shards}): {first.message}",
            first.metadata,
        )
        self.stored = stored
        self.failed = failed
        self.sequence = sequence

    @property
    def failed_messages(self) -> list[Any]:
        return [message for message, _ in self.failed]

    @property
    def retriable(self) -> bool:
        return all(err.retriable for _, err in self.failed)


class Reason(enum.Enum):
    """Why a call failed. The value is what travels in ErrorInfo.reason."""

    # The request did not parse as the expected protobuf message (for example
    # a string field that is not UTF-8).
    MALFORMED_REQUEST = "MALFORMED_REQUEST"
    # A topic name to store is empty, has wildcards, NUL, or is too long.
    INVALID_TOPIC = "INVALID_TOPIC"
    # A topic filter breaks the MQTT rules (e.g. "a/#/b").
    INVALID_TOPIC_FILTER = "INVALID_TOPIC_FILTER"
    # A message field other than topic or payload is wrong (qos out of range,
    # clientid too long).
    INVALID_MESSAGE = "INVALID_MESSAGE"
    # A payload is larger than the node's max_payload_bytes.
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
    # A batch has more messages than the node's max_batch_messages.
    BATCH_TOO_LARGE = "BATCH_TOO_LARGE"
    # An iterator token is garbage, truncated, or from an unknown format.
    INVALID_ITERATOR = "INVALID_ITERATOR"
    # A saved follow position is damaged, or belongs to another cluster or
    # another topic filter.
    INVALID_POSITION = "INVALID_POSITION"
    # Another request field is out of range (e.g. batch_size 0).
    INVALID_REQUEST = "INVALID_REQUEST"
    # The node serves no such method (deny by default: a method missing
    # from the node's table is refused, whatever service it names).
    UNKNOWN_METHOD = "UNKNOWN_METHOD"
    # A clientid that state cannot be kept under: empty, NUL, or too long.
    INVALID_CLIENTID = "INVALID_CLIENTID"
    # The shard number is not one of the database's shards.
    UNKNOWN_SHARD = "UNKNOWN_SHARD"
    # The generation never existed in the shard.
    UNKNOWN_GENERATION = "UNKNOWN_GENERATION"
    # The stream id is not known in the shard.
    UNKNOWN_STREAM = "UNKNOWN_STREAM"
    # The generation existed and was dropped (retention or DropGeneration).
    GENERATION_DROPPED = "GENERATION_DROPPED"
    # The operation needs a closed generation but got the current one.
    CURRENT_GENERATION = "CURRENT_GENERATION"
    # The node is not the leader of the shard (or of the metadata group); the
    # ErrorInfo metadata names the leader when the node knows it.
    NOT_LEADER = "NOT_LEADER"
    # The shard has no leader right now (an election is in progress, or a
    # majority of its replicas cannot be reached).
    NO_LEADER = "NO_LEADER"
    # The node holds no replica of the shard; the metadata lists the nodes
    # that do ("replicas").
    NOT_HOSTED = "NOT_HOSTED"
    # A stale_ok read with a fence reached a replica that has not applied up
    # to the fence yet; another replica (or this one, later) can answer.
    REPLICA_BEHIND = "REPLICA_BEHIND"
    # Too much is waiting to be committed; back off and retry.
    OVERLOADED = "OVERLOADED"
    # The leader's data directory reached its disk quota, or its disk's free
    # space fell below the node's floor: it takes no write that adds data
    # (new messages, retained messages, new subscriptions, clients and read
    # positions, restores) until space returns (retention or a drop of
    # generations frees it; reads, deletes and whatever removes or updates
    # state go on). Retried with backoff within the deadline.
    STORAGE_FULL = "STORAGE_FULL"
    # A store would take a retention rule with discard=new over its
    # max_messages or max_bytes in a shard (the message names the rule). Not
    # retried: room comes back only when deletes or the rule's period remove
    # messages, which no retry within a deadline can count on.
    LIMIT_REACHED = "LIMIT_REACHED"
    # A restore (Storage.ImportShard) found the shard holding messages or
    # broker state: a backup is restored into an empty cluster only.
    SHARD_NOT_EMPTY = "SHARD_NOT_EMPTY"
    # The shard is being restored from a backup (mqds restore): it takes
    # nothing else until the restore has finished. Retried with backoff.
    SHARD_RESTORING = "SHARD_RESTORING"
    # A restore step (Storage.ImportShard records, finish or abandon) for a
    # shard that no begin put in restore mode: begin the restore first.
    NOT_RESTORING = "NOT_RESTORING"
    # Another membership change of the group is not committed yet.
    MEMBERSHIP_CHANGE_IN_PROGRESS = "MEMBERSHIP_CHANGE_IN_PROGRESS"
    # A node id that is not a member of the cluster.
    UNKNOWN_NODE = "UNKNOWN_NODE"
    # The request would break a rule of the cluster (e.g. remove the last
    # node, or a node that still holds replicas).
    MEMBERSHIP_REFUSED = "MEMBERSHIP_REFUSED"
    # The caller presented no valid token (or, node to node, not the
    # cluster's credentials).
    UNAUTHENTICATED = "UNAUTHENTICATED"
    # The caller's token is valid, but its role may not make this call.
    PERMISSION_DENIED = "PERMISSION_DENIED"
    # The node is shutting down.
    SHUTTING_DOWN = "SHUTTING_DOWN"
    # The node could not be reached (connection refused, reset, no route).
    UNAVAILABLE = "UNAVAILABLE"
    # The call did not complete before its deadline.
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    # A batch on a StoreStream call broke the stream's rules: a sequence not
    # greater than the previous batch's, or another producer_id.
    OUT_OF_ORDER = "OUT_OF_ORDER"
    # A StoreStream call sent no batch for the node's store_stream_idle_s.
    STREAM_IDLE = "STREAM_IDLE"
    # The storage engine failed (I/O error, corruption detected).
    STORAGE_ERROR = "STORAGE_ERROR"
    # An unexpected failure inside the node: a bug.
    INTERNAL = "INTERNAL"


@dataclass(frozen=True)
class ReasonInfo:
    """How a reason travels and how a client reacts to it."""

    code: grpc.StatusCode
    retriable: bool
    refresh_leader: bool
    error_class: type[MqdsError]


_IA = grpc.StatusCode.INVALID_ARGUMENT
_NF = grpc.StatusCode.NOT_FOUND
# Over a size limit of the node: gRPC's own code for a message too large.
_RE = grpc.StatusCode.RESOURCE_EXHAUSTED

# reason -> (gRPC code, retry?, refresh leader?, exception class)
REASONS: dict[Reason, ReasonInfo] = {
    Reason.MALFORMED_REQUEST: ReasonInfo(_IA, False, False, InvalidArgumentError),
    Reason.INVALID_TOPIC: ReasonInfo(_IA, False, False, InvalidArgumentError),
    Reason.INVALID_TOPIC_FILTER: ReasonInfo(_IA, False, False, InvalidArgumentError),
    Reason.INVALID_MESSAGE: ReasonInfo(_IA, False, False, InvalidArgumentError),
    Reason.PAYLOAD_TOO_LARGE: ReasonInfo(_RE, False, False, InvalidArgumentError),
    Reason.BATCH_TOO_LARGE: ReasonInfo(_RE, False, False, InvalidArgumentError),
    Reason.INVALID_ITERATOR: ReasonInfo(_IA, False, False, InvalidArgumentError),
    Reason.INVALID_POSITION: ReasonInfo(_IA, False, False, InvalidArgumentError),
    Reason.INVALID_REQUEST: ReasonInfo(_IA, False, False, InvalidArgumentError),
    Reason.UNKNOWN_METHOD: ReasonInfo(grpc.StatusCode.UNIMPLEMENTED, False, False, InvalidArgumentError),
    Reason.INVALID_CLIENTID: ReasonInfo(_IA, False, False, InvalidArgumentError),
    Reason.UNKNOWN_SHARD: ReasonInfo(_NF, False, False, NotFoundError),
    Reason.UNKNOWN_GENERATION: ReasonInfo(_NF, False, False, NotFoundError),
    Reason.UNKNOWN_STREAM: ReasonInfo(_NF, False, False, NotFoundError),
    Reason.GENERATION_DROPPED: ReasonInfo(_NF, False, False, GenerationDroppedError),
    Reason.CURRENT_GENERATION: ReasonInfo(grpc.StatusCode.FAILED_PRECONDITION, False, False, FailedPreconditionError),
    Reason.NOT_LEADER: ReasonInfo(grpc.StatusCode.UNAVAILABLE, True, True, NotLeaderError),
    Reason.NO_LEADER: ReasonInfo(grpc.StatusCode.UNAVAILABLE, True, True, UnavailableError),
    Reason.NOT_HOSTED: ReasonInfo(grpc.StatusCode.UNAVAILABLE, True, True, NotLeaderError),
    Reason.REPLICA_BEHIND: ReasonInfo(grpc.StatusCode.UNAVAILABLE, True, False, UnavailableError),
    Reason.OVERLOADED: ReasonInfo(grpc.StatusCode.RESOURCE_EXHAUSTED, True, False, UnavailableError),
    Reason.STORAGE_FULL: ReasonInfo(grpc.StatusCode.RESOURCE_EXHAUSTED, True, False, UnavailableError),
    Reason.LIMIT_REACHED: ReasonInfo(_RE, False, False, FailedPreconditionError),
    Reason.SHARD_RESTORING: ReasonInfo(grpc.StatusCode.UNAVAILABLE, True, False, UnavailableError),
    Reason.SHARD_NOT_EMPTY: ReasonInfo(grpc.StatusCode.FAILED_PRECONDITION, False, False, FailedPreconditionError),
    Reason.NOT_RESTORING: ReasonInfo(grpc.StatusCode.FAILED_PRECONDITION, False, False, FailedPreconditionError),
    Reason.MEMBERSHIP_CHANGE_IN_PROGRESS: ReasonInfo(grpc.StatusCode.ABORTED, True, False, FailedPreconditionError),
    Reason.UNKNOWN_NODE: ReasonInfo(_NF, False, False, NotFoundError),
    Reason.MEMBERSHIP_REFUSED: ReasonInfo(grpc.StatusCode.FAILED_PRECONDITION, False, False, FailedPreconditionError),
    Reason.UNAUTHENTICATED: ReasonInfo(grpc.StatusCode.UNAUTHENTICATED, False, False, AuthenticationError),
    Reason.PERMISSION_DENIED: ReasonInfo(grpc.StatusCode.PERMISSION_DENIED, False, False, PermissionDeniedError),
    Reason.SHUTTING_DOWN: ReasonInfo(grpc.StatusCode.UNAVAILABLE, True, True, UnavailableError),
    Reason.UNAVAILABLE: ReasonInfo(grpc.StatusCode.UNAVAILABLE, True, True, UnavailableError),
    Reason.DEADLINE_EXCEEDED: ReasonInfo(grpc.StatusCode.DEADLINE_EXCEEDED, True, True, DeadlineExceededError),
    Reason.OUT_OF_ORDER: ReasonInfo(_IA, False, False, InvalidArgumentError),
    Reason.STREAM_IDLE: ReasonInfo(grpc.StatusCode.DEADLINE_EXCEEDED, True, False, DeadlineExceededError),
    Reason.STORAGE_ERROR: ReasonInfo(grpc.StatusCode.INTERNAL, False, False, InternalError),
    Reason.INTERNAL: ReasonInfo(grpc.StatusCode.INTERNAL, False, False, InternalError),
}

# The node is there and still leads, but takes no more now: the client asks
# the same node again after a pause, without refreshing its cluster map.
BUSY: frozenset[Reason] = frozenset({Reason.OVERLOADED, Reason.STORAGE_FULL})

# A failed call without ErrorInfo (from gRPC itself, a proxy, or another
# server) is classified by its status code alone.
_BY_CODE: dict[grpc.StatusCode, Reason] = {
    grpc.StatusCode.UNAVAILABLE: Reason.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: Reason.DEADLINE_EXCEEDED,
    grpc.StatusCode.INVALID_ARGUMENT: Reason.INVALID_REQUEST,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Reason.INVALID_REQUEST,
    grpc.StatusCode.NOT_FOUND: Reason.UNKNOWN_STREAM,
    grpc.StatusCode.FAILED_PRECONDITION: Reason.CURRENT_GENERATION,
    grpc.StatusCode.CANCELLED: Reason.UNAVAILABLE,
    grpc.StatusCode.ABORTED: Reason.MEMBERSHIP_CHANGE_IN_PROGRESS,
    grpc.StatusCode.UNAUTHENTICATED: Reason.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: Reason.PERMISSION_DENIED,
}


def error(reason: Reason, message: str, **metadata: str) -> MqdsError:
    """The exception for ``reason``, of the class the table names."""
    return REASONS[reason].error_class(reason, message, metadata)


def to_status(err: MqdsError) -> grpc.Status:
    """The gRPC status a server aborts with for ``err``."""
    info = error_details_pb2.ErrorInfo(reason=err.reason.value, domain=DOMAIN, metadata=err.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    code = REASONS[err.reason].code
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=err.message, details=[detail])
    return rpc_status.to_status(status)


def from_rpc_error(err: grpc.RpcError) -> MqdsError:
    """The mqds exception for a failed gRPC call, from its ErrorInfo when present."""
    call: grpc.Call = err
    status = None
    try:
        status = rpc_status.from_call(call)
    except ValueError:  # a status whose details do not agree with its code
        status = None
    code = call.code()
    message = call.details() or (code.name if code is not None else "unknown error")
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                if info.domain == DOMAIN and info.reason in Reason.__members__:
                    return error(Reason[info.reason], status.message, **dict(info.metadata))
    reason = _BY_CODE.get(code, Reason.INTERNAL) if code is not None else Reason.INTERNAL
    return error(reason, message)


def from_failure(failure: Any) -> MqdsError:
    """The exception for one shard's failure in a ``StoreBatchResponse`` (an ``mqds.v1.ShardFailure``)."""
    reason = Reason[failure.reason] if failure.reason in Reason.__members__ else Reason.INTERNAL
    metadata = dict(failure.metadata)
    metadata.setdefault("shard", str(failure.shard))
    return error(reason, failure.message, **metadata)


def from_message_failure(failure: Any, where: str) -> MqdsError:
    """The exception for one message a node refused (an ``mqds.v1.MessageFailure``); ``where`` names the message
    as the caller numbers it ("message 3"), which may not be its index in the request the node saw."""
    reason = Reason[failure.reason] if failure.reason in Reason.__members__ else Reason.INTERNAL
    return error(reason, f"{where}: {failure.message}")
