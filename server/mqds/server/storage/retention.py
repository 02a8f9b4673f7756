"""Retention per topic filter: how long each stored message is kept, and what a stream of a pattern may hold.

A policy is an ordered list of rules (a topic filter and a period) and a
default period for messages that no rule matches (0: kept until deleted). A
message is kept for the period of the **first** rule whose filter matches its
topic, as in a routing table: put the specific filters before the general
ones. The rules are cluster configuration (the metadata group logs them); a
vnode's leader logs retention steps that carry the policy and its clock, so
every replica removes the same keys (``deletes.step`` with ``plan``).

For a stream (a topic pattern such as ``dev/+/temp``), ``StreamRetention``
says what the policy means for all of its topics at once:

- ``uniform``: every topic of the stream has the same period (one rule covers
  the whole pattern before any other could match part of it, or no rule can
  match any of its topics): its old keys go as one range deletion;
- otherwise each message's topic decides (``period_of``);
- ``shortest`` and ``longest``: the bounds over its topics, for where a scan
  may stop and when a whole closed generation of it may be dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rocksdict import WriteBatch

from mqds.protocol.topics import matches_levels
from mqds.server.storage.deletes import Cursor, Planner, StepResult, StreamPlan, run_step
from mqds.server.storage.generations import Generation
from mqds.server.storage.reads import StreamRef
from mqds.server.storage.trie import TopicTrie, filter_constraints
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import storage_pb2 as pb

KEEP = 0
"""A period of 0: kept until deleted."""


@dataclass(frozen=True)
class Rule:
    topic_filter: str
    period_us: int


@dataclass(frozen=True)
class StreamRetention:
    """What a policy means for the topics of one stream pattern (periods in microseconds, 0: kept)."""

    uniform: int | None
    """The period of every topic of the stream, when they all have the same; None when topics differ."""
    shortest: int
    """The shortest period any topic of the stream may have (0 if some topic is kept and none expires)."""
    longest: int
    """The longest (0 if some topic of the stream is kept forever)."""
    longest_expiring: int
    """The longest period of the topics that expire at all (0 if none does)."""


@dataclass
class Policy:
    """An ordered list of rules and a default period (``KEEP``: kept)."""

    rules: Sequence[Rule]
    default_us: int
    _levels: list[list[str]] = field(init=False, repr=False)
    _topics: dict[str, int] = field(init=False, repr=False, default_factory=dict)
    _patterns: dict[str, StreamRetention] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._levels = [r.topic_filter.split("/") for r in self.rules]

    def period_of(self, topic: str) -> int:
        """The period of a message of ``topic``: its first matching rule's, else the default."""
        found = self._topics.get(topic)
        if found is None:
            levels = topic.split("/")
            found = next(
                (r.period_us for r, f in zip(self.rules, self._levels, strict=True) if matches_levels(f, levels)),
                self.default_us,
            )
            if len(self._topics) < 100_000:
                self._topics[topic] = found
        return found

    def for_pattern(self, pattern: str) -> StreamRetention:
        """What the policy means for a stream of ``pattern`` (cached)."""
        found = self._patterns.get(pattern)
        if found is None:
            found = self._patterns[pattern] = self._for_pattern(pattern)
        return found

    def _for_pattern(self, pattern: str) -> StreamRetention:
        periods: list[int] = []
        covered = False
        for rule, levels in zip(self.rules, self._levels, strict=True):
            constraints = filter_constraints(pattern, levels)
            if constraints is None:
                continue
            periods.append(rule.period_us)
            if not constraints:  # every topic of the stream matches: later rules never apply to it
                covered = True
                break
        if not covered:
            periods.append(self.default_us)
        uniform = periods[0] if len(set(periods)) == 1 else None
        kept = KEEP in periods
        expiring = [p for p in periods if p != KEEP]
        return StreamRetention(
            uniform=uniform,
            shortest=min(expiring) if expiring else KEEP,
            longest=KEEP if kept else max(periods),
            longest_expiring=max(expiring) if expiring else KEEP,
        )

    @classmethod
    def of_seconds(cls, rules: Sequence[tuple[str, int]], default_s: int) -> Policy:
        """A policy from (filter, seconds) rules and a default in seconds (0: kept)."""
        return cls([Rule(f, s * 1_000_000) for f, s in rules], default_s * 1_000_000)


SKEW_MARGIN_US = 60_000_000
"""How far before the last pass a pass looks again: a message stored after it with an older timestamp
(another leader's slower clock) is still found."""


def retention_plan(policy: Policy, now_us: int, after_us: int = 0) -> Planner:
    """The plan of a retention step at ``now_us``: in each stream, what its topics' periods have ended.

    ``after_us``: when the last complete pass of this shard ran (0: none known). What expired before
    then is gone already, so a stream is scanned from its longest period before it (less a margin).
    """

    def goes(message: pb.Message, ts: int) -> bool:
        period = policy.period_of(message.topic)
        return period != KEEP and ts < now_us - period

    def plan(ref: StreamRef) -> StreamPlan | None:
        stream = policy.for_pattern(ref.pattern)
        if stream.shortest == KEEP:
            return None
        until = max(0, now_us - stream.shortest)
        start = max(0, after_us - stream.longest_expiring - SKEW_MARGIN_US) if after_us else 0
        if stream.uniform is not None:
            return StreamPlan(start, until, True)
        return StreamPlan(start, until, False, goes)

    return plan


def step(
    trie: TopicTrie,
    gens: Sequence[Generation],
    policy: Policy,
    now_us: int,
    after_us: int,
    cursor: Cursor | None,
    max_keys: int,
    batch: WriteBatch,
) -> StepResult:
    """Put one retention step's deletes into ``batch``: every stream of every generation, in order."""
    refs = [StreamRef(g.number, s, trie.pattern(s)) for g in gens for s in sorted(g.present)]
    result = StepResult(until_us=now_us)
    run_step(gens, refs, retention_plan(policy, now_us, after_us), cursor, max_keys, batch, result)
    return result


def droppable(gen: Generation, trie: TopicTrie, policy: Policy, now_us: int) -> bool:
    """Whether a closed generation's every stream has outlived its longest period: it may be dropped whole."""
    until = gen.record.until_us
    if until is None:
        return False
    longest = [policy.for_pattern(trie.pattern(s)).longest for s in gen.present]
    if not longest:
        longest = [policy.default_us]
    return KEEP not in longest and until <= now_us - max(longest)


def may_have_expired(gens: Sequence[Generation], trie: TopicTrie, policy: Policy, now_us: int, after_us: int) -> bool:
    """Whether some stream may hold a message whose period ended since ``after_us`` (a pass is worth logging)."""
    for gen in gens:
        for stream in gen.present:
            r = policy.for_pattern(trie.pattern(stream))
            if r.shortest == KEEP or gen.record.since_us >= now_us - r.shortest:
                continue
            if gen.record.until_us is None or not after_us:
                return True
            if gen.record.until_us > after_us - r.longest_expiring - SKEW_MARGIN_US:
                return True
    return False


_POLICIES: dict[bytes, Policy] = {}


def policy_of(message: clpb.RetentionPolicy) -> Policy:
    """The ``Policy`` of a ``mqds.v1.RetentionPolicy`` (one object per distinct policy: its caches are kept)."""
    key = message.SerializeToString(deterministic=True)
    found = _POLICIES.get(key)
    if found is None:
        if len(_POLICIES) > 16:
            _POLICIES.clear()
        found = _POLICIES[key] = Policy.of_seconds(
            [(r.topic_filter, r.period_s) for r in message.rules], message.default_s
        )
    return found
