"""``Storage.Next`` answers with their size on the wire, for the clients' stubs (sync and asyncio).

Reading ahead holds answers in memory until the caller takes them, and
bounds them in bytes (``replay.read_ahead``); the size is known for free
where the answer is parsed, and costs a pass over every message after.
"""

from __future__ import annotations

from typing import Any

from mqds.v1 import storage_pb2 as pb

NEXT_METHOD = "/mqds.v1.Storage/Next"


def sized_next_answer(raw: bytes) -> tuple[pb.NextResponse, int]:
    """The deserializer of ``Storage.Next`` in the clients' stubs: the answer, and its size on the wire."""
    return pb.NextResponse.FromString(raw), len(raw)


def with_sized_next(stub: Any, channel: Any) -> Any:
    """``stub`` (a StorageStub, sync or asyncio) with ``Next`` answering ``sized_next_answer``'s pairs."""
    stub.Next = channel.unary_unary(
        NEXT_METHOD, request_serializer=pb.NextRequest.SerializeToString, response_deserializer=sized_next_answer
    )
    return stub
