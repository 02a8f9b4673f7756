"""Hostile requests built from the protobuf descriptors: one generator for the adversarial suite and the chaos runs.

Every method of the node's method table (``mqds.server.api.methods``) gets
well-formed but hostile requests: deep and odd topics, edge-case numbers,
unknown enum values, repeated fields and maps with thousands of (duplicate)
entries, garbage where bytes go, nested messages a few levels down; a
streaming method gets a stream of one to four of them. The values are drawn
from a ``random.Random``: the chaos runs' hostile clients seed one, and the
adversarial suite passes hypothesis's (``st.randoms()``), which records and
shrinks the draws, so a failure found either way is the same kind of request.

:func:`call` sends one, whatever the method's shape (unary, server-, client-
or bidirectional streaming), and returns the status code it was answered
with. :data:`DESTRUCTIVE` are the methods that would legitimately destroy
data or change the cluster when such a request happens to make sense: they
are sent without the proof they need, and must be refused.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from google.protobuf import descriptor as pbd
from google.protobuf import message_factory
from google.protobuf.message import Message as PbMessage

from mqds.server.api.methods import METHODS, SERVED, Role

F = pbd.FieldDescriptor

READ_ONLY_ADMIN = frozenset({"/mqds.v1.Storage/ExportShard", "/mqds.v1.Cluster/GetReplicaDigest"})
"""Admin methods that only read: sent with proof too."""
SAFE_INTERNAL = frozenset({"/mqds.server.raft.v1.Raft/LinkAddress", "/mqds.server.raft.v1.Raft/FetchSnapshot"})
"""Internal methods whose hostile requests change nothing: sent with the cluster secret too."""
DESTRUCTIVE = frozenset(
    path
    for path, entry in METHODS.items()
    if (entry.role is Role.ADMIN and path not in READ_ONLY_ADMIN)
    or (entry.role is Role.NODE and path not in SAFE_INTERNAL)
)
"""Never sent with proof: an admin call that changes the cluster, an internal call that changes Raft state. Taken
from the node's table, so a new admin method is never sent with proof by mistake (DeleteMessages, SetRetention and
ImportShard, added after a hand-kept list was written, once deleted what a test then looked for)."""
RAW_FRAMES = frozenset({"/mqds.server.raft.v1.Raft/Stream"})
"""Raft frames: fuzzed as bytes by ``test_fuzz.py``, not generated here."""


def methods() -> list[tuple[str, pbd.MethodDescriptor]]:
    """Every method the node serves and this generator sends requests to, by path."""
    return [
        (path, method)
        for service in SERVED
        for method in service.methods
        if (path := f"/{service.full_name}/{method.name}") not in RAW_FRAMES and METHODS[path].role is not Role.NOBODY
    ]


_TOPIC_LIKE = (
    "",
    "#",
    "+",
    "/",
    "$",
    "$SYS/#",
    "a/#/b",
    "a/+b",
    "\x00",
    "a\x00b",
    "x" * 70_000,
    "/".join(["d"] * 1_500),
    "/".join(["+"] * 1_200),
    "/".join(["+"] * 1_200) + "/#",
    "$" + "/x" * 1_000,
    "\ud7ff/\ue000",
)
_ALPHABET = "ab/+#$\x00 é"
_INTS = (0, 1, -1, 2, 7, 2**31 - 1, -(2**31), 2**32 - 1, 2**63 - 1, -(2**63), 2**64 - 1)
_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31),
    F.TYPE_SINT32: (-(2**31), 2**31),
    F.TYPE_SFIXED32: (-(2**31), 2**31),
    F.TYPE_INT64: (-(2**63), 2**63),
    F.TYPE_SINT64: (-(2**63), 2**63),
    F.TYPE_SFIXED64: (-(2**63), 2**63),
    F.TYPE_UINT32: (0, 2**32),
    F.TYPE_FIXED32: (0, 2**32),
}
_MANY = (2_000, 50_000)
"""How many copies of one small value an amplifying repeated field holds (a request of a few hundred KB)."""


def _scalar(field: Any, rng: random.Random, depth: int) -> Any:
    t = field.type
    if t == F.TYPE_STRING:
        if rng.random() < 0.5:
            return rng.choice(_TOPIC_LIKE)
        return "".join(rng.choice(_ALPHABET) for _ in range(rng.randrange(41)))
    if t == F.TYPE_BYTES:
        return b"\xff" * 5000 if rng.random() < 0.2 else rng.randbytes(rng.randrange(65))
    if t == F.TYPE_BOOL:
        return rng.random() < 0.5
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return rng.choice((0.0, -1.0, 1e300, float("inf"), float("nan")))
    if t == F.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values] + [99, -5])
    low, high = _RANGES.get(t, (0, 2**64))
    return rng.choice([v for v in _INTS if low <= v < high])


def _small(field: Any, rng: random.Random) -> Any:
    if field.type == F.TYPE_STRING:
        return rng.choice(("a", "#", "+"))
    if field.type == F.TYPE_BYTES:
        return b"\x01"
    return _scalar(field, rng, 0)


def fill(message: PbMessage, rng: random.Random, depth: int = 0) -> PbMessage:
    """Set a random choice of ``message``'s fields to hostile values (a few levels of nested messages deep)."""
    if depth > 2:
        return message
    for field in message.DESCRIPTOR.fields:
        if rng.random() < 0.5:
            continue
        value = getattr(message, field.name)
        nested = field.message_type
        try:
            if nested is not None and nested.GetOptions().map_entry:
                key_field, value_field = nested.fields_by_name["key"], nested.fields_by_name["value"]
                count = rng.choice(_MANY) if rng.random() < 0.3 else rng.randrange(6)
                for i in range(count):
                    key = _scalar(key_field, rng, depth) if count < 6 else i
                    if value_field.message_type is not None:
                        fill(value[key], rng, depth + 1)
                    else:
                        value[key] = _scalar(value_field, rng, depth)
            elif nested is not None and field.is_repeated:
                for _ in range(rng.randrange(4 if depth else 31)):
                    fill(value.add(), rng, depth + 1)
            elif nested is not None:
                fill(value, rng, depth + 1)
            elif field.is_repeated:
                if rng.random() < 0.3:
                    value.extend([_small(field, rng)] * rng.choice(_MANY))
                else:
                    value.extend(_scalar(field, rng, depth) for _ in range(rng.randrange(6)))
            else:
                setattr(message, field.name, _scalar(field, rng, depth))
        except (ValueError, TypeError):
            pass  # a value this field cannot hold (a surrogate, a key of the wrong type): left as it is
    return message


