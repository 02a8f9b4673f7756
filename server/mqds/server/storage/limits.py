"""Limits by size and count per retention rule: a shard's messages over them, found newest first, and trimmed.

A retention rule may set, beside its period, ``max_messages``, ``max_bytes``
and ``max_messages_per_topic`` (``mqds.v1.RetentionRule``). They count the
messages the rule decides (those whose **first** matching rule it is, as for
periods), in one shard: a topic's messages are in the shards of its
publishers (messages are sharded by sender), so a filter's are spread over
all of them, and each shard keeps its **share** of a filter-wide limit (the
limit divided by the number of shards, at least 1): the filter as a whole
never holds more than the limit, and a shard that takes most of the traffic
keeps only its share. ``max_messages_per_topic`` counts a topic's messages
in each shard: exact for a topic one publisher writes (all of them are in its
shard), at most the limit times the shards of its publishers otherwise.
Bytes are the stored records' sizes (topic, payload, sender, properties).

The leader finds what is over (``scan_step``): it reads the rule's streams
newest first (generations newest first, the streams of one merged by
timestamp, which is unique in a shard), counting messages, bytes and each
topic's messages; once a count is past its share, every older message of
the rule (or of the topic) is over. It stops at the shard's last timestamp
when the pass began, so messages stored meanwhile are neither counted nor
trimmed, and each call reads at most ``budget`` keys: a pass goes on from
its cursor in later calls. What it found goes in ``TrimMessages`` commands
(at most ``deletes.STEP_KEYS`` keys each) and every replica deletes exactly
those keys it still holds (``trim``): they all remove the same messages. A
message deleted meanwhile by another step is simply not there any more;
nothing stored after the scan can be trimmed by it, since its timestamp is
later than any the scan read.

Per-topic counts are kept for at most ``MAX_TOPICS`` topics a pass: past that,
the messages of topics seen first after it are counted for the rule's limits
but not trimmed per topic (the pass logs that it happened).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rocksdict import WriteBatch

from mqds.protocol.retention import discards_new, has_limits
from mqds.protocol.topics import matches_levels
from mqds.server.storage import keys
from mqds.server.storage.deletes import StepResult
from mqds.server.storage.generations import Generation
from mqds.server.storage.reads import find_streams
from mqds.server.storage.trie import TopicTrie
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import storage_pb2 as pb

MAX_TOPICS = 100_000
"""Topics one pass of one rule counts per topic at most (the leader's memory for it)."""


def share(limit: int, n_shards: int) -> int:
    """A shard's share of a filter-wide limit (0: no limit): the limit over the shards, at least 1."""
    return max(1, limit // max(1, n_shards)) if limit else 0


@dataclass(frozen=True)
class RuleLimits:
    """One rule's limits as a shard applies them (its share of the filter-wide ones)."""

    index: int
    """The rule's place in the policy (0 first)."""
    topic_filter: str
    max_messages: int
    max_bytes: int
    per_topic: int
    discard_new: bool
    rule: clpb.RetentionRule

    def describe(self) -> str:
        """The rule as an error message names it: ``retention rule 2 ('a/#')``."""
        return f"retention rule {self.index + 1} ({self.topic_filter!r})"


class LimitPolicy:
    """The rules of a policy that set limits, and which rule decides a topic (its first matching one)."""

    def __init__(self, policy: clpb.RetentionPolicy, n_shards: int) -> None:
        self.n_shards = n_shards
        self._levels = [r.topic_filter.split("/") for r in policy.rules]
        self._topics: dict[str, int] = {}
        self.rules = [
            RuleLimits(
                i,
                r.topic_filter,
                share(r.max_messages, n_shards),
                share(r.max_bytes, n_shards),
                r.max_messages_per_topic,
                discards_new(r),
                r,
            )
            for i, r in enumerate(policy.rules)
            if has_limits(r)
        ]
        self.refusing = [r for r in self.rules if r.discard_new]
        """The rules whose limits refuse new messages (discard=new)."""

    def rule_of(self, topic: str) -> int:
        """The index of the first rule whose filter matches ``topic`` (-1: none)."""
        found = self._topics.get(topic)
        if found is None:
            levels = topic.split("/")
            found = next((i for i, f in enumerate(self._levels) if matches_levels(f, levels)), -1)
            if len(self._topics) < 100_000:
                self._topics[topic] = found
        return found


@dataclass
class LimitScan:
    """A newest-first pass over one rule's messages in a shard, resumable from call to call."""

    rule: RuleLimits
    top_ts: int
    """The shard's last timestamp when the pass began: later messages are not read."""
    generation: int | None = None
    """Where the pass goes on: in this generation (None: the newest), before ``before_ts``."""
    before_ts: int = 0
    messages: int = 0
    bytes: int = 0
    topics: dict[str, int] = field(default_factory=dict)
    topics_capped: bool = False
    done: bool = False

    @property
    def reached(self) -> bool:
        """Whether the messages read so far fill the rule's share (messages or bytes)."""
        r = self.rule
        return bool((r.max_messages and self.messages >= r.max_messages) or (r.max_bytes and self.bytes >= r.max_bytes))


class TrimmedStream(Protocol):
    """Messages of one stream of one generation to trim, by timestamp (``cluster.v1.TrimmedStream``)."""

    @property
    def generation(self) -> int: ...

    @property
    def stream(self) -> int: ...

    @property
    def timestamps(self) -> Iterable[int]: ...


Doomed = dict[tuple[int, int], list[int]]
"""Messages over a limit: (generation, stream) -> timestamps."""


def scan_step(
    trie: TopicTrie,
    gens: Sequence[Generation],
    policy: LimitPolicy,
    scan: LimitScan,
    budget: int,
    doomed: Doomed,
) -> int:
    """Go on with ``scan`` for at most ``budget`` keys; what is over its limits is added to ``doomed``.

    A discard=new rule's pass only counts, and ends once its share is
    reached (the leader refuses stores from then on). Returns the keys read;
    sets ``scan.done`` when the pass has read the rule's every message.
    """
    rule = scan.rule
    levels = rule.topic_filter.split("/")
    read = 0
    for gen in reversed(gens):
        if scan.generation is not None and gen.number > scan.generation:
            continue
        bound = scan.before_ts if scan.generation == gen.number else scan.top_ts + 1
        scan.generation, scan.before_ts = gen.number, bound
        for ts, stream, value in _newest_first(gen, [r.stream for r in find_streams(trie, [gen], levels, 0)], bound):
            if read >= budget:
                return read
            read += 1
            scan.before_ts = ts
            if rule.discard_new and scan.reached:
                scan.done = True
                return read
            if _over(policy, scan, pb.Message.FromString(value), len(value)) and not rule.discard_new:
                doomed.setdefault((gen.number, stream), []).append(ts)
        scan.generation, scan.before_ts = gen.number - 1, scan.top_ts + 1
    scan.done = True
    return read


def _over(policy: LimitPolicy, scan: LimitScan, message: pb.Message, size: int) -> bool:
    """Count a message of the rule's streams; whether it is over the rule's limits (False: another rule's)."""
    rule = scan.rule
    if policy.rule_of(message.topic) != rule.index:
        return False
    scan.messages += 1
    scan.bytes += size
    over = (rule.max_messages and scan.messages > rule.max_messages) or (rule.max_bytes and scan.bytes > rule.max_bytes)
    if rule.per_topic:
        topic = message.topic
        count = scan.topics.get(topic)
        if count is None and len(scan.topics) >= MAX_TOPICS:
            scan.topics_capped = True
        else:
            count = scan.topics[topic] = (count or 0) + 1
            over = over or count > rule.per_topic
    return bool(over)


def _newest_first(gen: Generation, streams: list[int], before_ts: int) -> Iterable[tuple[int, int, bytes]]:
    """(timestamp, stream, value) of the streams' messages in ``gen`` stored before ``before_ts``, newest first."""
    if before_ts <= 0:
        return
    iterators = []
    heap: list[tuple[int, int]] = []
    for stream in streams:
        it = gen.cf.iter()
        it.seek_for_prev(keys.data_key(stream, before_ts - 1))
        iterators.append((it, keys.data_prefix(stream), stream))
        _push(heap, iterators, len(iterators) - 1)
    while heap:
        negative_ts, slot = heapq.heappop(heap)
        it, _, stream = iterators[slot]
        value = it.value()
        it.prev()
        _push(heap, iterators, slot)
        yield -negative_ts, stream, value


def _push(heap: list[tuple[int, int]], iterators: list[tuple[object, bytes, int]], slot: int) -> None:
    it, prefix, _ = iterators[slot]
    if it.valid():  # type: ignore[attr-defined]
        key = it.key()  # type: ignore[attr-defined]
        if key[: len(prefix)] == prefix and len(key) == keys.DATA_KEY_LEN:
            heapq.heappush(heap, (-keys.data_key_ts(key), slot))


def trim(by_number: dict[int, Generation], streams: Iterable[TrimmedStream], batch: WriteBatch) -> StepResult:
    """Delete the listed messages the shard still holds, in ``batch``; what went, and where (to compact)."""
    result = StepResult(until_us=0)
    for trimmed in streams:
        gen = by_number.get(trimmed.generation)
        stamps = sorted(set(trimmed.timestamps))
        if gen is None or not stamps:
            continue
        names = [keys.data_key(trimmed.stream, ts) for ts in stamps]
        found = [key for key, value in zip(names, gen.cf.get(names), strict=True) if value is not None]
        result.scanned += len(names)
        for key in found:
            batch.delete(key, gen.handle)
        if found:
            result.messages += len(found)
            result.ranges.append((gen.number, found[0], keys.data_key(trimmed.stream, keys.data_key_ts(found[-1]) + 1)))
    return result
