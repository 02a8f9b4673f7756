"""Retention rules as people write them and as the cluster keeps them: parsing and the checks they share.

A rule is ``FILTER=PERIOD``: an MQTT topic filter and how long its messages
are kept after they were stored, as ``90s``, ``30m``, ``12h``, ``7d``, ``2w``
(or a sum such as ``1d12h``), or ``keep`` (kept until deleted). The first rule
whose filter matches a message's topic decides; the default covers the rest.

>>> parse_period("1d12h")
129600
>>> parse_period("keep")
0
>>> parse_rule("telemetry/#=1d")
('telemetry/#', 86400)
>>> format_period(129600)
'1d12h'
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.protocol.topics import TopicError, validate_filter

MAX_RULES = 256
"""Rules one policy may hold."""
MAX_PERIOD_S = 100 * 365 * 86400
"""The longest period (a hundred years); longer is ``keep``."""
_PART = re.compile(r"(\d+)(s|m|h|d|w)")
_UNIT_S = {"w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}


class RetentionError(ValueError):
    """A rule or period that does not parse; the message says what is accepted."""


def parse_period(text: str) -> int:
    """Seconds of a period such as ``7d`` or ``1d12h``; 0 for ``keep``."""
    value = text.strip().lower()
    if value in ("keep", "forever", "0"):
        return 0
    if not value or _PART.sub("", value) != "":
        raise RetentionError(
            f"{text!r} is not a period: use a number and a unit (s m h d w), such as 90s, 12h, 7d or 1d12h, or 'keep'"
        )
    seconds = sum(int(n) * _UNIT_S[unit] for n, unit in _PART.findall(value))
    if not 0 < seconds <= MAX_PERIOD_S:
        raise RetentionError(f"{text!r}: a period is at least 1s and at most 100 years (or 'keep')")
    return seconds


def format_period(seconds: int) -> str:
    """``parse_period`` backwards: ``1d12h``; ``keep`` for 0."""
    if not seconds:
        return "keep"
    parts = []
    for unit in ("d", "h", "m", "s"):
        count, seconds = divmod(seconds, _UNIT_S[unit])
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


def parse_rule(text: str) -> tuple[str, int]:
    """``FILTER=PERIOD`` as (filter, seconds)."""
    topic_filter, sep, period = text.rpartition("=")
    if not sep or not topic_filter:
        raise RetentionError(f"{text!r} is not a rule: write FILTER=PERIOD, such as 'telemetry/#=1d'")
    try:
        validate_filter(topic_filter)
        return topic_filter, parse_period(period)
    except (TopicError, RetentionError) as err:
        raise RetentionError(f"rule {text!r}: {err}") from None


def check_rules(rules: Sequence[tuple[str, int]], default_s: int) -> None:
    """Raise INVALID_REQUEST (or INVALID_TOPIC_FILTER), saying which rule is wrong, unless the policy is sound."""
    if len(rules) > MAX_RULES:
        raise errors.error(Reason.INVALID_REQUEST, f"{len(rules)} retention rules; at most {MAX_RULES}")
    seen: set[str] = set()
    for number, (topic_filter, period_s) in enumerate(rules, 1):
        try:
            validate_filter(topic_filter)
        except TopicError as err:
            raise errors.error(Reason.INVALID_TOPIC_FILTER, f"retention rule {number}: {err}") from None
        if topic_filter in seen:
            raise errors.error(
                Reason.INVALID_REQUEST,
                f"retention rule {number}: filter {topic_filter!r} is listed twice (only the first would apply)",
            )
        seen.add(topic_filter)
        if not 0 <= period_s <= MAX_PERIOD_S:
            raise errors.error(
                Reason.INVALID_REQUEST,
                f"retention rule {number} ({topic_filter!r}): period {period_s}s is over 100 years; use 0 to keep",
            )
    if not 0 <= default_s <= MAX_PERIOD_S:
        raise errors.error(Reason.INVALID_REQUEST, f"default period {default_s}s is over 100 years; use 0 to keep")
