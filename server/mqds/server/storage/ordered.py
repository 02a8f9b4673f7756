"""A shard's messages matching a filter in timestamp order, across its streams and generations; what retention took.

Offline fetches (``sessions.py``) and push subscriptions (``mqds.server.api.follow``)
read a shard this way: from a time on, oldest first, whatever stream each
message is in, lazily, so a reader that stops early reads no more than it
returns (plus one chunk per stream).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Protocol

from mqds.server.storage.generations import GenerationInfo
from mqds.server.storage.iterators import IteratorState
from mqds.server.storage.reads import ReadResult, StreamRef

CHUNK = 256
"""How many messages one read of a stream asks for."""


class StoredMessages(Protocol):
    """What reading a shard in order asks of it (``ShardStorage`` is one)."""

    @property
    def shard(self) -> int: ...

    @property
    def last_ts(self) -> int: ...

    def get_streams(self, filter_levels: list[str], start_time_us: int) -> list[StreamRef]: ...

    def next(
        self, state: IteratorState, batch_size: int, fence_us: int | None = None, max_bytes: int | None = None
    ) -> ReadResult: ...

    def generations(self) -> list[GenerationInfo]: ...


def ordered(
    storage: StoredMessages, topic_filter: str, start_us: int, fence_us: int | None = None
) -> Iterator[tuple[int, bytes]]:
    """Every stored message matching ``topic_filter`` from ``start_us`` on, as (timestamp, stored bytes), in order.

    Generations one after the other; within one, its matching streams merged
    by timestamp. The read stops at a fence: ``fence_us``, else the shard's
    last timestamp as it was before the streams were listed. A store that
    lands while this runs may start a stream the list does not have, and
    returning its later messages from the listed streams would skip its own:
    a reader that goes on from the last message it got would never see them.
    """
    fence = storage.last_ts if fence_us is None else min(fence_us, storage.last_ts)
    by_generation: dict[int, list[int]] = {}
    for ref in storage.get_streams(topic_filter.split("/"), start_us):
        by_generation.setdefault(ref.generation, []).append(ref.stream)
    for generation in sorted(by_generation):
        runs = [
            _stream(storage, IteratorState(storage.shard, generation, stream, topic_filter, start_us), fence)
            for stream in by_generation[generation]
        ]
        yield from heapq.merge(*runs, key=_timestamp) if len(runs) > 1 else runs[0]


def _stream(storage: StoredMessages, state: IteratorState, fence_us: int) -> Iterator[tuple[int, bytes]]:
    while True:
        result = storage.next(state, CHUNK, fence_us)
        yield from result.entries
        if result.end_of_stream or result.state.next_ts == state.next_ts:
            return
        state = result.state


def _timestamp(entry: tuple[int, bytes]) -> int:
    return entry[0]


def dropped_after(storage: StoredMessages, after_us: int) -> tuple[int, int] | None:
    """The time interval ``[since, until)`` of dropped generations that held messages after ``after_us``;
    None when everything stored after ``after_us`` is still there.

    Generations are numbered from 1 without gaps, and each starts where the one
    before it ended: a missing number is a dropped generation, and the time
    between its neighbours is what went with it. What it held is judged by the
    next generation's ``last_before_us``, the last message stored before that
    one opened: a generation opens at the clock time of its rotation, usually
    well after the last message, so a reader at that message has lost nothing
    though its position is before the next generation's start. Where it is
    not that message's, it is later (a rotation's ``since - 1``), which at
    worst tells a loss that was not one, never the other way. A record
    written before it was kept (version 1) counts the whole interval, up to
    ``since - 1``.
    """
    infos = storage.generations()
    if not infos:
        return None
    previous_number, previous_until = 0, 0
    for info in infos:
        if info.generation > previous_number + 1:
            last = info.since_us - 1 if info.last_before_us is None else info.last_before_us
            # Below previous_until, the last message is in a generation still there: the dropped ones held none.
            if last >= previous_until and last > after_us:
                return previous_until, info.since_us
        previous_number, previous_until = info.generation, info.until_us or 0
    return None
