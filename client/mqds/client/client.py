"""The synchronous mqds client."""

from __future__ import annotations

import heapq
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Iterator as AbcIterator
from typing import Any, TypeVar

import grpc

from mqds.client.model import Generation, Iterator, Message, NextResult, Rank, Stream
from mqds.protocol import errors
from mqds.v1 import storage_pb2 as pb
from mqds.v1 import storage_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """``"a:1,b:2"`` or ``["a:1", "b:2"]`` -> ``["a:1", "b:2"]``; rejects empty and port-less entries."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed = [item.strip() for item in items if item and item.strip()]
    if not parsed:
        raise ValueError("no endpoints given: pass 'host:port' addresses of mqds nodes")
    for item in parsed:
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"endpoint {item!r} is not host:port")
    return parsed


class Client:
    """Stores and replays MQTT messages on an mqds node.

    ``endpoints`` is a list of ``"host:port"`` strings or one comma-separated
    string. Reads that fail because a node is unreachable are tried on the
    next endpoint; writes are not retried (a write whose reply was lost may
    have been stored). Failures raise :class:`mqds.client.errors.MqdsError`
    subclasses. The client is thread-safe; close it, or use it as a context
    manager, to release its connections.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout_s: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout_s = timeout_s
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self._lock = threading.Lock()
        self._active = 0
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, pb_grpc.StorageStub] = {}

    # -- plumbing ------------------------------------------------------------

    def _stub(self, endpoint: str) -> pb_grpc.StorageStub:
        with self._lock:
            stub = self._stubs.get(endpoint)
            if stub is None:
                channel = grpc.insecure_channel(endpoint, options=self._options)
                self._channels[endpoint] = channel
                stub = self._stubs[endpoint] = pb_grpc.StorageStub(channel)
            return stub

    def _call(self, method: str, request: Any, *, retry_elsewhere: bool = True) -> Any:
        start = self._active
        attempts = len(self.endpoints) if retry_elsewhere else 1
        last: errors.MqdsError | None = None
        for step in range(attempts):
            index = (start + step) % len(self.endpoints)
            endpoint = self.endpoints[index]
            try:
                response = getattr(self._stub(endpoint), method)(request, timeout=self.timeout_s)
            except grpc.RpcError as rpc_err:
                err = errors.from_rpc_error(rpc_err)
                if err.reason is not errors.Reason.UNAVAILABLE or step == attempts - 1:
                    raise err from None
                log.info("%s unreachable (%s); trying the next endpoint", endpoint, err.message)
                last = err
                continue
            self._active = index
            return response
        assert last is not None
        raise last

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writes --------------------------------------------------------------

    def store_batch(self, messages: Iterable[Message], sync: bool = True) -> list[Message]:
        """Store messages; return them with ``timestamp_us`` and ``shard`` set.

        With ``sync=True`` the call returns once the batch is on disk.
        """
        batch = list(messages)
        request = pb.StoreBatchRequest(messages=[m.to_pb() for m in batch], sync=sync)
        response = self._call("StoreBatch", request, retry_elsewhere=False)
        return [
            Message(m.topic, m.payload, m.sender, m.qos, m.retain, m.properties, p.timestamp_us, p.shard)
            for m, p in zip(batch, response.positions, strict=True)
        ]

    # -- reads ---------------------------------------------------------------

    def get_streams(self, topic_filter: str, start_time_us: int = 0) -> list[tuple[Rank, Stream]]:
        """The streams that may hold messages matching ``topic_filter`` at or after ``start_time_us``."""
        response = self._call(
            "GetStreams", pb.GetStreamsRequest(topic_filter=topic_filter, start_time_us=start_time_us)
        )
        return [(Rank(s.rank.shard, s.rank.generation), Stream.from_pb(s.stream)) for s in response.streams]

    def make_iterator(self, stream: Stream, topic_filter: str, start_time_us: int = 0) -> Iterator:
        """An iterator over ``stream``'s messages matching ``topic_filter`` from ``start_time_us``."""
        request = pb.MakeIteratorRequest(stream=stream.to_pb(), topic_filter=topic_filter, start_time_us=start_time_us)
        return Iterator.from_pb(self._call("MakeIterator", request).iterator)

    def next(self, iterator: Iterator, batch_size: int = 100) -> NextResult:
        """Up to ``batch_size`` messages after ``iterator``, and the advanced iterator."""
        response = self._call("Next", pb.NextRequest(iterator=iterator.to_pb(), batch_size=batch_size))
        from_pb = Message.from_pb
        return NextResult(
            [from_pb(m) for m in response.messages], Iterator.from_pb(response.iterator), response.end_of_stream
        )

    def _stream_messages(
        self, stream: Stream, topic_filter: str, start_time_us: int, batch_size: int
    ) -> AbcIterator[Message]:
        iterator = self.make_iterator(stream, topic_filter, start_time_us)
        while True:
            result = self.next(iterator, batch_size)
            yield from result.messages
            iterator = result.iterator
            if result.end_of_stream or not result.messages:
                return

    def replay(self, topic_filter: str, start_time_us: int = 0, batch_size: int = 1000) -> AbcIterator[Message]:
        """Every stored message matching ``topic_filter``, in rank order.

        Shards come one after the other; within a shard, generations in order,
        and the streams of a generation merged by timestamp, so each sender's
        messages come back in the order they were stored. Messages stored
        while the replay runs may or may not be included.
        """
        by_rank: dict[Rank, list[Stream]] = {}
        for rank, stream in self.get_streams(topic_filter, start_time_us):
            by_rank.setdefault(rank, []).append(stream)
        key: Callable[[Message], int] = _timestamp
        for rank in sorted(by_rank):
            sources = [
                self._stream_messages(stream, topic_filter, start_time_us, batch_size) for stream in by_rank[rank]
            ]
            yield from heapq.merge(*sources, key=key) if len(sources) > 1 else sources[0]

    # -- generations ---------------------------------------------------------

    def add_generation(self, shard: int | None = None) -> list[Generation]:
        """Start a new generation in ``shard``, or in every shard; return the new ones."""
        request = pb.AddGenerationRequest(shard=shard or 0, all_shards=shard is None)
        return [Generation.from_pb(g) for g in self._call("AddGeneration", request, retry_elsewhere=False).generations]

    def list_generations(self, shard: int | None = None) -> list[Generation]:
        """The generations of ``shard``, or of every shard, in order."""
        request = pb.ListGenerationsRequest(shard=shard or 0, all_shards=shard is None)
        return [Generation.from_pb(g) for g in self._call("ListGenerations", request).generations]

    def drop_generation(self, shard: int, generation: int) -> Generation:
        """Drop a closed generation of a shard and free its disk; return it as it was."""
        request = pb.DropGenerationRequest(shard=shard, generation=generation)
        return Generation.from_pb(self._call("DropGeneration", request, retry_elsewhere=False).dropped)


def _timestamp(message: Message) -> int:
    return message.timestamp_us or 0
