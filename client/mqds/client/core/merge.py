"""Merging one rank's streams by timestamp, a batch at a time, without a Python object per message.

The streams of one generation of a shard interleave in time, so a reader
that wants one timeline (each sender's order kept across its topics) merges
them. Every message up to the earliest last timestamp of the sources'
current batches can be handed on (no later batch of any source goes below
it); those are cut off each batch and put in timestamp order together.

The cut works on each batch's timestamps alone: a node sends them beside
the messages as one packed field (``NextResponse.timestamps``), which the
client reads as a memory view of integers, so no protobuf message is
wrapped in a Python object to be merged. The merged batch is a view: its
``i``-th message is looked up in the source batches when (and if) it is
read. Counting, forwarding or cutting a replay thus costs a sort of
integers, not an object per message.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from operator import itemgetter, lt
from typing import Any, overload

from mqds.client.batch import MessageBatch


class Rest:
    """What a source has not yet handed on of its current batch: ``wire[start:end]``, ``times[start:end]``.

    Usually the whole batch (``end`` None); a run of it (see :func:`runs`) ends earlier.
    """

    __slots__ = ("per_message", "start", "times", "wire")

    def __init__(self, batch: MessageBatch, start: int = 0, end: int | None = None) -> None:
        times = batch.times
        self.wire: Sequence[Any] = batch.wire
        self.times: Sequence[int] = times if end is None else times[:end]
        self.start = start
        self.per_message = batch.nbytes / len(times) if len(times) else 0.0
        """The batch's bytes on the wire per message: what a cut counts for each message it takes."""

    def __bool__(self) -> bool:
        return self.start < len(self.times)


def runs(batch: MessageBatch) -> list[Rest]:
    """The batch as one :class:`Rest` per run of increasing timestamps: each a source in time order for :func:`cut`.

    An answer that went on from stream to stream (``NextRequest.then``)
    holds its streams one after the other, each in time order; where a
    stream's first timestamp is below the last one's before it, a new run
    starts. Streams that follow each other in time make one run. The cuts
    are found by C-level iteration over the packed timestamps.

    >>> from mqds.client.batch import MessageBatch
    >>> [(r.start, len(r.times)) for r in runs(MessageBatch([None] * 6, [5, 7, 2, 3, 9, 1], 0))]
    [(0, 2), (2, 5), (5, 6)]
    """
    times = batch.times
    n = len(times)
    if not n:
        return []
    starts = itertools.compress(range(1, n), map(lt, times[1:], times[:-1]))
    bounds = [0, *starts, n]
    return [Rest(batch, a, b) for a, b in itertools.pairwise(bounds)]


class Parts:
    """The parts of several batches that one cut hands on, numbered one after another.

    ``parts[p]`` is a batch's wire sequence and the index its part starts at;
    ``bases[p]`` is where that part starts in the flat numbering. The
    protobuf messages are wrapped as Python objects only when a reader asks
    for them, all of the cut's at once (``flat``), shared by its batches.
    """

    __slots__ = ("_flat", "bases", "parts", "total")

    def __init__(self) -> None:
        self.parts: list[tuple[Sequence[Any], int]] = []
        self.bases: list[int] = []
        self.total = 0
        self._flat: list[Any] | None = None

    def add(self, wire: Sequence[Any], start: int, count: int) -> None:
        self.parts.append((wire, start))
        self.bases.append(self.total)
        self.total += count

    def flat(self) -> list[Any]:
        """Every message of the parts, in flat numbering."""
        if self._flat is None:
            flat: list[Any] = []
            ends = [*self.bases[1:], self.total]
            for (wire, start), base, end in zip(self.parts, self.bases, ends, strict=True):
                flat += wire[start : start + end - base]
            self._flat = flat
        return self._flat

    def at(self, index: int) -> Any:
        """One message by its flat number."""
        if self._flat is not None:
            return self._flat[index]
        p = bisect.bisect_right(self.bases, index) - 1
        wire, start = self.parts[p]
        return wire[start + index - self.bases[p]]


class Gathered(Sequence[Any]):
    """Protobuf messages picked from a cut's :class:`Parts` in a given order, looked up as they are read."""

    __slots__ = ("_order", "_parts")

    def __init__(self, parts: Parts, order: Sequence[int]) -> None:
        self._parts = parts
        self._order = order

    def __len__(self) -> int:
        return len(self._order)

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self._parts.at(flat) for flat in self._order[index]]
        return self._parts.at(self._order[index])

    def __iter__(self) -> Iterator[Any]:
        return map(self._parts.flat().__getitem__, self._order)


def cut(rests: list[Rest], batch_size: int) -> list[MessageBatch]:
    """Hand on what the sources' rests hold up to their horizon, in timestamp order, as batches of ``batch_size``.

    ``rests`` are non-empty, each in timestamp order (timestamps within a
    shard are unique); each is advanced past what was handed on, and at
    least one of them is then empty (the one that set the horizon).
    """
    horizon = min(rest.times[-1] for rest in rests)
    parts = Parts()
    stamps: list[int] = []
    nbytes = 0.0
    for rest in rests:
        upto = bisect.bisect_right(rest.times, horizon, rest.start)
        if upto > rest.start:
            parts.add(rest.wire, rest.start, upto - rest.start)
            stamps.extend(rest.times[rest.start : upto])
            nbytes += (upto - rest.start) * rest.per_message
            rest.start = upto
    if len(parts.parts) == 1:
        order: Sequence[int] = range(len(stamps))
    else:
        order = sorted(range(len(stamps)), key=stamps.__getitem__)
    out = []
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        times = itemgetter(*chunk)(stamps) if len(chunk) > 1 else (stamps[chunk[0]],)
        out.append(MessageBatch(Gathered(parts, chunk), times, int(nbytes * len(chunk) / len(order))))
    return out