def request(method: pbd.MethodDescriptor, rng: random.Random) -> bytes:
    """One hostile request of ``method``'s input type, serialised."""
    return fill(message_factory.GetMessageClass(method.input_type)(), rng).SerializeToString()


def requests(method: pbd.MethodDescriptor, rng: random.Random) -> list[bytes]:
    """What one call sends: one request, or one to four of a streaming method's."""
    count = rng.randrange(1, 5) if method.client_streaming else 1
    return [request(method, rng) for _ in range(count)]


def call(
    channel: grpc.Channel,
    path: str,
    method: pbd.MethodDescriptor,
    raws: Sequence[bytes],
    metadata: Sequence[tuple[str, str]] | None,
    timeout_s: float,
) -> grpc.StatusCode:
    """Send ``raws`` on a call of ``path`` (any shape), read every answer; the status it ended with.

    A stream the node keeps open after the requests (a Follow, a health watch)
    ends at the deadline: DEADLINE_EXCEEDED is its answer then.
    """
    md = tuple(metadata or ())

    def sent() -> Iterator[bytes]:
        yield from raws

    try:
        if method.client_streaming and method.server_streaming:
            for _ in channel.stream_stream(path)(sent(), timeout=timeout_s, metadata=md):
                pass
        elif method.client_streaming:
            channel.stream_unary(path)(sent(), timeout=timeout_s, metadata=md)
        elif method.server_streaming:
            for _ in channel.unary_stream(path)(raws[0], timeout=timeout_s, metadata=md):
                pass
        else:
            channel.unary_unary(path)(raws[0], timeout=timeout_s, metadata=md)
    except grpc.RpcError as err:
        code = err.code()
        return code if code is not None else grpc.StatusCode.UNKNOWN
    return grpc.StatusCode.OK
