"""The storage layer: RocksDB per shard, generations, learned streams, iterators.

It knows nothing of Raft or gRPC: it is fed deterministic changes (messages
with the time to stamp them, generation changes) and answers reads.
"""

from mqds.server.storage.iterators import IteratorDecodeError, IteratorState
from mqds.server.storage.shard import (
    Engine,
    EngineOptions,
    GenerationInfo,
    ReadResult,
    ShardStorage,
    StorePart,
    StreamRef,
    decode_message,
    message_wire,
)

__all__ = [
    "Engine",
    "EngineOptions",
    "GenerationInfo",
    "IteratorDecodeError",
    "IteratorState",
    "ReadResult",
    "ShardStorage",
    "StorePart",
    "StreamRef",
    "decode_message",
    "message_wire",
]
