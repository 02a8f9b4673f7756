"""MQTT topic names and filters: validation and matching, checked against a reference matcher."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqds.protocol.topics import (
    MAX_TOPIC_BYTES,
    TopicError,
    is_wildcard_filter,
    matches,
    matches_levels,
    validate_filter,
    validate_topic,
)

# -- a reference matcher, written from the MQTT 5 rules (section 4.7) ----------


def _ref_levels(f: list[str], t: list[str]) -> bool:
    """Does the rest of the filter ``f`` match the rest of the topic ``t``?"""
    if not f:
        return not t
    head = f[0]
    if head == "#":
        # '#' is the last level and matches zero or more levels, so the parent too.
        return True
    if not t:
        return False
    if head == "+" or head == t[0]:
        return _ref_levels(f[1:], t[1:])
    return False


def reference_matches(topic_filter: str, topic: str) -> bool:
    f = topic_filter.split("/")
    t = topic.split("/")
    if f[0] in ("+", "#") and t[0].startswith("$"):
        return False
    return _ref_levels(f, t)


def reference_filter_is_valid(text: str) -> bool:
    if text == "" or "\x00" in text:
        return False
    levels = text.split("/")
    for i, level in enumerate(levels):
        if level == "#":
            if i != len(levels) - 1:
                return False
        elif level != "+" and ("+" in level or "#" in level):
            return False
    return True


def reference_topic_is_valid(text: str) -> bool:
    return text != "" and "\x00" not in text and "+" not in text and "#" not in text


# -- strategies ----------------------------------------------------------------

TOPIC_LEVELS = ["", "a", "b", "ab", "$SYS", "$x", "é"]
FILTER_LEVELS = [*TOPIC_LEVELS, "+"]

topic_levels = st.lists(st.sampled_from(TOPIC_LEVELS), min_size=1, max_size=5).filter(lambda ls: ls != [""])
topics = topic_levels.map("/".join).filter(lambda t: t != "")


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.sampled_from(FILTER_LEVELS), min_size=0, max_size=5))
    if draw(st.booleans()) or not levels:
        levels.append("#")
    text = "/".join(levels)
    return text if text else "#"


# -- validation: topic names ---------------------------------------------------


@pytest.mark.parametrize("topic", ["a", "a/b", "/", "a//b", "/a/", "$SYS/uptime", "sensor/42/temp", "é/ü", " ", "a b"])
def test_valid_topics(topic: str) -> None:
    validate_topic(topic)


@pytest.mark.parametrize(
    ("topic", "words"),
    [
        ("", "must not be empty"),
        ("a/+/b", "wildcards"),
        ("a/#", "wildcards"),
        ("+", "wildcards"),
        ("#", "wildcards"),
        ("a+b", "wildcards"),
        ("a\x00b", "NUL"),
        ("\x00", "NUL"),
        ("a/\udc80", "not valid UTF-8"),
        ("\ud800", "not valid UTF-8"),
    ],
)
def test_invalid_topics_name_the_problem(topic: str, words: str) -> None:
    with pytest.raises(TopicError) as info:
        validate_topic(topic)
    assert words in str(info.value)
    assert str(info.value).startswith(("topic", "invalid topic"))


def test_topic_error_is_a_value_error() -> None:
    assert issubclass(TopicError, ValueError)
    with pytest.raises(ValueError):
        validate_topic("")


def test_non_string_topic_is_rejected() -> None:
    with pytest.raises(TopicError, match="must be a string, not bytes"):
        validate_topic(b"a/b")  # type: ignore[arg-type]
    with pytest.raises(TopicError, match="must be a string, not NoneType"):
        validate_filter(None)  # type: ignore[arg-type]


def test_topic_length_limit_is_in_utf8_bytes() -> None:
    assert MAX_TOPIC_BYTES == 65_535
    validate_topic("a" * MAX_TOPIC_BYTES)
    with pytest.raises(TopicError, match="65536 bytes, over the MQTT limit of 65535"):
        validate_topic("a" * (MAX_TOPIC_BYTES + 1))
    # 32,768 two-byte characters: short in characters, too long in bytes.
    text = "é" * 32_768
    assert len(text) < MAX_TOPIC_BYTES
    with pytest.raises(TopicError, match="65536 bytes"):
        validate_topic(text)
    validate_topic("é" * 32_767 + "a")  # exactly 65,535 bytes
    # The same limit applies to filters.
    validate_filter("a" * (MAX_TOPIC_BYTES - 2) + "/#")
    with pytest.raises(TopicError, match="over the MQTT limit"):
        validate_filter("a" * MAX_TOPIC_BYTES + "/#")


# -- validation: topic filters -------------------------------------------------


@pytest.mark.parametrize(
    ("topic_filter", "levels"),
    [
        ("#", ["#"]),
        ("+", ["+"]),
        ("a/#", ["a", "#"]),
        ("a/+/b", ["a", "+", "b"]),
        ("+/+", ["+", "+"]),
        ("/", ["", ""]),
        ("a//#", ["a", "", "#"]),
        ("$SYS/#", ["$SYS", "#"]),
        ("sensor/42/temp", ["sensor", "42", "temp"]),
    ],
)
def test_valid_filters_return_their_levels(topic_filter: str, levels: list[str]) -> None:
    assert validate_filter(topic_filter) == levels


@pytest.mark.parametrize(
    ("topic_filter", "words"),
    [
        ("a/#/b", "'#' must be the last level"),
        ("#/a", "'#' must be the last level"),
        ("#/", "'#' must be the last level"),
        ("a+", "wildcard in level 'a+' must occupy the whole level"),
        ("+a/b", "wildcard in level '+a' must occupy the whole level"),
        ("#a", "wildcard in level '#a' must occupy the whole level"),
        ("a/b#", "wildcard in level 'b#' must occupy the whole level"),
        ("a/++", "wildcard in level '++' must occupy the whole level"),
        ("", "must not be empty"),
        ("a/\x00", "NUL"),
        ("\udfff/#", "not valid UTF-8"),
    ],
)
def test_invalid_filters_name_the_problem(topic_filter: str, words: str) -> None:
    with pytest.raises(TopicError) as info:
        validate_filter(topic_filter)
    message = str(info.value)
    assert words in message
    assert "topic filter" in message


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab/+#$\x00", max_size=10))
def test_filter_validation_agrees_with_reference(text: str) -> None:
    expected = reference_filter_is_valid(text)
    try:
        levels = validate_filter(text)
    except TopicError:
        assert not expected, text
    else:
        assert expected, text
        assert levels == text.split("/")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab/+#$\x00", max_size=10))
def test_topic_validation_agrees_with_reference(text: str) -> None:
    expected = reference_topic_is_valid(text)
    try:
        validate_topic(text)
    except TopicError:
        assert not expected, text
    else:
        assert expected, text


# -- matching ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        ("sensor/+/temp", "sensor/42/temp", True),
        ("sensor/+/temp", "sensor/42/hum", False),
        ("sensor/+/temp", "sensor/temp", False),
        ("sensor/+/temp", "sensor/1/2/temp", False),
        ("+", "a", True),
        ("+", "a/b", False),
        ("+", "/", False),
        ("+/+", "/", True),
        ("+/+", "a", False),
        ("/+", "/a", True),
        ("/+", "a", False),
        # '#' matches the rest, including the parent level.
        ("a/#", "a", True),
        ("a/#", "a/b", True),
        ("a/#", "a/b/c", True),
        ("a/#", "a/", True),
        ("a/#", "ab", False),
        ("a/b/#", "a", False),
        ("#", "a/b/c", True),
        ("#", "/", True),
        # Empty levels are real levels.
        ("a//b", "a//b", True),
        ("a//b", "a/b", False),
        ("a/+/b", "a//b", True),
        ("a/+", "a/", True),
        ("a/+", "a", False),
        ("a/b", "a/b/", False),
        ("a", "a", True),
        ("a", "A", False),
        # Topics whose first level starts with '$' are not matched by a leading wildcard.
        ("#", "$SYS/uptime", False),
        ("#", "$", False),
        ("+/uptime", "$SYS/uptime", False),
        ("+/#", "$SYS", False),
        ("+", "$SYS", False),
        ("$SYS/#", "$SYS/uptime", True),
        ("$SYS/#", "$SYS", True),
        ("$SYS/+", "$SYS/uptime", True),
        ("$SYS/uptime", "$SYS/uptime", True),
        # Only the first level is special.
        ("a/+", "a/$x", True),
        ("a/#", "a/$SYS/x", True),
        ("#", "a$/b", True),
        ("#", "x/$SYS", True),
    ],
)
def test_matches_examples(topic_filter: str, topic: str, expected: bool) -> None:
    validate_filter(topic_filter)
    validate_topic(topic)
    assert matches(topic_filter, topic) is expected
    assert matches_levels(topic_filter.split("/"), topic.split("/")) is expected
    assert reference_matches(topic_filter, topic) is expected


@settings(max_examples=500, deadline=None)
@given(filters(), topics)
def test_matches_agrees_with_reference(topic_filter: str, topic: str) -> None:
    validate_filter(topic_filter)
    validate_topic(topic)
    expected = reference_matches(topic_filter, topic)
    assert matches(topic_filter, topic) is expected
    assert matches_levels(topic_filter.split("/"), topic.split("/")) is expected


def _all_level_lists(alphabet: list[str], max_levels: int) -> list[list[str]]:
    """Every list of 0..max_levels levels drawn from the alphabet."""
    return [list(levels) for n in range(max_levels + 1) for levels in itertools.product(alphabet, repeat=n)]


def test_matches_agrees_with_reference_exhaustively_for_short_topics() -> None:
    """Every filter and topic of up to 2 levels (3 for filters ending in '#') from a small alphabet."""
    alphabet = ["", "a", "$SYS", "$"]
    all_topics = ["/".join(ls) for ls in _all_level_lists(alphabet, 2) if ls and ls != [""]]
    all_filters = ["/".join(ls) for ls in _all_level_lists([*alphabet, "+"], 2) if ls and ls != [""]]
    all_filters += ["/".join([*ls, "#"]) for ls in _all_level_lists([*alphabet, "+"], 2)]
    assert len(all_topics) == 4 + 16 - 1
    assert len(all_filters) == (5 + 25 - 1) + (1 + 5 + 25)
    n_matching = 0
    for topic_filter in all_filters:
        validate_filter(topic_filter)
        for topic in all_topics:
            validate_topic(topic)
            expected = reference_matches(topic_filter, topic)
            n_matching += expected
            assert matches(topic_filter, topic) is expected, (topic_filter, topic)
    assert 0 < n_matching < len(all_filters) * len(all_topics)


@settings(max_examples=300, deadline=None)
@given(topic_levels, st.data())
def test_filters_derived_from_a_topic_match_it(levels: list[str], data: st.DataObject) -> None:
    """Replacing levels by '+' or a tail by '#' keeps a match, except a leading wildcard on '$' topics."""
    topic = "/".join(levels)
    assert matches(topic, topic)
    f = [data.draw(st.sampled_from([level, "+"])) for level in levels]
    cut = data.draw(st.integers(min_value=0, max_value=len(f)))
    if data.draw(st.booleans()):
        f = [*f[:cut], "#"]
    topic_filter = "/".join(f)
    validate_filter(topic_filter)
    dollar_excluded = f[0] in ("+", "#") and levels[0].startswith("$")
    assert matches(topic_filter, topic) is (not dollar_excluded)


@settings(max_examples=300, deadline=None)
@given(topics, topics)
def test_a_topic_as_a_filter_matches_only_itself(a: str, b: str) -> None:
    assert matches(a, b) is (a == b)


@settings(max_examples=300, deadline=None)
@given(topics)
def test_hash_matches_every_topic_not_starting_with_dollar(topic: str) -> None:
    assert matches("#", topic) is (not topic.startswith("$"))


def test_is_wildcard_filter() -> None:
    assert is_wildcard_filter("#")
    assert is_wildcard_filter("a/+/b")
    assert is_wildcard_filter("a/#")
    assert not is_wildcard_filter("a/b")
    assert not is_wildcard_filter("/")


def test_the_deepest_topics_and_filters_validate_and_match_without_recursion() -> None:
    # No cap on levels beyond the size: 65,535 bytes of '/' are 65,536 empty levels.
    deepest = "/" * MAX_TOPIC_BYTES
    plus = "/".join(["+"] * (MAX_TOPIC_BYTES // 2 + 1))
    validate_topic(deepest)
    assert len(validate_filter(deepest)) == MAX_TOPIC_BYTES + 1
    assert len(validate_filter(plus)) == MAX_TOPIC_BYTES // 2 + 1
    topic = "/".join(["a"] * (MAX_TOPIC_BYTES // 2 + 1))
    assert matches(deepest, deepest) and matches("#", deepest) and matches("/#", deepest)
    assert matches(plus, topic) and not matches(plus, topic + "/a") and not matches(plus, deepest)
    with pytest.raises(TopicError, match="over the MQTT limit"):
        validate_topic(deepest + "/")
