"""The learned topic trie: thresholds, '$' levels, stability, determinism, and a match() that never misses."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqds.protocol.topics import matches, validate_filter, validate_topic
from mqds.server.storage.trie import DOLLAR_WILDCARD, END, WILDCARD, Learned, TopicTrie, filter_constraints


def learn(trie: TopicTrie, topic: str) -> Learned:
    return trie.learn(topic.split("/"), [])


def fill(pattern: str, varying: tuple[str, ...]) -> str:
    """The topic a stream's pattern stands for, given the topic's varying values."""
    values = iter(varying)
    topic = "/".join(next(values) if token in (WILDCARD, DOLLAR_WILDCARD) else token for token in pattern.split("/"))
    assert next(values, None) is None, "more varying values than '+' levels"
    return topic


def consistent(constraints: dict[int, str], varying: tuple[str, ...]) -> bool:
    return all(index < len(varying) and varying[index] == value for index, value in constraints.items())


def fitting(trie: TopicTrie, learned: dict[str, Learned], topic_filter: str) -> set[str]:
    """The learned topics a reader of match()'s streams and constraints would find."""
    found = streams_of(trie, topic_filter)
    return {t for t, item in learned.items() if item.stream in found and consistent(found[item.stream], item.varying)}


def streams_of(trie: TopicTrie, topic_filter: str) -> dict[int, dict[int, str]]:
    found = trie.match(topic_filter.split("/"))
    streams = [stream for stream, _ in found]
    assert len(streams) == len(set(streams)), f"match() returned a stream twice: {found}"
    return dict(found)


# -- construction --------------------------------------------------------------


