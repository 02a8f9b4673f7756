"""What each client call sends and how its answer becomes model objects; no I/O.

The synchronous client and the asyncio one (:mod:`mqds.client.aio`) build
their requests and read their responses here, so both mean the same thing
by every method; each only runs the requests (with the routing rules of
:mod:`mqds.client.routing`) in its own way.

A :class:`ShardCall` goes to one shard's leader (or any replica with
``stale_ok``); a :class:`FanoutCall` goes once to each node leading some of
its shards, and the parts are merged. :class:`StoreBatch` is one
``store_batch``: the batch split by shard, each leader's request, and the
result or the (partial) failure.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from mqds.client.model import Generation, Iterator, Message, NextResult, Rank, Stream
from mqds.client.routing import ShardFailures
from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, PartialBatchError
from mqds.protocol.sharding import shard_of
from mqds.v1 import storage_pb2 as pb

T = TypeVar("T")


@dataclass(frozen=True)
class ShardCall(Generic[T]):
    """A request to one shard's leader (any replica with ``stale_ok``) and how to read its answer."""

    method: str
    shard: int
    request: Any
    parse: Callable[[Any], T]
    stale_ok: bool = False


@dataclass(frozen=True)
class FanoutCall(Generic[T]):
    """A request about several shards, sent once per node leading some of them; the parts merged in order."""

    method: str
    shards: Sequence[int] | None
    """The shards to ask; None = every shard of the cluster."""
    request: Callable[[list[int]], Any]
    parse: Callable[[Any], list[T]]
    sort_key: Callable[[T], Any]
    stale_ok: bool = False

    def shards_of(self, n_shards: int) -> list[int]:
        return list(range(n_shards)) if self.shards is None else list(self.shards)

    def merge(self, parts: Iterable[list[T]]) -> list[T]:
        return sorted(itertools.chain.from_iterable(parts), key=self.sort_key)


def _ranked(response: pb.GetStreamsResponse) -> list[tuple[Rank, Stream]]:
    return [(Rank(s.rank.shard, s.rank.generation), Stream.from_pb(s.stream)) for s in response.streams]


def get_streams(topic_filter: str, start_time_us: int, stale_ok: bool) -> FanoutCall[tuple[Rank, Stream]]:
    return FanoutCall(
        "GetStreams",
        None,
        lambda shards: pb.GetStreamsRequest(
            topic_filter=topic_filter, start_time_us=start_time_us, shards=shards, stale_ok=stale_ok
        ),
        _ranked,
        lambda item: (item[0], item[1].id),
        stale_ok,
    )


def make_iterator(stream: Stream, topic_filter: str, start_time_us: int, stale_ok: bool) -> ShardCall[Iterator]:
    request = pb.MakeIteratorRequest(
        stream=stream.to_pb(), topic_filter=topic_filter, start_time_us=start_time_us, stale_ok=stale_ok
    )
    return ShardCall("MakeIterator", stream.shard, request, lambda r: Iterator.from_pb(r.iterator), stale_ok)


def _next_result(response: pb.NextResponse) -> NextResult:
    from_pb = Message.from_pb
    return NextResult(
        [from_pb(m) for m in response.messages], Iterator.from_pb(response.iterator), response.end_of_stream
    )


def next_batch(iterator: Iterator, batch_size: int, stale_ok: bool) -> ShardCall[NextResult]:
    request = pb.NextRequest(iterator=iterator.to_pb(), batch_size=batch_size, stale_ok=stale_ok)
    return ShardCall("Next", iterator.shard, request, _next_result, stale_ok)


def _generations(response: Any) -> list[Generation]:
    return [Generation.from_pb(g) for g in response.generations]


def add_generation(shard: int | None) -> FanoutCall[Generation]:
    return FanoutCall(
        "AddGeneration",
        None if shard is None else [shard],
        lambda shards: pb.AddGenerationRequest(shards=shards),
        _generations,
        lambda g: g.shard,
    )


