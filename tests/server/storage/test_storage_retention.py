"""Retention per topic filter in one shard: the first matching rule decides, every replica removes the same."""

from __future__ import annotations

import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from storage_support import msg, replay

from mqds.protocol.topics import matches
from mqds.server.storage.deletes import Cursor
from mqds.server.storage.retention import KEEP, Policy, Rule
from mqds.server.storage.shard import Engine, ShardStorage

TOPICS = ["tel/1/t", "tel/2/t", "tel/3/h", "audit/x", "audit/y", "misc", "$SYS/x"]
FILTERS = ["tel/#", "tel/1/#", "tel/+/t", "audit/#", "#", "misc", "$SYS/#"]


def run_pass(shard: ShardStorage, policy: Policy, now: int, after: int, max_keys: int) -> int:
    cursor: Cursor | None = None
    removed = 0
    for _ in range(10_000):
        result = shard.apply_retention(policy, now, after, cursor, max_keys)
        removed += result.messages
        assert result.scanned <= max_keys
        if result.cursor is None:
            return removed
        cursor = result.cursor
    raise AssertionError("the pass never ended")


def content(shard: ShardStorage) -> list[tuple[int, str]]:
    return sorted((r.ts, r.message.topic) for f in ("#", "$SYS/#") for r in replay(shard, f))


def expected_period(rules: list[tuple[str, int]], default: int, topic: str) -> int:
    return next((p for f, p in rules if matches(f, topic)), default)


@pytest.mark.slow
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batches=st.lists(
        st.tuples(st.lists(st.sampled_from(TOPICS), min_size=1, max_size=10), st.booleans()), min_size=1, max_size=8
    ),
    rules=st.lists(
        st.tuples(st.sampled_from(FILTERS), st.sampled_from([KEEP, 5, 20, 40])), max_size=4, unique_by=lambda r: r[0]
    ),
    default=st.sampled_from([KEEP, 10, 30]),
    passes=st.lists(st.integers(0, 60), min_size=1, max_size=3),
    max_keys=st.integers(1, 20),
)
def test_a_pass_removes_exactly_what_the_first_matching_rule_ended(
    batches: list[tuple[list[str], bool]],
    rules: list[tuple[str, int]],
    default: int,
    passes: list[int],
    max_keys: int,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        shard = ShardStorage(f"{tmp}/s", 0, Engine())
        try:
            shard.initialize(1)
            now = 1
            for topics, rotate in batches:
                shard.store([msg(t) for t in topics], now)
                now += len(topics) + 2
                if rotate:
                    shard.add_generation(now)
            before = content(shard)
            # Periods of a few microseconds, as the shard's timestamps here are: the pass clocks cut batches.
            policy = Policy([Rule(f, p) for f, p in rules], default)
            clock, after = 0, 0
            for step in passes:
                clock += step
                run_pass(shard, policy, clock, after, max_keys)
                after = clock
                kept = [
                    (ts, topic)
                    for ts, topic in before
                    if (p := expected_period(rules, default, topic)) == KEEP or ts >= clock - p
                ]
                assert content(shard) == kept
                # The drop check agrees: a generation it offers holds nothing kept.
                drops, _ = shard.retention_due(policy, clock, after)
                for number in drops:
                    info = next(g for g in shard.generations() if g.generation == number)
                    assert info.until_us is not None
                    assert not [ts for ts, _ in kept if info.since_us <= ts < info.until_us]
        finally:
            shard.close()


def test_a_rule_removes_old_messages_of_its_streams_and_keeps_the_rest(shard: ShardStorage) -> None:
    shard.store([msg("tel/1/t") for _ in range(10)], 1_000_000)  # at 1 s
    shard.store([msg("audit/x") for _ in range(10)], 1_000_000)
    shard.store([msg("tel/1/t") for _ in range(5)], 50_000_000)  # at 50 s
    policy = Policy.of_seconds([("tel/#", 30), ("audit/#", 0)], 0)
    assert run_pass(shard, policy, 60_000_000, 0, 7) == 10
    assert [t for _, t in content(shard)] == ["audit/x"] * 10 + ["tel/1/t"] * 5
    # A later pass that starts after the first finds nothing more, without looking at what it kept.
    assert run_pass(shard, policy, 61_000_000, 60_000_000, 7) == 0
