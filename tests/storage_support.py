"""What the storage tests share: messages to store, reading a shard back, and writes made to fail."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from rocksdict import Rdict

from mqds.protocol.errors import (
    MqdsError,
    Reason,
)
from mqds.protocol.topics import matches, validate_filter
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.cluster.vnode import VnodeReplica
from mqds.server.storage import Engine
from mqds.server.storage.iterators import IteratorState
from mqds.server.storage.shard import (
    ShardStorage,
    StreamRef,
    decode_message,
)
from mqds.v1 import storage_pb2 as pb


def msg(
    topic: str,
    payload: bytes = b"",
    sender: str = "client-1",
    qos: int = 0,
    retain: bool = False,
    properties: Sequence[tuple[str, str]] = (),
) -> pb.Message:
    return pb.Message(
        topic=topic,
        payload=payload,
        sender=sender,
        qos=qos,
        retain=retain,
        properties=[pb.UserProperty(key=k, value=v) for k, v in properties],
    )


def stamped(message: pb.Message, ts: int, shard: int) -> pb.Message:
    out = pb.Message()
    out.CopyFrom(message)
    out.timestamp_us = ts
    out.shard = shard
    return out


def drain(
    storage: ShardStorage, state: IteratorState, batch_size: int, *, reencode: bool = False
) -> tuple[list[tuple[int, bytes]], IteratorState, bool]:
    """Read an iterator until an empty batch or end_of_stream; optionally round-trip the state each time."""
    entries: list[tuple[int, bytes]] = []
    for _ in range(100_000):
        result = storage.next(state, batch_size)
        assert len(result.entries) <= batch_size
        entries += result.entries
        state = IteratorState.decode(result.state.encode()) if reencode else result.state
        if result.end_of_stream or not result.entries:
            return entries, state, result.end_of_stream
    raise AssertionError("iterator never ended")


@dataclass(frozen=True)
class Read:
    ref: StreamRef
    ts: int
    message: pb.Message


def replay(storage: ShardStorage, topic_filter: str, start_time_us: int = 0, batch_size: int = 5) -> list[Read]:
    """Read every stream get_streams returns for the filter, checking the per-stream invariants."""
    out: list[Read] = []
    refs = storage.get_streams(validate_filter(topic_filter), start_time_us)
    assert refs == sorted(refs, key=lambda r: (r.generation, r.stream)), "streams not by generation, then id"
    assert len({(r.generation, r.stream) for r in refs}) == len(refs)
    current = storage.current_generation
    for ref in refs:
        assert ref.pattern == storage.trie.pattern(ref.stream)
        state = storage.make_iterator(ref.generation, ref.stream, topic_filter, start_time_us)
        assert state == IteratorState(storage.shard, ref.generation, ref.stream, topic_filter, start_time_us)
        entries, state, end = drain(storage, state, batch_size)
        # end_of_stream only in a closed generation, and a closed one does end.
        assert end is (ref.generation != current), (ref, end)
        if ref.generation == current:
            again = storage.next(state, batch_size)
            assert again.entries == [] and again.end_of_stream is False
        stamps = [ts for ts, _ in entries]
        assert stamps == sorted(set(stamps)), f"stream {ref} out of timestamp order"
        for ts, stored in entries:
            message = decode_message(stored, ts, storage.shard)
            assert matches(ref.pattern, message.topic), f"{message.topic!r} is in stream {ref}"
            out.append(Read(ref, ts, message))
    return out


@contextmanager
def failing_writes(storage: ShardStorage) -> Iterator[None]:
    """Make the shard's RocksDB writes fail (as with a full disk) inside the block."""

    class Failing:
        def __init__(self, db: Rdict) -> None:
            self._db = db

        def write(self, *args: object, **kwargs: object) -> None:
            raise OSError("IO error: No space left on device")

        def __getattr__(self, name: str) -> object:
            return getattr(self._db, name)

    real = storage._db
    storage._db = Failing(real)
    try:
        yield
    finally:
        storage._db = real


def store_failing(storage: ShardStorage, messages: list[pb.Message], now_us: int) -> Reason | None:
    """Store while writes fail; the reason of the error, or None if it did not fail.

    The exception is not kept: its traceback would hold column family handles, and RocksDB
    stays locked until they are released.
    """
    with failing_writes(storage):
        try:
            storage.store(messages, now_us)
        except MqdsError as err:
            return err.reason
    return None


def dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


# Topic levels of random messages: wildcard-worthy repeats, an empty level, a $ first level.
TOPIC_LEVELS = ["a", "b", "c", "", "$SYS", "x1", "x2", "x3", "x4"]


def random_topic(rng: random.Random) -> str:
    while True:
        depth = rng.randint(1, 3)
        topic = "/".join(rng.choice(TOPIC_LEVELS) for _ in range(depth))
        if topic:
            return topic


def random_message(rng: random.Random) -> pb.Message:
    props = [(rng.choice(["k", "k", "unit", "é"]), rng.choice(["v", "", "°C"])) for _ in range(rng.randint(0, 3))]
    return msg(
        random_topic(rng),
        payload=rng.randbytes(rng.randint(0, 40)),
        sender=f"client-{rng.randint(0, 4)}",
        qos=rng.randint(0, 2),
        retain=rng.random() < 0.3,
        properties=props,
    )


@contextmanager
def vnode_replica(directory: str) -> Iterator[VnodeReplica]:
    """A vnode replica of shard 0 in ``directory`` with its first generation, as a leader's first entry makes it."""
    replica = VnodeReplica(
        0,
        directory,
        Engine(),
        node_id="n1",
        fetch_snapshot=lambda *_: 0,
        lts_threshold_top=100,
        lts_threshold=10,
    )
    replica.apply(cpb.VnodeCommand(add_generation=cpb.AddGeneration(now_us=1_000, if_current=0)).SerializeToString(), 1)
    try:
        yield replica
    finally:
        replica.close()