def list_generations(shard: int | None, stale_ok: bool) -> FanoutCall[Generation]:
    return FanoutCall(
        "ListGenerations",
        None if shard is None else [shard],
        lambda shards: pb.ListGenerationsRequest(shards=shards, stale_ok=stale_ok),
        _generations,
        lambda g: (g.shard, g.generation),
        stale_ok,
    )


def drop_generation(shard: int, generation: int) -> ShardCall[Generation]:
    request = pb.DropGenerationRequest(shard=shard, generation=generation)
    return ShardCall("DropGeneration", shard, request, lambda r: Generation.from_pb(r.dropped))


def replay_order(found: Iterable[tuple[Rank, Stream]]) -> list[list[Stream]]:
    """The streams to replay, grouped by rank in rank order (a group's streams are merged by timestamp)."""
    by_rank: dict[Rank, list[Stream]] = {}
    for rank, stream in found:
        by_rank.setdefault(rank, []).append(stream)
    return [by_rank[rank] for rank in sorted(by_rank)]


def stream_exhausted(result: NextResult) -> bool:
    """Whether a replay stops reading a stream after this batch (closed and read, or nothing more yet)."""
    return result.end_of_stream or not result.messages


def timestamp(message: Message) -> int:
    return message.timestamp_us or 0


def check_sequence(sequence: int) -> int:
    if sequence < 1:
        raise ValueError(f"sequence must be 1 or more, got {sequence}")
    return sequence


class StoreBatch:
    """One ``store_batch`` call: the batch split by shard, each leader's request, and the outcome.

    ``request(shards)`` builds the request for the shards one node leads
    (every request of the call, retries included, carries the same producer
    id and sequence, so a shard stores its part once); ``record`` takes its
    answer (raising :class:`ShardFailures` for the shards it says failed);
    ``outcome`` turns what was recorded and the shards' final errors into
    the stored messages, or the error to raise.
    """

    def __init__(self, messages: Iterable[Message], n_shards: int, producer_id: str, sequence: int, sync: bool) -> None:
        self.batch = list(messages)
        self.n_shards = n_shards
        self.producer_id = producer_id
        self.sequence = check_sequence(sequence)
        self.sync = sync
        self.by_shard: dict[int, list[int]] = {}
        for index, message in enumerate(self.batch):
            self.by_shard.setdefault(shard_of(message.sender, n_shards), []).append(index)
        self._encoded = [m.to_pb() for m in self.batch]
        self.positions: dict[int, tuple[int, int]] = {}

    @property
    def shards(self) -> list[int]:
        return sorted(self.by_shard)

    def request(self, shards: Sequence[int]) -> tuple[list[int], pb.StoreBatchRequest]:
        """The request for ``shards``' messages, and the batch indexes of its messages in order."""
        indexes = [i for shard in shards for i in self.by_shard[shard]]
        request = pb.StoreBatchRequest(
            messages=[self._encoded[i] for i in indexes],
            sync=self.sync,
            producer_id=self.producer_id,
            sequence=self.sequence,
        )
        return indexes, request

    def record(self, indexes: Sequence[int], response: pb.StoreBatchResponse) -> None:
        for index, position in zip(indexes, response.positions, strict=True):
            if position.timestamp_us:
                self.positions[index] = (position.timestamp_us, position.shard)
        if response.failures:
            raise ShardFailures({f.shard: errors.from_failure(f) for f in response.failures})

    def outcome(self, failures: dict[int, MqdsError]) -> list[Message]:
        """The stored messages (timestamp and shard set); raises when some or all were not stored."""
        stored: list[Message] = []
        failed: list[tuple[Message, MqdsError]] = []
        for index, m in enumerate(self.batch):
            if index in self.positions:
                ts, shard = self.positions[index]
                stored.append(Message(m.topic, m.payload, m.sender, m.qos, m.retain, m.properties, ts, shard))
            else:
                shard = shard_of(m.sender, self.n_shards)
                failed.append(
                    (Message(m.topic, m.payload, m.sender, m.qos, m.retain, m.properties, None, shard), failures[shard])
                )
        if not failed:
            return stored
        if not stored:
            err = failed[0][1]
            err.metadata["sequence"] = str(self.sequence)
            raise err
        raise PartialBatchError(stored, failed, self.sequence)
