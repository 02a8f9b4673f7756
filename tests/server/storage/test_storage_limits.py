"""Limits by size and count per retention rule in one shard: the newest-first pass, the trim every replica applies."""

from __future__ import annotations

import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from storage_support import msg, replay

from mqds.protocol.topics import matches
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.storage.limits import Doomed, LimitPolicy, LimitScan
from mqds.server.storage.shard import Engine, ShardStorage
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import storage_pb2 as pb

TOPICS = ["tel/1/t", "tel/2/t", "tel/3/h", "audit/x", "misc"]
FILTERS = ["tel/#", "tel/1/#", "tel/+/t", "audit/#", "#"]
N_SHARDS = 2


def run_pass(shard: ShardStorage, policy: LimitPolicy, budget: int) -> tuple[cpb.TrimMessages, list[LimitScan]]:
    """Every rule's pass, ``budget`` keys a call, as the leader runs them; the trim it would log."""
    doomed: Doomed = {}
    scans = []
    for rule in policy.rules:
        scan = LimitScan(rule, shard.last_ts)
        for _ in range(10_000):
            assert shard.limit_scan(policy, scan, budget, doomed) <= budget
            if scan.done:
                break
        assert scan.done
        scans.append(scan)
    command = cpb.TrimMessages()
    for (generation, stream), stamps in sorted(doomed.items()):
        command.streams.add(generation=generation, stream=stream, timestamps=stamps)
    return command, scans


def content(shard: ShardStorage) -> list[tuple[int, str, int]]:
    return sorted((r.ts, r.message.topic, len(r.message.payload)) for r in replay(shard, "#"))


def stored_size(message: pb.Message) -> int:
    """The size of a message as the shard keeps it (without the position a read adds)."""
    bare = pb.Message()
    bare.CopyFrom(message)
    bare.ClearField("timestamp_us")
    bare.ClearField("shard")
    return bare.ByteSize()


def expected(
    before: list[tuple[int, str, int]], rules: list[clpb.RetentionRule], sizes: dict[int, int]
) -> list[tuple[int, str, int]]:
    """What the limits keep, from first principles: newest first, each message counted for its first rule."""
    kept = []
    counts: dict[int, list[int]] = {}
    topics: dict[tuple[int, str], int] = {}
    for ts, topic, payload in sorted(before, reverse=True):
        index = next((i for i, r in enumerate(rules) if matches(r.topic_filter, topic)), -1)
        if index < 0:
            kept.append((ts, topic, payload))
            continue
        rule = rules[index]
        count = counts.setdefault(index, [0, 0])
        count[0] += 1
        count[1] += sizes[ts]
        per_topic = topics[(index, topic)] = topics.get((index, topic), 0) + 1
        most = max(1, rule.max_messages // N_SHARDS) if rule.max_messages else 0
        most_bytes = max(1, rule.max_bytes // N_SHARDS) if rule.max_bytes else 0
        over = (
            (most and count[0] > most)
            or (most_bytes and count[1] > most_bytes)
            or (rule.max_messages_per_topic and per_topic > rule.max_messages_per_topic)
        )
        if not over or rule.discard == clpb.RETENTION_DISCARD_NEW:
            kept.append((ts, topic, payload))
    return sorted(kept)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batches=st.lists(
        st.tuples(
            st.lists(st.tuples(st.sampled_from(TOPICS), st.integers(0, 40)), min_size=1, max_size=8), st.booleans()
        ),
        min_size=1,
        max_size=8,
    ),
    rules=st.lists(
        st.tuples(
            st.sampled_from(FILTERS),
            st.sampled_from([0, 2, 7, 30]),
            st.sampled_from([0, 150, 600]),
            st.sampled_from([0, 1, 3]),
            st.sampled_from([clpb.RETENTION_DISCARD_OLD, clpb.RETENTION_DISCARD_NEW]),
        ),
        max_size=3,
        unique_by=lambda r: r[0],
    ),
    budget=st.integers(1, 20),
)
def test_a_pass_finds_exactly_what_is_over_and_replicas_trim_alike(
    batches: list[tuple[list[tuple[str, int]], bool]],
    rules: list[tuple[str, int, int, int, int]],
    budget: int,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        leader = ShardStorage(f"{tmp}/a", 0, Engine())
        follower = ShardStorage(f"{tmp}/b", 0, Engine())
        try:
            now = 1
            for shard in (leader, follower):
                shard.initialize(1)
            for messages, rotate in batches:
                for shard in (leader, follower):
                    shard.store([msg(t, b"p" * n) for t, n in messages], now)
                    if rotate:
                        shard.add_generation(now + len(messages) + 1)
                now += len(messages) + 2
            policy_message = clpb.RetentionPolicy(
                rules=[
                    clpb.RetentionRule(
                        topic_filter=f,
                        max_messages=m,
                        max_bytes=b,
                        max_messages_per_topic=0 if d == clpb.RETENTION_DISCARD_NEW else p,  # as check_limits wants
                        discard=d,
                    )
                    for f, m, b, p, d in rules
                ]
            )
            policy = LimitPolicy(policy_message, N_SHARDS)
            before = content(leader)
            sizes = {r.ts: stored_size(r.message) for r in replay(leader, "#")}
            command, scans = run_pass(leader, policy, budget)
            for shard in (leader, follower):
                shard.trim_messages(command.streams)
            assert content(leader) == expected(before, list(policy_message.rules), sizes)
            assert list(leader.dump()) == list(follower.dump())
            # A discard=new pass counts what the rule holds up to its share, and trims nothing.
            for scan in scans:
                if scan.rule.discard_new:
                    held = [t for _, t, _ in before if policy.rule_of(t) == scan.rule.index]
                    assert scan.messages == min(len(held), scan.rule.max_messages or len(held)) or scan.reached
            # A second pass finds nothing more.
            again, _ = run_pass(leader, policy, budget)
            assert not again.streams
        finally:
            leader.close()
            follower.close()


def test_messages_stored_after_the_pass_began_are_neither_counted_nor_trimmed(shard: ShardStorage) -> None:
    shard.store([msg("tel/1/t") for _ in range(10)], 1_000)
    policy = LimitPolicy(clpb.RetentionPolicy(rules=[clpb.RetentionRule(topic_filter="tel/#", max_messages=8)]), 2)
    doomed: Doomed = {}
    scan = LimitScan(policy.rules[0], shard.last_ts)
    assert shard.limit_scan(policy, scan, 3, doomed) == 3
    shard.store([msg("tel/1/t") for _ in range(10)], 2_000)  # newer than the pass's top
    while not scan.done:
        shard.limit_scan(policy, scan, 3, doomed)
    assert scan.messages == 10
    command = cpb.TrimMessages()
    for (generation, stream), stamps in doomed.items():
        command.streams.add(generation=generation, stream=stream, timestamps=stamps)
    assert shard.trim_messages(command.streams).messages == 6  # 10 counted, 4 a shard kept
    assert len(replay(shard, "tel/#")) == 14
    # Applied again (a replayed log entry): nothing more goes.
    assert shard.trim_messages(command.streams).messages == 0
