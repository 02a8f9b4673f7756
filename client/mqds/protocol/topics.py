"""MQTT topic names and topic filters: validation and matching.

The rules are MQTT 5's (section 4.7), applied the same way by the client, the
node and the storage layer:

- levels are separated by ``/``; empty levels are real levels (``a//b`` has
  three levels, the middle one empty);
- ``+`` matches exactly one level, ``#`` matches the rest of the topic
  including the parent level (``a/#`` matches ``a``);
- a filter whose first level is ``+`` or ``#`` does not match a topic whose
  first level starts with ``$`` (``$SYS/...``);
- topic names and filters are non-empty UTF-8 without NUL, at most 65,535
  bytes once encoded; a topic name (what is published) has no wildcards.

There is no limit on the number of levels beyond the size (65,535 bytes of
``/`` is a valid topic of 65,536 empty levels), so nothing that walks levels,
here or in the storage layer, may recurse on them: it loops.

>>> matches("sensor/+/temp", "sensor/42/temp")
True
>>> matches("a/#", "a")
True
>>> matches("#", "$SYS/uptime")
False
>>> validate_filter("a/#/b")
Traceback (most recent call last):
...
mqds.protocol.topics.TopicError: invalid topic filter 'a/#/b': '#' must be the last level
"""

from __future__ import annotations

MAX_TOPIC_BYTES = 65_535


class TopicError(ValueError):
    """A topic name or filter breaks the MQTT rules; the message says which."""


def _check_common(kind: str, text: str) -> None:
    if not isinstance(text, str):
        raise TopicError(f"{kind} must be a string, not {type(text).__name__}")
    if text == "":
        raise TopicError(f"{kind} must not be empty")
    if "\x00" in text:
        raise TopicError(f"invalid {kind} {text!r}: contains NUL (U+0000)")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as err:
        raise TopicError(f"invalid {kind} {text!r}: not valid UTF-8 ({err.reason})") from None
    if size > MAX_TOPIC_BYTES:
        raise TopicError(f"invalid {kind}: {size} bytes, over the MQTT limit of {MAX_TOPIC_BYTES}")


def validate_topic(topic: str) -> None:
    """Raise TopicError unless ``topic`` is a valid topic name to publish to."""
    _check_common("topic", topic)
    if "+" in topic or "#" in topic:
        raise TopicError(f"invalid topic {topic!r}: wildcards '+' and '#' are only allowed in topic filters")


def validate_filter(topic_filter: str) -> list[str]:
    """Raise TopicError unless ``topic_filter`` is valid; return its levels."""
    _check_common("topic filter", topic_filter)
    levels = topic_filter.split("/")
    last = len(levels) - 1
    for i, level in enumerate(levels):
        if level == "#":
            if i != last:
                raise TopicError(f"invalid topic filter {topic_filter!r}: '#' must be the last level")
        elif level == "+":
            continue
        elif "#" in level or "+" in level:
            raise TopicError(
                f"invalid topic filter {topic_filter!r}: wildcard in level {level!r} must occupy the whole level"
            )
    return levels


def matches_levels(filter_levels: list[str], topic_levels: list[str]) -> bool:
    """Match split filter levels against split topic levels (both valid)."""
    if filter_levels[0] in ("+", "#") and topic_levels[0].startswith("$"):
        return False
    n = len(topic_levels)
    for i, f in enumerate(filter_levels):
        if f == "#":
            return True
        if i >= n:
            return False
        if f != "+" and f != topic_levels[i]:
            return False
    return len(filter_levels) == n


def matches(topic_filter: str, topic: str) -> bool:
    """True when the valid filter ``topic_filter`` matches the topic name ``topic``."""
    return matches_levels(topic_filter.split("/"), topic.split("/"))


def is_wildcard_filter(topic_filter: str) -> bool:
    """True when the filter has a ``+`` or ``#`` level."""
    return any(level in ("+", "#") for level in topic_filter.split("/"))
