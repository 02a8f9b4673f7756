"""Planning a read: which (vnode, generation, time range) slices the Spark partitions read, and what was lost.

A slice is what a Spark task reads: the matching messages of some streams
of one generation of one vnode, with timestamps in ``[start_us, fence_us]``;
a streaming micro-batch packs small slices into one task (``pack_slices``).
The upper bound is a read fence (see :mod:`mqds.spark.snapshot`), so a task
retried on another executor gets the same rows from any replica. Slices that
would be too large are cut into consecutive time ranges. Nothing here needs
pyspark or a cluster: it is plain arithmetic over fences and streams.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from mqds.client import Fence, Generation, Rank, Stream
from mqds.spark.options import format_time_us
from mqds.spark.snapshot import GenerationRange

# More pieces than this per (vnode, generation) only adds task overhead.
MAX_SPLITS = 4096


class DataLossError(RuntimeError):
    """Messages a read was to return are gone (retention dropped their generation); failOnDataLoss=false skips."""


@dataclass(frozen=True)
class Slice:
    """One Spark partition: ``streams`` of (``shard``, ``generation``) read from ``start_us`` up to ``fence_us``."""

    shard: int
    generation: int
    streams: tuple[Stream, ...]
    topic_filter: str
    start_us: int
    """First timestamp to return (inclusive)."""
    fence_us: int
    """Last timestamp to return (inclusive): the read fence, so any replica answers the same."""
    estimated_rows: float = 0.0
    """Rows the slice is expected to hold (RocksDB's key estimate spread over time; errs large)."""


def estimated_rows(generation: Generation, keys: int, lo_us: int, hi_us: int, fence_us: int) -> float:
    """How many of a generation's ``keys`` (RocksDB's estimate) fall in ``[lo_us, hi_us]``, if spread evenly in time.

    The key estimate also counts index entries, so this errs on the large
    side: slices come out smaller than the bound rather than larger, unless
    messages bunch up in time.

    >>> g = Generation(shard=0, generation=2, since_us=1_000, until_us=2_000, created_at_us=1_000)
    >>> estimated_rows(g, 500, 1_000, 1_499, fence_us=5_000)
    250.0
    """
    data_lo = generation.since_us or generation.created_at_us
    data_hi = generation.until_us - 1 if generation.until_us is not None else fence_us
    if data_hi <= data_lo:
        return float(keys)
    overlap = min(hi_us, data_hi) - max(lo_us, data_lo) + 1
    if overlap <= 0:
        return 0.0
    return keys * min(1.0, overlap / (data_hi - data_lo + 1))


def split_range(lo_us: int, hi_us: int, pieces: int) -> list[tuple[int, int]]:
    """``[lo_us, hi_us]`` cut into ``pieces`` consecutive inclusive ranges of (nearly) equal length.

    >>> split_range(0, 9, 3)
    [(0, 2), (3, 5), (6, 9)]
    """
    pieces = max(1, min(pieces, hi_us - lo_us + 1))
    span = hi_us - lo_us + 1
    cuts = [lo_us + span * i // pieces for i in range(pieces + 1)]
    return [(cuts[i], cuts[i + 1] - 1) for i in range(pieces)]


def time_pieces(
    generation: Generation, lo_us: int, hi_us: int, pieces: int, first_us: int | None = None
) -> list[tuple[int, int]]:
    """``[lo_us, hi_us]`` cut into ``pieces`` ranges over the part where the generation holds data.

    The cut starts at ``first_us`` (the first matching message, when a probe
    found it) or else where the generation began taking writes: a first
    generation starts at time 0, and cutting from there would put every
    message in the last piece. The first piece still reaches down to
    ``lo_us``, so nothing is left out.

    >>> g = Generation(shard=0, generation=1, since_us=0, until_us=None, created_at_us=1_000)
    >>> time_pieces(g, 0, 1_999, 2)
    [(0, 1499), (1500, 1999)]
    >>> time_pieces(g, 0, 1_999, 2, first_us=1_800)
    [(0, 1899), (1900, 1999)]
    """
    data_lo = max(lo_us, first_us if first_us is not None else generation.since_us or generation.created_at_us)
    if pieces <= 1 or data_lo >= hi_us:
        return [(lo_us, hi_us)]
    cut = split_range(data_lo, hi_us, pieces)
    return [(lo_us, cut[0][1]), *cut[1:]]


FirstTimestamp = Callable[[Slice], "int | None"]
"""A probe: the timestamp of a slice's first matching message, or None when it has none."""


def plan_slices(
    ranges: Mapping[int, tuple[int, int]],
    current: Mapping[int, Fence],
    streams: Iterable[tuple[Rank, Stream]],
    topic_filter: str,
    max_rows: int,
    generations: Collection[int] | None = None,
    first_timestamp: FirstTimestamp | None = None,
) -> list[Slice]:
    """The slices that read, per vnode in ``ranges``, timestamps ``[lo, hi]`` of ``streams``.

    ``current`` is each vnode's fence as it stands now (generations and key
    estimates, used to size slices); ``generations``, when given, keeps only
    those generation numbers (a pushed-down filter). A (vnode, generation)
    estimated to hold more than ``max_rows`` keys in range is cut by time,
    evenly between its first matching message (asked of ``first_timestamp``,
    which costs a read per stream, so only for those) and its last timestamp.
    """
    by_rank: dict[Rank, list[Stream]] = {}
    for rank, stream in streams:
        by_rank.setdefault(rank, []).append(stream)
    slices: list[Slice] = []
    for rank in sorted(by_rank):
        shard, number = rank
        if shard not in ranges or (generations is not None and number not in generations):
            continue
        fence = current.get(shard)
        if fence is None:
            continue
        gen = next((g for g in fence.generations if g.generation == number), None)
        if gen is None:
            continue  # dropped between the fences and the streams: the read's data-loss check reports it
        keys_of = dict(zip((g.generation for g in fence.generations), fence.estimated_keys, strict=False))
        lo, hi = ranges[shard]
        lo = max(lo, gen.since_us)
        if gen.until_us is not None:
            hi = min(hi, gen.until_us - 1)
        if lo > hi:
            continue
        rows = estimated_rows(gen, keys_of.get(number, 0), lo, hi, fence.timestamp_us)
        whole = Slice(shard, number, tuple(sorted(by_rank[rank], key=lambda s: s.id)), topic_filter, lo, hi, rows)
        pieces = min(MAX_SPLITS, math.ceil(rows / max_rows))
        if pieces <= 1:
            slices.append(whole)
            continue
        first = first_timestamp(whole) if first_timestamp is not None else None
        if first_timestamp is not None and first is None:
            continue  # nothing matches in the range
        for start, end in time_pieces(gen, lo, hi, pieces, first):
            slices.append(Slice(shard, number, whole.streams, topic_filter, start, end, rows / pieces))
    return slices


PACKED_ROWS = 10_000
"""Slices are packed into one task up to this many estimated rows (see ``pack_slices``)."""


def pack_slices(slices: Sequence[Slice], rows: float = PACKED_ROWS) -> list[tuple[Slice, ...]]:
    """Group consecutive small slices so that one task reads them, up to ``rows`` estimated rows a group.

    A Spark task costs tens of milliseconds before it reads a row (scheduling,
    a Python worker, a client); a streaming micro-batch of a few new messages
    spread over many vnodes would pay that once per vnode. A slice estimated
    at ``rows`` or more keeps a task of its own, so large reads stay parallel.

    >>> small = [Slice(s, 1, (), "#", 0, 9, 10.0) for s in range(3)]
    >>> [len(group) for group in pack_slices(small + [Slice(3, 1, (), "#", 0, 9, 50_000.0)] + small, 25)]
    [2, 1, 1, 2, 1]
    """
    groups: list[tuple[Slice, ...]] = []
    group: list[Slice] = []
    total = 0.0
    for part in slices:
        if group and total + part.estimated_rows > rows:
            groups.append(tuple(group))
            group, total = [], 0.0
        group.append(part)
        total += part.estimated_rows
    if group:
        groups.append(tuple(group))
    return groups


def dropped_ranges(
    current: Sequence[Generation], expected: Sequence[GenerationRange] | None = None
) -> list[GenerationRange]:
    """The time ranges of generations that are gone.

    With ``expected`` (the generations a snapshot saw), those of them no
    longer in ``current``. Without, the gaps ``current`` itself shows:
    generations below the first one left, or missing between two.
    """
    present = {g.generation for g in current}
    if expected is not None:
        return [g for g in expected if g.generation not in present]
    ordered = sorted(current, key=lambda g: g.generation)
    gone: list[GenerationRange] = []
    if ordered and ordered[0].generation > 1 and ordered[0].since_us > 0:
        gone.append(GenerationRange(ordered[0].generation - 1, 0, ordered[0].since_us))
    for before, after in itertools.pairwise(ordered):
        if after.generation > before.generation + 1 and before.until_us is not None:
            gone.append(GenerationRange(after.generation - 1, before.until_us, after.since_us))
    return gone


def data_loss(shard: int, lo_us: int, hi_us: int, gone: Iterable[GenerationRange]) -> list[str]:
    """Descriptions of the dropped generations of ``shard`` that overlap ``[lo_us, hi_us]``."""
    found = []
    for g in gone:
        if g.overlaps(lo_us, hi_us):
            until = "now" if g.until_us is None else format_time_us(g.until_us)
            found.append(f"vnode {shard} generation {g.generation} ({format_time_us(g.since_us)} to {until})")
    return found


def loss_error(lost: Sequence[str], why: str) -> DataLossError:
    return DataLossError(
        f"messages to read are gone: {why}: {'; '.join(lost)}. Retention (or mqds generations drop) removed them. "
        "Set .option('failOnDataLoss', 'false') to read what is left instead"
    )
