"""A replica's feed of what it just stored: push subscriptions read new messages here, not from RocksDB.

When a vnode replica applies a store, the batch (its first timestamp, the
parsed messages and their stored bytes) is appended to the shard's feed, a
ring bounded in bytes. A subscription whose position is at or after what the
ring covers takes its next messages from the ring: every subscriber of the
shard reads the same batches, and the messages matching a topic filter are
found once per batch and filter however many subscribers share it. One whose
position is older (it started in the past, or fell behind while it had no
credit and the ring moved on) reads from disk until it catches up; so a slow
subscriber costs the node no memory of its own.

The ring is kept only while someone listens: with no subscriber the apply
path takes the feed's lock, sees it inactive and returns.

Invariant: while active, the ring holds every message the shard stored after
``covers_after`` (timestamps strictly increase, and each store is appended
after it is written, under the feed's lock, which ``activate`` also takes to
read the shard's last timestamp).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from mqds.protocol.topics import matches_levels
from mqds.server.cluster.expiring import Expiring, encode_kept
from mqds.server.wire import FOLLOW_RESPONSE_MESSAGES_TAG

_CACHED_FILTERS = 64
"""Filters whose matches a batch remembers; past that they are matched again on each read."""


Matches = tuple[list[int], list[bytes], int, "Expiring | None"]
"""What a batch holds for one filter (``FeedPart.matching``)."""


class FeedPart:
    """One applied store: messages ``first``, ``first + 1``, ... as parsed and as stored."""

    __slots__ = ("_matches", "_topics", "encoded", "first", "last", "messages", "size")

    def __init__(self, first: int, messages: Sequence[Any], encoded: Sequence[bytes]) -> None:
        self.first = first
        self.last = first + len(encoded) - 1
        self.messages = messages
        self.encoded = encoded
        self.size = sum(len(e) for e in encoded) + 64
        self._topics: list[list[str]] | None = None
        self._matches: dict[str, Matches] = {}

    def matching(self, topic_filter: str, levels: list[str], shard: int) -> Matches:
        """The indexes of the messages whose topic matches the filter, each one as an answer carries it
        (a ``FollowResponse.messages`` entry, timestamp and shard set), their bytes, and those of them with a
        Message Expiry Interval (``expiring.py``; None: none has one): found and encoded once per filter, so
        every subscriber of the filter only joins bytes.
        """
        found = self._matches.get(topic_filter)
        if found is not None:
            return found
        if self._topics is None:
            self._topics = [m.topic.split("/") for m in self.messages]
        indexes = [i for i, topic in enumerate(self._topics) if matches_levels(levels, topic)]
        encoded = self.encoded
        pieces, expiring = encode_kept(
            FOLLOW_RESPONSE_MESSAGES_TAG, [(self.first + i, encoded[i]) for i in indexes], shard
        )
        found = indexes, pieces, sum(map(len, pieces)), expiring
        if len(self._matches) < _CACHED_FILTERS:
            self._matches[topic_filter] = found
        return found


class ShardFeed:
    """The recent stores of one shard replica, for its push subscribers."""

    def __init__(self, shard: int, max_bytes: int) -> None:
        self.shard = shard
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._parts: deque[FeedPart] = deque()
        self._bytes = 0
        self._covers_after: int | None = None
        self._listeners: set[Callable[[], None]] = set()
        self.read_from_ring = 0
        """Messages subscribers took from the ring (metrics)."""
        self.read_from_disk = 0
        """Messages subscribers of this replica read from disk instead (metrics; counted by the reader)."""

    # -- the apply side ---------------------------------------------------------

    def append(self, first: int, messages: Sequence[Any], encoded: Sequence[bytes]) -> None:
        """A store the replica just wrote (timestamps from ``first``); wakes the listeners."""
        with self._lock:
            if self._covers_after is None or not encoded:
                return
            part = FeedPart(first, messages, encoded)
            self._parts.append(part)
            self._bytes += part.size
            while self._bytes > self.max_bytes and len(self._parts) > 1:
                gone = self._parts.popleft()
                self._bytes -= gone.size
                self._covers_after = max(self._covers_after, gone.last)
            listeners = list(self._listeners)
        for wake in listeners:
            wake()

    def reset(self, last_ts: int) -> None:
        """The replica's data was replaced (a snapshot installed): the ring starts again after ``last_ts``."""
        with self._lock:
            self._parts.clear()
            self._bytes = 0
            if self._covers_after is not None:
                self._covers_after = last_ts
            listeners = list(self._listeners)
        for wake in listeners:
            wake()

    # -- the subscriber side ----------------------------------------------------

    def listen(self, wake: Callable[[], None], last_ts: Callable[[], int]) -> None:
        """Call ``wake`` after each store; the ring starts now (after ``last_ts()``) if it was off."""
        with self._lock:
            self._listeners.add(wake)
            if self._covers_after is None:
                self._covers_after = last_ts()

    def unlisten(self, wake: Callable[[], None]) -> None:
        """Stop waking ``wake``; with no listener left the ring is dropped."""
        with self._lock:
            self._listeners.discard(wake)
            if not self._listeners:
                self._parts.clear()
                self._bytes = 0
                self._covers_after = None

    @property
    def covers_after(self) -> int | None:
        return self._covers_after

    @property
    def head(self) -> int:
        """The timestamp of the last message the ring holds (``covers_after`` when it holds none; 0 when off)."""
        parts = self._parts
        return parts[-1].last if parts else self._covers_after or 0

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def read_after(
        self,
        position: int,
        topic_filter: str,
        levels: list[str],
        limit: int,
        max_bytes: int | None,
        *,
        now_us: int = 0,
    ) -> tuple[list[bytes], int] | None:
        """Up to ``limit`` messages matching the filter after ``position`` (and within ``max_bytes``, one at
        least), encoded as a ``FollowResponse`` carries them, and the position after them; None if the ring
        does not reach back to ``position`` (read from disk instead). A message whose Message Expiry Interval
        ended by ``now_us`` is passed over; one whose interval runs carries what is left of it (0: as stored).
        """
        with self._lock:
            covers = self._covers_after
            if covers is None or position < covers:
                return None
            # The parts after the position, found from the head (where a real-time reader is) back.
            parts = []
            for part in reversed(self._parts):
                if part.last <= position:
                    break
                parts.append(part)
        parts.reverse()
        found: list[bytes] = []
        size = 0
        reached = position
        for part in parts:
            indexes, pieces, part_bytes, expiring = part.matching(topic_filter, levels, self.shard)
            exact = expiring is None or now_us < expiring.exact_until
            if expiring is not None and not exact:  # messages with an interval stored a while ago: made fresh
                pieces = expiring.fresh(pieces, 0, now_us, keep_places=True)
            if (
                exact
                and part.first > position
                and len(found) + len(pieces) < limit
                and (max_bytes is None or size + part_bytes <= max_bytes or (not found and len(pieces) == 1))
            ):  # all of the part's matches, as they are (a reader at the head takes each batch so)
                found += pieces
                size += part_bytes
                reached = part.last
                continue
            for index, piece in zip(indexes, pieces, strict=True):
                ts = part.first + index
                if ts <= position:
                    continue
                if not piece:  # its expiry interval ended: passed over
                    reached = ts
                    continue
                if found and max_bytes is not None and size + len(piece) > max_bytes:
                    self.read_from_ring += len(found)
                    return found, reached
                found.append(piece)
                size += len(piece)
                reached = ts
                if len(found) >= limit:
                    self.read_from_ring += len(found)
                    return found, ts
            reached = max(reached, part.last)
        self.read_from_ring += len(found)
        return found, reached
