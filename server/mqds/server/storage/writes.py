"""Storing messages: one batch of messages as one RocksDB write batch.

A stored batch writes, in the current generation, a data key per message
(``D | stream | timestamp``) and an index key per varying level and value with
the posting list of the messages that have it; in the metadata family, the
trie edges and presence keys it created and the last timestamp. Topics are
routed to their stream and key prefixes through the trie, and the routes are
cached (``Routes``). The caller (``ShardStorage.store``) adds deduplication
(``dedup.py``), writes the batch, and calls ``undo`` if the write failed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from rocksdict import WriteBatch

from mqds.server.storage import keys
from mqds.server.storage.generations import Generation
from mqds.server.storage.trie import TopicTrie
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
    new_streams: list[int] = []
    # Per topic: its data key prefix, the positions of its messages in
    # this batch, and its route (index key prefixes, stream).
    groups: dict[str, tuple[bytes, list[int], Route]] = {}
    position = 0
    for message, value in zip(messages, values, strict=True):
        topic = message.topic
        group = groups.get(topic)
        if group is None:
            route = cache.get(topic)
            if route is None:
                route = routes.learn(topic, new_edges)
            group = groups[topic] = (route[0], [], route)
        put(group[0] + (first + position).to_bytes(8, "big"), value, handle)
        group[1].append(position)
        position += 1
    ts = first + position
    # One index key per (level, value) for the whole batch, listing its messages.
    postings: dict[bytes, list[list[int]]] = {}
    for _, positions, (_, iprefixes, stream) in groups.values():
        for iprefix in iprefixes:
            postings.setdefault(iprefix, []).append(positions)
        if stream not in present:
            present.add(stream)
            new_streams.append(stream)
    for iprefix, lists in postings.items():
        merged = lists[0] if len(lists) == 1 else sorted(itertools.chain.from_iterable(lists))
        put(iprefix + (first + merged[0]).to_bytes(8, "big"), keys.encode_postings(merged), handle)
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
