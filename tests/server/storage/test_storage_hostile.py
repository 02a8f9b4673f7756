"""Hostile topics against the storage layer: deep topics and filters, many '$' first levels, trie reclaiming."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mqds.protocol.topics import MAX_TOPIC_BYTES, matches, validate_filter, validate_topic
from mqds.server.storage import keys
from mqds.server.storage.sessions import FetchFilter
from mqds.server.storage.shard import Engine, ShardStorage
from mqds.server.storage.trie import TopicTrie
from mqds.v1 import storage_pb2 as pb

DEEP = 1_500


SHARD_NUMBER = 5  # the conftest shard fixture opens this shard


@contextmanager
def shallow_stack(frames: int = 150) -> Iterator[None]:
    """Allow only ``frames`` more Python frames than the caller has: recursion on input depth fails at once."""
    depth = 0
    frame = sys._getframe()
    while frame is not None:
        depth += 1
        frame = frame.f_back  # type: ignore[assignment]
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + frames)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def msg(topic: str, payload: str = "p") -> pb.Message:
    return pb.Message(topic=topic, payload=payload.encode(), sender="s", qos=1)


def deep_topic(depth: int = DEEP) -> str:
    return "/".join(f"l{i}" for i in range(depth))


def queue(topic_filter: str) -> FetchFilter:
    return FetchFilter(
        topic_filter=topic_filter, after_us=0, since_us=0, max_count=100, include_qos0=False, skip_acked=True
    )


# -- deep topics and filters ------------------------------------------------------


def test_a_deep_topic_is_stored_matched_and_queue_acknowledged(shard: ShardStorage) -> None:
    topic = deep_topic()
    validate_topic(topic)
    plus = "/".join(["+"] * DEEP)
    for topic_filter in (topic, "#", plus, "l0/#", plus[:-1] + "#"):
        assert validate_filter(topic_filter)
        assert matches(topic_filter, topic)
    first = shard.store([msg(topic, "a"), msg(topic, "b")], 10)
    with shallow_stack():
        for topic_filter in (topic, "#", plus, "l0/#"):
            refs = shard.get_streams(topic_filter.split("/"), 0)
            assert len(refs) == 1, topic_filter
            assert shard.trie.pattern(refs[0].stream) == topic
        # A queue acknowledgement with the deep topic as its filter, as a replica applies it.
        shard.sessions.ack_queue(first, topic, applied_index=7)
    assert shard.applied_index == 7
    assert shard.sessions.queue_floor(topic) == first
    assert [ts for ts, _ in shard.sessions.fetch(queue(topic))] == [first + 1]
    assert [ts for ts, _ in shard.sessions.fetch(queue(plus))] == [first + 1]
    everything = FetchFilter(plus, after_us=0, since_us=0, max_count=10, include_qos0=True, skip_acked=False)
    assert [ts for ts, _ in shard.sessions.fetch(everything)] == [first, first + 1]


def test_deep_filters_over_a_wide_trie_match_without_recursion() -> None:
    trie = TopicTrie(threshold_top=100, threshold=2)
    topics = [deep_topic(DEEP), deep_topic(DEEP - 1) + "/x", "a/b", "$SYS/" + deep_topic(DEEP - 1)]
    streams = [trie.learn(t.split("/"), []).stream for t in topics]
    with shallow_stack():
        assert [s for s, _ in trie.match(topics[0].split("/"))] == [streams[0]]
        assert {s for s, _ in trie.match(["#"])} == set(streams[:3])
        assert [s for s, _ in trie.match(["+"] * DEEP)] == streams[:2]
        assert [s for s, _ in trie.match(["$SYS", *["+"] * (DEEP - 1)])] == [streams[3]]
        assert trie.match(["+"] * (DEEP + 1)) == []


def test_the_deepest_valid_topic_and_filter_work(shard: ShardStorage) -> None:
    # 65,535 bytes of '/' is a valid topic of 65,536 empty levels.
    topic = "/" * MAX_TOPIC_BYTES
    validate_topic(topic)
    validate_filter(topic)
    shard.store([msg(topic)], 10)
    with shallow_stack():
        refs = shard.get_streams(topic.split("/"), 0)
        assert len(refs) == 1
        assert len(shard.get_streams(["#"], 0)) == 1
        state = shard.make_iterator(refs[0].generation, refs[0].stream, topic, 0)
        assert len(shard.next(state, 10).entries) == 1


# -- '$' first levels ---------------------------------------------------------------


def test_many_dollar_first_levels_keep_the_trie_bounded(shard: ShardStorage) -> None:
    n = 50_000
    for start in range(0, n, 1_000):
        shard.store([msg(f"$x{i}/a") for i in range(start, start + 1_000)], 10 + start)
    streams = shard.trie.streams()
    nodes = sum(1 for cf, key, _ in shard.dump() if cf == "default" and key.startswith(keys.TRIE_PREFIX))
    assert len(streams) <= 2 * shard.trie.threshold_top, len(streams)
    assert nodes <= 4 * shard.trie.threshold_top, nodes
    # And filters still see exactly the right ones.
    for topic_filter, expected in (("$x49999/a", 1), ("$x7/#", 1), ("$x1/+", 1), ("$y/a", 0)):
        got = [pb.Message.FromString(stored).topic for _, stored in shard.sessions.fetch(queue(topic_filter))]
        assert len(got) == expected, topic_filter
        assert all(matches(topic_filter, t) for t in got)
    for topic_filter in ("#", "+/a", "+/#", "+/+"):
        assert shard.get_streams(topic_filter.split("/"), 0) == [], topic_filter
    shard.store([msg("plain/a")], 100_000)
    assert [ref.pattern for ref in shard.get_streams(["#"], 0)] == ["plain/a"]


def test_dollar_first_levels_get_their_own_wildcard_bucket() -> None:
    trie = TopicTrie(threshold_top=2, threshold=2)
    plain = trie.learn(["p", "x"], [])
    a = trie.learn(["$a", "x"], [])
    b = trie.learn(["$b", "x"], [])
    c = trie.learn(["$c", "x"], [])
    d = trie.learn(["$d", "x"], [])
    assert a.varying == b.varying == () and c.varying == ("$c",) and d.varying == ("$d",)
    assert c.stream == d.stream != plain.stream
    assert trie.pattern(c.stream) == "$+/x"
    assert trie.pattern(c.stream).split("/")[0] != "+"
    assert trie.match(["$d", "x"]) == [(c.stream, {0: "$d"})]
    assert trie.match(["$a", "x"]) == [(a.stream, {}), (c.stream, {0: "$a"})]
    assert trie.match(["p", "x"]) == [(plain.stream, {})]
    for leading_wildcard in (["#"], ["+", "x"], ["+", "#"]):
        assert [s for s, _ in trie.match(leading_wildcard)] == [plain.stream]


# -- retention reclaims the trie --------------------------------------------------------


def test_dropping_a_generation_removes_the_streams_only_it_used(tmp_path: Path, engine: Engine) -> None:
    path = str(tmp_path / "s")
    storage = ShardStorage(path, 0, engine, lts_threshold_top=100, lts_threshold=3)
    try:
        storage.initialize(1)
        storage.store([msg(f"old/{i}/t") for i in range(20)] + [msg("both/x")], 10)
        storage.add_generation(100)
        storage.store([msg("both/x"), msg("new/y")], 200)
        before = storage.trie.next_node
        storage.drop_generation(1, applied_index=9)
        assert sorted(storage.trie.pattern(s) for s in storage.trie.streams()) == ["both/x", "new/y"]
        edges = [key for cf, key, _ in storage.dump() if cf == "default" and key.startswith(keys.TRIE_PREFIX)]
        assert len(edges) == 6  # both, x, #, new, y, #
        assert storage.trie.next_node == before  # ids are never handed out again
        # What was dropped can come back, as new streams.
        storage.store([msg("old/1/t")], 300)
        (ref,) = storage.get_streams(["old", "1", "t"], 0)
        assert ref.stream >= before and ref.pattern == "old/1/t"
        dump = list(storage.dump())
        storage.close()
        storage = ShardStorage(path, 0, engine)
        assert list(storage.dump()) == dump
        assert storage.trie.next_node == before + 4
    finally:
        storage.close()
