"""Shared catch-up reads: push subscribers behind the feed, at nearby positions, share one disk read.

A subscriber whose position is older than what the replica's feed holds (it
started in the past, or fell behind without credit) reads from RocksDB. Many
do so at once when a broker's sessions come back together, most of them at
about the same place on the same filter. Each disk read is kept here as a
*segment*: every message of the filter with a timestamp in ``(lo, hi]``, in
order, each already encoded as an answer carries it. A subscriber at
position ``p`` with ``lo <= p < hi`` is served from the segment (the
messages after ``p``) without reading the disk; only one that no segment
covers reads, and what it reads becomes a segment for the others. So N
subscribers catching up together cost about one scan, and a convoy of them
moves through the backlog one segment at a time.

Segments hold a committed past that never changes (``hi`` is at most the
replica's last timestamp when it was read), so they need no invalidation;
they are dropped oldest-used first to stay within ``max_bytes``, and all of
them when the replica drops a generation or its storage is replaced (a
snapshot installed): a segment read before a drop would hand a subscriber a
position inside what the drop removed. Reads of
one filter that no segment covers wait for each other (one of a few locks
chosen by the filter), so a storm of them reads once; other filters go on.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Callable

from mqds.server.cluster.expiring import Expiring, encode_kept

Load = Callable[[int, int], tuple[list[tuple[int, bytes]], int]]
"""``load(after_us, count)``: up to ``count`` messages of the filter after ``after_us`` read from disk, in
timestamp order, and the position reached (every matching message up to it is in the list)."""

_LOAD_LOCKS = 64
"""Locks that serialise the disk reads of one filter (a filter hashes to one)."""
_SEGMENT_OVERHEAD = 256


class Segment:
    """Every message of ``topic_filter`` with a timestamp in ``(lo, hi]``: timestamps and encoded answer parts."""

    __slots__ = ("expiring", "hi", "lo", "pieces", "size", "stamps", "topic_filter")

    def __init__(
        self,
        topic_filter: str,
        lo: int,
        hi: int,
        stamps: list[int],
        pieces: list[bytes],
        expiring: Expiring | None = None,
    ) -> None:
        self.topic_filter = topic_filter
        self.lo = lo
        self.hi = hi
        self.stamps = stamps
        self.pieces = pieces
        self.expiring = expiring
        """Its messages with a Message Expiry Interval (``expiring.py``), made fresh when served; None: none."""
        self.size = sum(len(p) for p in pieces) + _SEGMENT_OVERHEAD

    def covers(self, position: int) -> bool:
        return self.lo <= position < self.hi


class CatchUp:
    """A replica's recent catch-up reads, per topic filter, shared by the subscribers that need them."""

    def __init__(self, shard: int, max_bytes: int, answer_tag: bytes) -> None:
        self.shard = shard
        self.max_bytes = max_bytes
        self._tag = answer_tag
        self._lock = threading.Lock()
        self._segments: OrderedDict[int, Segment] = OrderedDict()
        """By id, least recently used first."""
        self._bytes = 0
        self._epoch = 0
        """Changes at each reset: a read that began before one is not kept."""
        self._load_locks = [threading.Lock() for _ in range(_LOAD_LOCKS)]
        # For the metrics: plain ints, written under the lock.
        self.read_from_disk = 0
        """Messages the catch-up reads took from RocksDB."""
        self.served = 0
        """Messages served from segments (each counted once per subscriber served)."""

    def read(
        self,
        topic_filter: str,
        after_us: int,
        limit: int,
        max_bytes: int | None,
        load: Load,
        chunk: int,
        *,
        now_us: int = 0,
    ) -> tuple[list[bytes], int]:
        """The encoded messages of ``topic_filter`` after ``after_us`` (at most ``limit`` and, past the first,
        ``max_bytes``), and the position they reach: from a segment, or from one read of at least ``chunk``
        messages (``load``) that becomes a segment. Messages whose Message Expiry Interval ended by ``now_us``
        are left out (the position passes them); the others carry what is left of theirs (0: as stored)."""
        segment = self._find(topic_filter, after_us)
        if segment is None:
            with self._load_locks[hash(topic_filter) % _LOAD_LOCKS]:
                segment = self._find(topic_filter, after_us)  # another subscriber may just have read it
                if segment is None:
                    segment = self._load(topic_filter, after_us, max(limit, chunk), load)
                    if segment is None:
                        return [], after_us
        return self._serve(segment, after_us, limit, max_bytes, now_us)

    def reset(self) -> None:
        """Forget every segment, and what reads under way bring: the replica's storage was replaced, or a
        generation dropped (a segment read before the drop would move a subscriber to a position that
        the drop made a gap)."""
        with self._lock:
            self._segments.clear()
            self._bytes = 0
            self._epoch += 1

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def _find(self, topic_filter: str, position: int) -> Segment | None:
        with self._lock:
            for key, segment in self._segments.items():
                if segment.topic_filter == topic_filter and segment.covers(position):
                    self._segments.move_to_end(key)
                    return segment
        return None

    def _load(self, topic_filter: str, after_us: int, count: int, load: Load) -> Segment | None:
        epoch = self._epoch
        entries, reached = load(after_us, count)
        if reached <= after_us:
            return None
        pieces, expiring = encode_kept(self._tag, entries, self.shard)
        segment = Segment(topic_filter, after_us, reached, [ts for ts, _ in entries], pieces, expiring)
        with self._lock:
            self.read_from_disk += len(entries)
            if segment.size <= self.max_bytes and epoch == self._epoch:
                self._segments[id(segment)] = segment
                self._bytes += segment.size
                while self._bytes > self.max_bytes:
                    _, oldest = self._segments.popitem(last=False)
                    self._bytes -= oldest.size
        return segment

    def _serve(
        self, segment: Segment, after_us: int, limit: int, max_bytes: int | None, now_us: int
    ) -> tuple[list[bytes], int]:
        first = bisect.bisect_right(segment.stamps, after_us)
        end = min(len(segment.stamps), first + limit)
        if max_bytes is not None:
            size = 0
            for i in range(first, end):
                size += len(segment.pieces[i])
                if size > max_bytes and i > first:
                    end = i
                    break
        pieces = segment.pieces[first:end]
        expiring = segment.expiring
        if expiring is not None and now_us >= expiring.exact_until:
            pieces = expiring.fresh(pieces, first, now_us)
        # All of the segment after the position: the subscriber has everything up to its end.
        reached = segment.hi if end == len(segment.stamps) else segment.stamps[end - 1]
        with self._lock:
            self.served += len(pieces)
        return pieces, reached
