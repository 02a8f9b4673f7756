"""Storing messages: one batch of messages as one RocksDB write batch.

A stored batch writes, in the current generation, a data key per message
(``D | stream | timestamp``) and an index key per varying level and value with
the posting list of the messages that have it; in the metadata family, the
trie edges and presence keys it created, an expiry index entry for each
message with a Message Expiry Interval (``expiry.py``) and the last timestamp.
Topics are routed to their stream and key prefixes through the trie, and the routes are
cached (``Routes``). The data and index keys are built and put by C code
(``_store_native.put_batch``) where it was built, else by its Python twin
(``put_batch_python``); both make the same calls. The caller
(``ShardStorage.store``) adds deduplication (``dedup.py``), writes the batch,
and calls ``undo`` if the write failed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rocksdict import WriteBatch

from mqds.server.native import native_or
from mqds.server.storage import keys
from mqds.server.storage.generations import Generation
from mqds.server.storage.trie import TopicTrie
from mqds.server.wire import expiry_intervals
from mqds.v1 import storage_pb2 as pb

ROUTE_CACHE_LIMIT = 100_000
"""How many topic -> key-prefix routes a shard caches before starting over."""

Route = tuple[bytes, tuple[bytes, ...], int]
"""A topic's data key prefix, its index key prefixes (one per indexed varying level) and its stream."""


class Routes:
    """The routes of topics through a shard's trie, cached; learning new topics adds edges to the trie."""

    def __init__(self, trie: TopicTrie) -> None:
        self.trie = trie
        self.cache: dict[str, Route] = {}

    def learn(self, topic: str, new_edges: list[tuple[int, str, int]]) -> Route:
        """The route of ``topic``, adding the edges it needs to the trie (and to ``new_edges``)."""
        learned = self.trie.learn(topic.split("/"), new_edges)
        route = (
            keys.data_prefix(learned.stream),
            tuple(
                keys.index_prefix(learned.stream, i, value)
                for i, value in enumerate(learned.varying[: keys.MAX_INDEXED_LEVELS])
            ),
            learned.stream,
        )
        self.cache[topic] = route
        return route

    def clear(self) -> None:
        self.cache.clear()


@dataclass
class StoreBatch:
    """A write batch storing messages, and what it taught the in-memory state (undone if it is not written)."""

    batch: WriteBatch
    last_ts: int
    """The shard's last timestamp once the batch is written."""
    new_edges: list[tuple[int, str, int]]
    new_streams: list[int]


Put = Callable[[bytes, bytes, object], object]
"""A write batch's ``put(key, value, column family handle)``."""
PutBatch = Callable[[Put, object, list[str], list[bytes], int, dict[str, Route]], list[int]]


def put_batch_python(
    put: Put,
    handle: object,
    topics: list[str],
    values: list[bytes],
    first: int,
    routes: dict[str, Route],
) -> list[int]:
    """Put a batch's data and index keys; its streams, each once, in the order they first appear.

    Message ``i`` (``topics[i]``, stored as ``values[i]``) gets the data key
    of its topic's stream and timestamp ``first + i``. Each index key prefix
    of the messages' routes gets one key for the batch, stamped with its first
    message's timestamp, whose value lists the messages' positions in the
    batch (``keys.encode_postings``). Every topic must have its route in
    ``routes``. This is the reference the C version (``_store_native``) is
    tested against, call for call.
    """
    if len(topics) != len(values):
        raise ValueError(f"{len(topics)} topics but {len(values)} values")
    streams: dict[int, None] = {}
    postings: dict[bytes, list[int]] = {}
    for position, (topic, value) in enumerate(zip(topics, values, strict=True)):
        data_prefix, index_prefixes, stream = routes[topic]
        streams.setdefault(stream)
        put(data_prefix + (first + position).to_bytes(8, "big"), value, handle)
        for index_prefix in index_prefixes:
            postings.setdefault(index_prefix, []).append(position)
    for index_prefix, positions in postings.items():
        put(index_prefix + (first + positions[0]).to_bytes(8, "big"), keys.encode_postings(positions), handle)
    return list(streams)


_PUT_BATCH: PutBatch = native_or("mqds.server.storage._store_native", "put_batch", put_batch_python)
NATIVE = _PUT_BATCH is not put_batch_python
"""Whether stores put their keys in C; a node that does not logs a warning when it starts."""


def build(
    gen: Generation,
    messages: Sequence[pb.Message],
    values: Sequence[bytes],
    first: int,
    last_ts: int,
    routes: Routes,
    meta: object,
    batch: WriteBatch | None = None,
) -> StoreBatch:
    """The write batch storing ``messages`` (serialised as ``values``) from timestamp ``first`` in ``gen``.

    Message ``i`` gets timestamp ``first + i``. New topics are learned by the
    trie and new streams marked present in ``gen`` right away; ``undo``
    forgets them if the batch is not written. With ``batch``, the puts go
    into it (several stored batches in one write) and it is returned.
    """
    handle = gen.handle
    present = gen.present
    cache = routes.cache
    if len(cache) > ROUTE_CACHE_LIMIT:
        cache.clear()
    if batch is None:
        batch = WriteBatch(raw_mode=True)
    put = batch.put
    new_edges: list[tuple[int, str, int]] = []
    topics = [message.topic for message in messages]
    # New topics are learned in the order they first appear: the trie's
    # node numbers, and so the keys, must be the same on every replica.
    for topic in [topic for topic in topics if topic not in cache]:
        if topic not in cache:  # a repeat of a topic learned a moment ago is not learned again
            routes.learn(topic, new_edges)
    values = values if isinstance(values, list) else list(values)
    streams = _PUT_BATCH(put, handle, topics, values, first, cache)
    # The few messages with a Message Expiry Interval get an entry in the generation's expiry index (one C call
    # finds them), by which expiry steps remove them (``expiry.py``).
    for index, interval in expiry_intervals(values):
        ts = first + index
        stream = cache[topics[index]][2]
        put(keys.message_expiry_key(gen.number, ts + interval * 1_000_000, stream, ts), b"", meta)
    new_streams = [stream for stream in streams if stream not in present]
    present.update(new_streams)
    ts = first + len(topics)
    for parent, token, child in new_edges:
        put(keys.trie_edge_key(parent, token), keys.u32(child), meta)
    if new_edges:
        put(keys.META_NEXT_NODE, keys.u32(routes.trie.next_node), meta)
    for stream in new_streams:
        put(keys.presence_key(gen.number, stream), b"", meta)
    last = ts - 1 if messages else last_ts
    put(keys.META_LAST_TS, keys.u64(last), meta)
    return StoreBatch(batch, last, new_edges, new_streams)


def undo(stored: StoreBatch, gen: Generation, routes: Routes) -> None:
    """Forget what building ``stored`` taught the trie and ``gen``: none of it is on disk.

    Without this, a later store would route through edges that were never
    persisted.
    """
    gen.present.difference_update(stored.new_streams)
    routes.trie.forget(stored.new_edges)
    routes.clear()
