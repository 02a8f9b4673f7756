"""The leader's figures for discard=new retention rules, and which messages of a store they refuse."""

from __future__ import annotations

from mqds.protocol.errors import Reason
from mqds.server.cluster.store_limits import StoreLimits
from mqds.server.storage.limits import LimitPolicy
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import storage_pb2 as pb

NEW = clpb.RETENTION_DISCARD_NEW


def limits(max_messages: int = 0, max_bytes: int = 0) -> StoreLimits:
    policy = clpb.RetentionPolicy(
        rules=[
            clpb.RetentionRule(topic_filter="quiet/#"),
            clpb.RetentionRule(topic_filter="b/#", max_messages=max_messages, max_bytes=max_bytes, discard=NEW),
            clpb.RetentionRule(topic_filter="old/#", max_messages=1),  # discard old: never refuses
        ]
    )
    store_limits = StoreLimits()
    store_limits.set_policy(LimitPolicy(policy, 2))
    return store_limits


def part(*topics: str) -> list[tuple[int, pb.Message]]:
    return [(i, pb.Message(topic=t, payload=b"x" * 10, sender="s")) for i, t in enumerate(topics)]


def test_a_store_over_the_share_is_refused_once_a_pass_counted_the_shard() -> None:
    store_limits = limits(max_messages=8)  # 4 a shard
    # Before the leader's first pass: admitted (the figure is not known).
    assert store_limits.refused(0, part("b/1", "b/1")) == {}
    store_limits.pass_began(0, 1, term=3)
    assert store_limits.refused(0, part("b/2")) == {}  # admitted while the pass runs: counted
    store_limits.pass_done(0, 1, 3, messages=2, size=0)
    assert store_limits.figure(0, 1) == (3, 20)  # a message is 20 bytes
    # One more fits; then the rule's messages are refused, and every later one of the part; others go on.
    refused = store_limits.refused(0, part("b/3", "quiet/x", "b/4", "old/y", "b/5"))
    assert sorted(refused) == [2, 4]
    reason, text = refused[2]
    assert reason is Reason.LIMIT_REACHED
    assert "retention rule 2 ('b/#') with discard=new: shard 0 holds 4 messages of its share of 4" in text
    assert "(max_msgs=8 over 2 shards)" in text
    assert store_limits.figure(0, 1) == (4, 40)
    # Another shard has a figure of its own; a lost lead forgets the shard's.
    assert store_limits.refused(1, part("b/1")) == {}
    store_limits.forget(0)
    assert store_limits.figure(0, 1) is None
    assert store_limits.refused(0, part("b/6")) == {}


def test_bytes_count_and_a_new_policy_forgets_the_figures() -> None:
    store_limits = limits(max_bytes=60)  # 30 bytes a shard
    store_limits.pass_began(0, 1, term=1)
    store_limits.pass_done(0, 1, 1, messages=1, size=5)
    assert store_limits.refused(0, part("b/1")) == {}  # 25 bytes of 30
    refused = store_limits.refused(0, part("b/1"))
    assert list(refused) == [0] and "holds 25 bytes of its share of 30 (max_bytes=60 over 2 shards)" in refused[0][1]
    store_limits.set_policy(None)
    assert store_limits.figure(0, 1) is None
    assert store_limits.refused(0, part("b/1", "b/1", "b/1")) == {}
