"""Reading a shard: which streams may match a filter, and scanning one stream of one generation.

A read is a forward scan of one stream (``D | stream | timestamp``) from an
iterator's position, or, when the filter fixes a varying level the stream
indexes, a walk of that level's posting lists (``I`` keys) with a multi-get
of the data keys they name. Either way each candidate's topic is checked
against the filter (hashes may collide; only one level is looked up), and the
read stops at the batch size, the byte budget or the fence. The shard looks up
the generation and the stream's pattern under its lock and scans without it
(``ShardStorage.next``); ``ReadCost`` counts the keys a scan read.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from operator import itemgetter

from rocksdict import Rdict, ReadOptions

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.protocol.topics import matches_levels
from mqds.server.storage import keys
from mqds.server.storage.generations import Generation
from mqds.server.storage.iterators import IteratorState
from mqds.server.storage.trie import TopicTrie, filter_constraints
from mqds.v1 import storage_pb2 as pb

NO_FENCE = 1 << 64
""""No fence": above every timestamp."""
BUDGET_CHUNK = 32
"""Values an indexed read fetches at once when its answer has a byte budget."""


@dataclass(frozen=True)
class ReadResult:
    """What ``next`` read: (data key, stored message bytes) rows as the engine gave them, oldest first.

    The rows stay as read (no timestamp is decoded per message): an answer is
    encoded from them directly (``wire.encode_rows``); ``entries`` gives
    (timestamp, stored bytes) pairs for code that wants the numbers.
    """

    rows: list[tuple[bytes, bytes]]
    state: IteratorState
    end_of_stream: bool

    @property
    def entries(self) -> list[tuple[int, bytes]]:
        """(timestamp, stored message bytes) pairs, oldest first."""
        return [(keys.data_key_ts(key), value) for key, value in self.rows]


@dataclass(frozen=True)
class StreamRef:
    generation: int
    stream: int
    pattern: str


@dataclass
class ReadCost:
    """What a read cost: the keys it read (data keys and index keys)."""

    keys: int = 0


def find_streams(
    trie: TopicTrie, gens: Iterable[Generation], filter_levels: list[str], start_time_us: int
) -> list[StreamRef]:
    """Streams with data in ``gens`` (in order) that may match the filter and reach past ``start_time_us``."""
    candidates = trie.match(filter_levels)
    found = []
    for gen in gens:
        until = gen.record.until_us
        if until is not None and until <= start_time_us:
            continue
        for stream in sorted(stream for stream, _ in candidates if stream in gen.present):
            found.append(StreamRef(gen.number, stream, trie.pattern(stream)))
    return found


def check_filter(pattern: str, stream: int, topic_filter: str) -> None:
    """Refuse a filter that no topic of the stream (of ``pattern``) can match."""
    if filter_constraints(pattern, topic_filter.split("/")) is None:
        raise errors.error(
            Reason.INVALID_TOPIC_FILTER,
            f"topic filter {topic_filter!r} cannot match stream {stream} ({pattern!r}); "
            "use a stream that GetStreams returned for this filter",
        )


def read(
    cf: Rdict,
    state: IteratorState,
    pattern: str,
    closed: bool,
    fence_us: int | None,
    batch_size: int,
    max_bytes: int | None,
    cost: ReadCost,
) -> ReadResult:
    """Read up to ``batch_size`` messages of the stream (of ``pattern``) in ``cf`` after the iterator's position.

    ``closed``: the generation was closed before the read began, so reading
    everything ends the stream; so does a fence.
    """
    fenced = fence_us is not None
    limit = fence_us if fence_us is not None else NO_FENCE
    filter_levels = state.topic_filter.split("/")
    constraints = filter_constraints(pattern, filter_levels)
    if constraints is None:
        return ReadResult([], state, closed or fenced)
    indexed = {level: value for level, value in constraints.items() if level < keys.MAX_INDEXED_LEVELS}
    if indexed:
        rows, next_ts, exhausted = scan_index(cf, state, indexed, filter_levels, batch_size, limit, max_bytes, cost)
    else:
        # Constraints only on levels too deep to be indexed: scan the
        # stream and check each topic.
        check = filter_levels if constraints else None
        rows, next_ts, exhausted = scan_stream(cf, state, batch_size, check, limit, max_bytes, cost)
    return ReadResult(rows, state.advanced(next_ts), (closed or fenced) and exhausted)


def scan_stream(
    cf: Rdict,
    state: IteratorState,
    batch_size: int,
    check: list[str] | None,
    limit: int,
    max_bytes: int | None,
    cost: ReadCost,
) -> tuple[list[tuple[bytes, bytes]], int, bool]:
    """Scan the stream's data keys; keep those whose topic matches ``check`` (all if None).

    The engine's iterator is bounded to the stream's keys up to ``limit``.
    This is the replay's inner loop: without a topic check the rows are taken
    by C code a chunk at a time (``_take_rows``), no Python bytecode per row.
    """
    prefix = keys.data_prefix(state.stream)
    bounded = ReadOptions()
    bounded.set_iterate_upper_bound(keys.data_upper_bound(state.stream, limit))
    scan = cf.items(from_key=prefix + keys.u64(state.next_ts), read_opt=bounded)
    if check is None:
        return _take_rows(scan, state.next_ts, batch_size, max_bytes, cost)
    rows: list[tuple[bytes, bytes]] = []
    keep = rows.append
    exhausted = True
    scanned = 0
    last: tuple[bytes, bytes] | None = None
    budget = NO_FENCE if max_bytes is None else max_bytes
    parse = pb.Message.FromString
    for row in scan:
        size = len(row[1])
        if len(rows) == batch_size or (size > budget and rows):
            exhausted = False
            break
        scanned += 1
        last = row
        if matches_levels(check, parse(row[1]).topic.split("/")):
            keep(row)
            budget -= size
    cost.keys += scanned + (0 if exhausted else 1)
    next_ts = state.next_ts if last is None else keys.data_key_ts(last[0]) + 1
    return rows, next_ts, exhausted


_VALUE = itemgetter(1)
_CHUNK_ROWS = 64
"""Rows taken at once under a byte budget: what a read holds past its budget is at most this many rows."""


def _take_rows(
    scan: Iterator[tuple[bytes, bytes]], next_ts: int, batch_size: int, max_bytes: int | None, cost: ReadCost
) -> tuple[list[tuple[bytes, bytes]], int, bool]:
    """``scan_stream`` without a topic check: rows taken by C code, a chunk at a time.

    Up to ``batch_size`` rows (one more is read to learn whether the stream
    goes on); under a budget, the longest prefix whose sizes add up to at most
    ``max_bytes``, one row at least. The rows, the position after the last,
    and whether the scan reached the end.
    """
    rows: list[tuple[bytes, bytes]] = []
    budget = max_bytes
    exhausted = True
    while True:
        want = batch_size + 1 - len(rows)
        if budget is not None:
            want = min(want, _CHUNK_ROWS)
        chunk = list(itertools.islice(scan, want))
        cost.keys += len(chunk)
        if budget is not None and chunk:
            sums = list(itertools.accumulate(map(len, map(_VALUE, chunk))))
            keep = bisect.bisect_right(sums, budget) if rows else max(1, bisect.bisect_right(sums, budget))
            if keep < len(chunk):
                rows += chunk[:keep]
                exhausted = False
                break
            budget -= sums[-1]
        rows += chunk
        if len(rows) > batch_size:
            del rows[batch_size:]
            exhausted = False
            break
        if len(chunk) < want:
            break
    return rows, next_ts if not rows else keys.data_key_ts(rows[-1][0]) + 1, exhausted


def scan_index(
    cf: Rdict,
    state: IteratorState,
    constraints: dict[int, str],
    filter_levels: list[str],
    batch_size: int,
    limit: int,
    max_bytes: int | None,
    cost: ReadCost,
) -> tuple[list[tuple[bytes, bytes]], int, bool]:
    """Read the messages the index lists for the first constrained level; keep those that match the filter."""
    level = min(constraints)
    prefix = keys.index_prefix(state.stream, level, constraints[level])
    candidates = postings(cf, prefix, state.next_ts, limit, cost)
    rows: list[tuple[bytes, bytes]] = []
    next_ts = state.next_ts
    exhausted = False
    parse = pb.Message.FromString
    # With a byte budget, values are fetched a few at a time, so what is
    # held beyond the budget stays small.
    chunk = batch_size if max_bytes is None else BUDGET_CHUNK
    budget = NO_FENCE if max_bytes is None else max_bytes
    full = False
    while len(rows) < batch_size and not full:
        stamps = list(itertools.islice(candidates, min(chunk, batch_size - len(rows))))
        if not stamps:
            exhausted = True
            break
        data_keys = [keys.data_key(state.stream, ts) for ts in stamps]
        values = cf.get(data_keys)
        cost.keys += len(stamps)
        for ts, key, value in zip(stamps, data_keys, values, strict=True):
            if rows and value is not None and len(value) > budget:
                full = True
                break
            next_ts = ts + 1
            # The hash may collide and other constrained levels are not
            # indexed: check the topic itself.
            if value is not None and matches_levels(filter_levels, parse(value).topic.split("/")):
                rows.append((key, value))
                budget -= len(value)
    if full:
        return rows, next_ts, False
    if not exhausted:
        exhausted = next(candidates, None) is None
    return rows, next_ts, exhausted


def postings(cf: Rdict, prefix: bytes, start: int, limit: int, cost: ReadCost) -> Iterator[int]:
    """The timestamps the index keys under ``prefix`` list, from ``start`` up to ``limit``, ascending.

    An index key is named after the first message it lists, so the one
    listing ``start`` may be named before it: begin at the last key at or
    before ``start``.
    """
    width = len(prefix)
    it = cf.iter()
    it.seek_for_prev(prefix + keys.u64(start))
    if not (it.valid() and it.key().startswith(prefix)):
        it.seek(prefix + keys.u64(start))
    while it.valid():
        key = it.key()
        if not key.startswith(prefix):
            return
        first = int.from_bytes(key[width : width + 8], "big")
        if first > limit:
            return
        cost.keys += 1
        for ts in keys.decode_postings(first, it.value()):
            if ts > limit:
                return
            if ts >= start:
                yield ts
        it.next()
