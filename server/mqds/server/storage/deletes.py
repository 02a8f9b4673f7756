"""Deleting stored messages: a sender's, or a topic filter's, in a time range, in bounded steps.

A delete is a logged command applied by every replica (``ShardStorage.delete_messages``):
one step scans at most ``max_keys`` data keys of the matching streams, in
(generation, stream, timestamp) order, from the cursor the step before returned,
and deletes what matches in the same write as the applied index. The leader logs
steps until one returns no cursor. Every input is in the command (the bounds,
the cursor, the step's size) and the scan reads only replicated state, so every
replica deletes the same keys; a step applied twice deletes nothing more.

The upper bound is fixed by the first step: ``until_us`` if given, else the
shard's last timestamp when that step was applied, plus one; the later steps
carry it, so a message stored after the delete began is never deleted.

What a step deletes:
- where every message of a stream in the range matches (the filter puts no
  constraint on the stream's topics and no sender is named), the stream's keys
  in the range as one range deletion (the keys are still read, to count them);
- otherwise each matching message's key (the topic, and the sender when one
  is named, read from the message);
- a stream's index keys in a generation when the range covers the whole
  generation and every message of the stream matched: nothing is left for them
  to point to. Elsewhere index keys stay; a reader that follows one to a
  deleted message skips it (``reads.scan_index``), as it skips a hash collision.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from rocksdict import ReadOptions, WriteBatch

from mqds.protocol.topics import matches_levels
from mqds.server.storage import keys
from mqds.server.storage.engine import prefix_end
from mqds.server.storage.generations import Generation
from mqds.server.storage.reads import StreamRef, find_streams
from mqds.server.storage.trie import TopicTrie, filter_constraints
from mqds.v1 import storage_pb2 as pb


@dataclass(frozen=True)
class DeleteSpec:
    """Which messages: those matching ``topic_filter``, of ``sender`` if set, stored in [since_us, until_us)."""

    topic_filter: str
    sender: str
    since_us: int
    until_us: int


STEP_KEYS = 5_000
"""Data keys one step of a delete or of a retention pass reads at most: a step holds the shard's storage
lock while it scans (a few ms)."""


@dataclass(frozen=True)
class Cursor:
    """Where the next step starts: the stream of a generation, at a timestamp."""

    generation: int
    stream: int
    next_ts: int

    @classmethod
    def of(cls, message: pb.DeleteCursor) -> Cursor:
        """The cursor a logged command carries (``mqds.v1.DeleteCursor``)."""
        return cls(message.generation, message.stream, message.next_ts)

    def message(self, until_us: int = 0) -> pb.DeleteCursor:
        """As ``mqds.v1.DeleteCursor``, for an answer or the next command (``until_us``: the delete's bound)."""
        return pb.DeleteCursor(generation=self.generation, stream=self.stream, next_ts=self.next_ts, until_us=until_us)


@dataclass
class StepResult:
    """What one step deleted, and where the next one starts (None: the delete is done)."""

    until_us: int
    messages: int = 0
    index_keys: int = 0
    scanned: int = 0
    cursor: Cursor | None = None
    ranges: list[tuple[int, bytes, bytes]] = field(default_factory=list)
    """(generation, first key, key after the last): where this step deleted, to compact soon (compaction.py)."""


@dataclass(frozen=True)
class StreamPlan:
    """What may go in one stream: keys in [start, until); all of them (``whole``) or those ``goes`` picks."""

    start: int
    until: int
    whole: bool
    goes: Callable[[pb.Message, int], bool] | None = None
    """For a stream that is not ``whole``: whether the message (stored at the timestamp) goes."""


Planner = Callable[[StreamRef], StreamPlan | None]
"""A stream's plan, or None when nothing in it goes."""


def delete_plan(spec: DeleteSpec) -> Planner:
    """The plan of a delete: the spec's time range; whole streams where the filter and sender allow."""
    levels = spec.topic_filter.split("/")
    sender = spec.sender

    def goes(message: pb.Message, ts: int) -> bool:
        return (not sender or message.sender == sender) and matches_levels(levels, message.topic.split("/"))

    def plan(ref: StreamRef) -> StreamPlan | None:
        constraints = filter_constraints(ref.pattern, levels)
        if constraints is None:
            return None
        whole = not constraints and not sender
        return StreamPlan(spec.since_us, spec.until_us, whole, None if whole else goes)

    return plan


def overlapping(gens: Iterable[Generation], since_us: int, until_us: int) -> list[Generation]:
    """The generations that may hold messages stored in [since_us, until_us)."""
    return [
        g for g in gens if g.record.since_us < until_us and (g.record.until_us is None or g.record.until_us > since_us)
    ]


def step(
    trie: TopicTrie,
    gens: Iterable[Generation],
    spec: DeleteSpec,
    cursor: Cursor | None,
    max_keys: int,
    batch: WriteBatch,
) -> StepResult:
    """Put the deletes of one step of a delete into ``batch``; scan at most ``max_keys`` data keys."""
    chosen = overlapping(gens, spec.since_us, spec.until_us)
    refs = find_streams(trie, chosen, spec.topic_filter.split("/"), spec.since_us)
    result = StepResult(until_us=spec.until_us)
    run_step(chosen, refs, delete_plan(spec), cursor, max_keys, batch, result)
    return result


def run_step(
    gens: Iterable[Generation],
    refs: Iterable[StreamRef],
    plan: Planner,
    cursor: Cursor | None,
    max_keys: int,
    batch: WriteBatch,
    result: StepResult,
) -> None:
    """Delete what ``plan`` says in ``refs`` (in order) from ``cursor`` on; at most ``max_keys`` keys read.

    Sets ``result.cursor`` to where the next step starts, or leaves it None when every stream is done.
    """
    by_number = {g.number: g for g in gens}
    for ref in refs:
        if cursor is not None and (ref.generation, ref.stream) < (cursor.generation, cursor.stream):
            continue
        stream_plan = plan(ref)
        if stream_plan is None or stream_plan.until <= stream_plan.start:
            continue
        start = stream_plan.start
        if cursor is not None and (ref.generation, ref.stream) == (cursor.generation, cursor.stream):
            start = max(start, cursor.next_ts)
        gen = by_number[ref.generation]
        budget = max_keys - result.scanned
        if budget <= 0:
            result.cursor = Cursor(ref.generation, ref.stream, start)
            return
        deleted = result.messages
        if stream_plan.whole:
            next_ts = _delete_range(gen, ref.stream, start, stream_plan.until, budget, batch, result)
            if next_ts is None and _covers(gen, start, stream_plan.until):
                index_keys = _delete_index(gen, ref.stream, batch)
                if index_keys:
                    result.index_keys += index_keys
                    result.ranges.append((gen.number, *_index_range(ref.stream)))
        else:
            assert stream_plan.goes is not None
            next_ts = _delete_matching(gen, ref.stream, stream_plan, start, budget, batch, result)
        if result.messages > deleted:
            stop = stream_plan.until if next_ts is None else next_ts
            result.ranges.append((gen.number, keys.data_key(ref.stream, start), keys.data_key(ref.stream, stop)))
        if next_ts is not None:
            result.cursor = Cursor(ref.generation, ref.stream, next_ts)
            return


def _bounded(stream: int, until_us: int) -> ReadOptions:
    """Read options that end a scan at the stream's key ``until_us`` (excluded).

    The caller keeps them in a variable while its scan runs: an iterator
    does not hold its options alive, and once they are collected its bound
    is freed memory (the scan then stops early, at random).
    """
    opts = ReadOptions()
    opts.set_iterate_upper_bound(keys.data_key(stream, until_us))
    return opts


def _delete_range(
    gen: Generation, stream: int, start: int, until_us: int, budget: int, batch: WriteBatch, result: StepResult
) -> int | None:
    """Every key of the stream in [start, until_us), up to ``budget`` of them, as one range deletion.

    The timestamp to go on from, or None when the stream's keys in the range are all deleted.
    """
    bound = _bounded(stream, until_us)
    found = list(itertools.islice(gen.cf.keys(from_key=keys.data_key(stream, start), read_opt=bound), budget + 1))
    more = len(found) > budget
    taken = found[:budget]
    result.scanned += len(taken)
    if taken:
        last = keys.data_key_ts(taken[-1])
        batch.delete_range(keys.data_key(stream, start), keys.data_key(stream, last + 1), gen.handle)
        result.messages += len(taken)
    return keys.data_key_ts(found[budget]) if more else None


def _delete_matching(
    gen: Generation, stream: int, plan: StreamPlan, start: int, budget: int, batch: WriteBatch, result: StepResult
) -> int | None:
    """Each key of the stream in [start, plan.until) whose message the plan picks, up to ``budget`` read."""
    assert plan.goes is not None
    goes = plan.goes
    parse = pb.Message.FromString
    bound = _bounded(stream, plan.until)
    rows = gen.cf.items(from_key=keys.data_key(stream, start), read_opt=bound)
    for key, value in rows:
        if budget == 0:
            return keys.data_key_ts(key)
        budget -= 1
        result.scanned += 1
        if goes(parse(value), keys.data_key_ts(key)):
            batch.delete(key, gen.handle)
            result.messages += 1
    return None


def _covers(gen: Generation, start: int, until_us: int) -> bool:
    """The range reaches from the generation's start (or before) to its end: a closed generation's all of it."""
    until = gen.record.until_us
    return start <= gen.record.since_us and until is not None and until_us >= until


def _index_range(stream: int) -> tuple[bytes, bytes]:
    """The first index key of a stream and the first key after them all."""
    prefix = keys.INDEX_TAG + keys.u32(stream)
    end = prefix_end(prefix)
    assert end is not None  # the prefix starts with the index tag, not 0xFF
    return prefix, end


def _delete_index(gen: Generation, stream: int, batch: WriteBatch) -> int:
    """Delete the stream's index keys in the generation; how many there were."""
    prefix, end = _index_range(stream)
    opts = ReadOptions()
    opts.set_iterate_upper_bound(end)
    count = sum(1 for _ in gen.cf.keys(from_key=prefix, read_opt=opts))
    if count:
        batch.delete_range(prefix, end, gen.handle)
    return count