@pytest.mark.parametrize(("top", "other"), [(0, 1), (1, 0), (-1, 5)])
def test_thresholds_must_be_positive(top: int, other: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        TopicTrie(threshold_top=top, threshold=other)


def test_new_edges_are_reported_in_creation_order() -> None:
    trie = TopicTrie(threshold_top=100, threshold=10)
    edges: list[tuple[int, str, int]] = []
    learned = trie.learn(["a", "b"], edges)
    assert edges == [(0, "a", 1), (1, "b", 2), (2, END, 3)]
    assert learned == Learned(stream=3, varying=())
    assert trie.next_node == 4
    again: list[tuple[int, str, int]] = []
    assert trie.learn(["a", "b"], again) == learned
    assert again == []
    trie.learn(["a", "c"], again)
    assert again == [(1, "c", 4), (4, END, 5)]
    assert trie.streams() == [3, 5]
    assert trie.pattern(3) == "a/b" and trie.pattern(5) == "a/c"


def test_parent_and_child_topics_are_distinct_streams() -> None:
    trie = TopicTrie(threshold_top=100, threshold=10)
    a = learn(trie, "a").stream
    ab = learn(trie, "a/b").stream
    a_empty = learn(trie, "a/").stream
    assert len({a, ab, a_empty}) == 3
    assert trie.pattern(a) == "a" and trie.pattern(ab) == "a/b" and trie.pattern(a_empty) == "a/"
    assert trie.is_stream(a) and not trie.is_stream(0) and not trie.is_stream(10_000)
    # The node for level 'a' is not a stream: it has no '#' edge pointing at it.
    with pytest.raises(KeyError):
        trie.pattern(1)


# -- thresholds ----------------------------------------------------------------


def test_threshold_grows_a_wildcard_edge_after_n_literal_values() -> None:
    trie = TopicTrie(threshold_top=100, threshold=3)
    literal = [learn(trie, f"s/{i}/t") for i in range(3)]
    assert len({item.stream for item in literal}) == 3
    assert all(item.varying == () for item in literal)
    assert [trie.pattern(item.stream) for item in literal] == ["s/0/t", "s/1/t", "s/2/t"]
    fourth = learn(trie, "s/3/t")
    assert fourth.varying == ("3",)
    assert trie.pattern(fourth.stream) == "s/+/t"
    for i in range(4, 50):
        later = learn(trie, f"s/{i}/t")
        assert later == Learned(fourth.stream, (str(i),))
    # Values learned before the wildcard keep their own streams.
    assert [learn(trie, f"s/{i}/t") for i in range(3)] == literal
    assert len(trie.streams()) == 4


def test_threshold_counts_distinct_values_not_topics() -> None:
    trie = TopicTrie(threshold_top=100, threshold=2)
    for _ in range(5):
        assert learn(trie, "s/a").varying == ()
        assert learn(trie, "s/a/deeper").varying == ()
    assert learn(trie, "s/b").varying == ()
    assert learn(trie, "s/c").varying == ("c",)


def test_a_wildcard_node_learns_its_own_children() -> None:
    trie = TopicTrie(threshold_top=100, threshold=1)
    assert learn(trie, "s/0/x").varying == ()
    # Level 1 is full (1 literal): new ids go through '+', level 2 below '+' starts empty.
    first = learn(trie, "s/1/y")
    assert first.varying == ("1",)
    assert trie.pattern(first.stream) == "s/+/y"
    second = learn(trie, "s/2/z")
    assert second.varying == ("2", "z")
    assert trie.pattern(second.stream) == "s/+/+"
    # A topic that follows the literal 'y' edge below '+' stays on it.
    assert learn(trie, "s/3/y") == Learned(first.stream, ("3",))


def test_top_level_threshold_is_separate() -> None:
    trie = TopicTrie(threshold_top=2, threshold=4)
    assert learn(trie, "a/0").varying == ()
    assert learn(trie, "b").varying == ()
    third = learn(trie, "c")
    assert third.varying == ("c",)
    assert trie.pattern(third.stream) == "+"
    # Below the top level the other threshold (4) applies.
    for i in range(1, 4):
        assert learn(trie, f"a/{i}").varying == ()
    assert learn(trie, "a/4").varying == ("4",)

    roomy = TopicTrie(threshold_top=5, threshold=1)
    for name in "abcde":
        assert learn(roomy, f"{name}/x").varying == ()
    assert learn(roomy, "f/x").varying == ("f",)
    assert learn(roomy, "a/y").varying == ("y",)


def test_empty_levels_are_values_like_any_other() -> None:
    trie = TopicTrie(threshold_top=100, threshold=1)
    assert learn(trie, "a//b").varying == ()
    other = learn(trie, "a/x/b")
    assert other.varying == ("x",)
    assert learn(trie, "a//b").varying == ()
    assert learn(trie, "a/y/b") == Learned(other.stream, ("y",))


# -- '$' first levels ----------------------------------------------------------


def test_dollar_first_levels_never_take_the_wildcard_and_are_not_matched_by_leading_wildcards() -> None:
    trie = TopicTrie(threshold_top=1, threshold=1)
    a = learn(trie, "a/x")
    b = learn(trie, "b/x")
    assert a.varying == () and b.varying == ("b",)
    dollar_topics = ("$SYS/x", "$SYS/y", "$foo/x", "$/x")
    dollar = {t: learn(trie, t) for t in dollar_topics}
    # '$' first levels have a threshold of their own (threshold_top), then their own wildcard '$+'.
    assert dollar["$SYS/x"].varying == () and trie.pattern(dollar["$SYS/x"].stream) == "$SYS/x"
    for topic in ("$foo/x", "$/x"):
        assert dollar[topic].varying == (topic.split("/")[0],), topic
        assert trie.pattern(dollar[topic].stream) == "$+/x"
    # Below a '$' level the usual threshold applies.
    assert dollar["$SYS/y"].varying == ("y",)
    dollar_streams = {item.stream for item in dollar.values()}
    for topic_filter in ("#", "+/#", "+/x", "+/+", "+/y"):
        assert not dollar_streams & set(streams_of(trie, topic_filter)), topic_filter
    assert set(streams_of(trie, "#")) == {a.stream, b.stream}
    learned = {"a/x": a, "b/x": b, **dollar}
    assert fitting(trie, learned, "#") == {"a/x", "b/x"}
    assert fitting(trie, learned, "+/x") == {"a/x", "b/x"}
    assert fitting(trie, learned, "$SYS/#") == {"$SYS/x", "$SYS/y"}
    assert fitting(trie, learned, "$SYS/x") == {"$SYS/x"}
    assert fitting(trie, learned, "$/#") == {"$/x"}
    assert fitting(trie, learned, "$foo/+") == {"$foo/x"}
    assert streams_of(trie, "$SYS/x")[dollar["$SYS/x"].stream] == {}
    # '$' is only special at the first level.
    assert learn(trie, "a/$x").varying == ("$x",)


# -- reading -------------------------------------------------------------------


def test_match_returns_constraints_on_varying_levels() -> None:
    trie = TopicTrie(threshold_top=100, threshold=2)
    for i in range(5):
        learn(trie, f"s/{i}/t")
    wild = learn(trie, "s/99/t").stream
    assert trie.match(["s", "3", "t"]) == [(wild, {0: "3"})]
    assert streams_of(trie, "s/0/t") == {learn(trie, "s/0/t").stream: {}, wild: {0: "0"}}
    assert streams_of(trie, "s/+/t")[wild] == {}
    assert streams_of(trie, "s/7/#") == {wild: {0: "7"}}
    assert streams_of(trie, "s/+/u") == {}
    assert streams_of(trie, "s") == {}
    assert len(streams_of(trie, "s/#")) == 3
    assert sorted(trie.pattern(s) for s in streams_of(trie, "#")) == ["s/+/t", "s/0/t", "s/1/t"]


def test_match_with_hash_includes_the_parent_topic() -> None:
    trie = TopicTrie(threshold_top=100, threshold=10)
    a = learn(trie, "a").stream
    ab = learn(trie, "a/b").stream
    abc = learn(trie, "a/b/c").stream
    assert set(streams_of(trie, "a/#")) == {a, ab, abc}
    assert set(streams_of(trie, "a/b/#")) == {ab, abc}
    assert set(streams_of(trie, "a/+")) == {ab}
    assert set(streams_of(trie, "a/+/#")) == {ab, abc}


@pytest.mark.parametrize(
    ("pattern", "topic_filter", "expected"),
    [
        ("sensor/+/temp", "sensor/42/#", {0: "42"}),
        ("sensor/+/temp", "sensor/+/temp", {}),
        ("sensor/+/temp", "sensor/42/temp", {0: "42"}),
        ("sensor/+/temp", "sensor/+/hum", None),
        ("sensor/+/temp", "sensor/+", None),
        ("sensor/+/temp", "sensor/+/temp/x", None),
        ("+/+/x", "a/b/x", {0: "a", 1: "b"}),
        ("+/+/x", "+/b/#", {1: "b"}),
        ("+/+/x", "#", {}),
        ("a", "a/#", {}),
        ("a", "#", {}),
        ("a", "+", {}),
        ("a", "a/+", None),
        ("a//b", "a/+/b", {}),
        ("a/+/b", "a//b", {0: ""}),
        ("$SYS/x", "#", None),
        ("$SYS/x", "+/x", None),
        ("$SYS/x", "$SYS/#", {}),
        ("$SYS/+", "$SYS/up", {0: "up"}),
    ],
)
def test_filter_constraints(pattern: str, topic_filter: str, expected: dict[int, str] | None) -> None:
    assert filter_constraints(pattern, topic_filter.split("/")) == expected


# -- determinism and stability ------------------------------------------------


def _sensor_topics(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kind = rng.choice(["sensor", "sensor", "actuator", "$SYS", "x"])
        depth = rng.randint(0, 3)
        levels = [kind] + [rng.choice(["", "a", "b", str(rng.randint(0, 30))]) for _ in range(depth)]
        out.append("/".join(levels))
    return out


def test_two_tries_fed_the_same_topics_agree() -> None:
    topics = _sensor_topics(500, seed=7)
    first, second = TopicTrie(3, 2), TopicTrie(3, 2)
    edges_1: list[tuple[int, str, int]] = []
    edges_2: list[tuple[int, str, int]] = []
    learned_1 = [first.learn(t.split("/"), edges_1) for t in topics]
    learned_2 = [second.learn(t.split("/"), edges_2) for t in topics]
    assert learned_1 == learned_2
    assert edges_1 == edges_2
    assert len(edges_1) > 50
    # Node ids are handed out in creation order, without gaps.
    assert [child for _, _, child in edges_1] == list(range(1, len(edges_1) + 1))
    assert first.next_node == second.next_node == len(edges_1) + 1
    assert first.streams() == second.streams()


def test_forget_undoes_learning_exactly() -> None:
    topics = _sensor_topics(300, seed=5)
    trie, reference = TopicTrie(3, 2), TopicTrie(3, 2)
    for topic in topics[:150]:
        learn(trie, topic)
        learn(reference, topic)
    # A batch whose write failed: learned, then forgotten.
    failed: list[tuple[int, str, int]] = []
    for topic in topics[150:]:
        trie.learn(topic.split("/"), failed)
    assert failed
    trie.forget(failed)
    assert trie.next_node == reference.next_node
    assert trie.streams() == reference.streams()
    # Learning the rest afterwards gives the same ids as never having failed.
    assert [learn(trie, t) for t in topics[150:]] == [learn(reference, t) for t in topics[150:]]


def test_restore_edge_in_any_order_rebuilds_an_identical_trie() -> None:
    topics = _sensor_topics(400, seed=11)
    original = TopicTrie(4, 3)
    edges: list[tuple[int, str, int]] = []
    learned = {t: original.learn(t.split("/"), edges) for t in topics}
    shuffled = list(edges)
    random.Random(3).shuffle(shuffled)
    restored = TopicTrie(4, 3)
    for parent, token, child in shuffled:
        restored.restore_edge(parent, token, child)
    assert restored.next_node == original.next_node
    assert restored._children == original._children
    assert restored._literal_count == original._literal_count
    assert restored._parent == original._parent
    assert restored.streams() == original.streams()
    assert [restored.pattern(s) for s in restored.streams()] == [original.pattern(s) for s in original.streams()]
    none: list[tuple[int, str, int]] = []
    assert {t: restored.learn(t.split("/"), none) for t in topics} == learned
    assert none == []
    for topic_filter in ("#", "sensor/#", "+/a/#", "sensor/+/b", "$SYS/#", "x/+"):
        assert streams_of(restored, topic_filter) == streams_of(original, topic_filter)
    # Both go on learning the same way.
    more = _sensor_topics(200, seed=12)
    new_1: list[tuple[int, str, int]] = []
    new_2: list[tuple[int, str, int]] = []
    assert [original.learn(t.split("/"), new_1) for t in more] == [restored.learn(t.split("/"), new_2) for t in more]
    assert new_1 == new_2


# -- properties ----------------------------------------------------------------

LEVELS = ["", "a", "b", "c", "d", "$SYS", "$q"]
topic_strategy = st.lists(st.sampled_from(LEVELS), min_size=1, max_size=4).map("/".join).filter(lambda t: t != "")


@st.composite
def filter_strategy(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.sampled_from([*LEVELS, "+", "+"]), min_size=0, max_size=4))
    if levels in ([], [""]) or draw(st.booleans()):
        levels.append("#")
    return "/".join(levels)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(topic_strategy, min_size=1, max_size=40),
    st.integers(min_value=1, max_value=3),
    st.integers(min_value=1, max_value=3),
    st.lists(filter_strategy(), min_size=1, max_size=8),
)
def test_match_never_misses_and_constraints_fit(
    topics: list[str], threshold_top: int, threshold: int, topic_filters: list[str]
) -> None:
    trie = TopicTrie(threshold_top=threshold_top, threshold=threshold)
    learned: dict[str, Learned] = {}
    for topic in topics:
        validate_topic(topic)
        item = learn(trie, topic)
        assert learned.setdefault(topic, item) == item, "a topic moved to another stream"
        # The pattern with the varying values filled in is the topic itself.
        assert fill(trie.pattern(item.stream), item.varying) == topic
        if topic.startswith("$"):
            assert trie.pattern(item.stream).split("/")[0] in (topic.split("/")[0], DOLLAR_WILDCARD)
        else:
            assert trie.pattern(item.stream).split("/")[0] != DOLLAR_WILDCARD
    # Learning everything again changes nothing: topics keep their streams.
    edges: list[tuple[int, str, int]] = []
    for topic, item in learned.items():
        assert trie.learn(topic.split("/"), edges) == item
    assert edges == []
    for topic_filter in topic_filters:
        validate_filter(topic_filter)
        found = streams_of(trie, topic_filter)
        for stream, constraints in found.items():
            assert trie.is_stream(stream)
            # match() and filter_constraints() agree on every stream returned.
            assert filter_constraints(trie.pattern(stream), topic_filter.split("/")) == constraints
        for stream in trie.streams():
            if stream not in found:
                assert filter_constraints(trie.pattern(stream), topic_filter.split("/")) is None
        for topic, item in learned.items():
            hit = item.stream in found and consistent(found[item.stream], item.varying)
            # Never misses: every matching topic is found, with constraints its varying values meet.
            if matches(topic_filter, topic):
                assert item.stream in found, (topic_filter, topic, trie.pattern(item.stream))
                assert consistent(found[item.stream], item.varying), (topic_filter, topic, found[item.stream])
            # And the stream plus constraints are exact: no topic that fails the filter fits them.
            assert hit is matches(topic_filter, topic), (topic_filter, topic)
