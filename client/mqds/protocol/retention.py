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

A rule may add limits beside its period, each ``,NAME=VALUE`` after it
(``parse_rule_limits``): ``max_msgs`` (messages), ``max_bytes`` (a size:
bytes, or with a unit B KB MB GB TB KiB MiB GiB TiB), ``per_topic`` (messages
of each topic) and ``discard`` (``old``: the oldest go; ``new``: a store over
the limit is refused). They count the messages the rule decides, per shard
(each shard keeps the limit divided by the number of shards); see
docs/operations.md.

>>> r = parse_rule_limits("a/#=7d,max_msgs=1000,max_bytes=64MiB,per_topic=10,discard=old")
>>> r.topic_filter, r.period_s, r.max_messages, r.max_bytes, r.max_messages_per_topic, r.discard
('a/#', 604800, 1000, 67108864, 10, 1)
>>> format_limits(r)
'max_msgs=1000,max_bytes=64MiB,per_topic=10,discard=old'
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.protocol.topics import TopicError, validate_filter
from mqds.v1 import cluster_pb2 as clpb

MAX_RULES = 256
"""Rules one policy may hold."""
MAX_PERIOD_S = 100 * 365 * 86400
"""The longest period (a hundred years); longer is ``keep``."""
MAX_LIMIT_MESSAGES = 10**12
"""The largest max_msgs or per_topic a rule may set (a trillion messages)."""
MAX_LIMIT_BYTES = 2**50
"""The largest max_bytes a rule may set (1 PiB)."""
DISCARDS = {"old": clpb.RETENTION_DISCARD_OLD, "new": clpb.RETENTION_DISCARD_NEW}
"""The discard policies by name."""
_LIMIT_NAMES = ("max_msgs", "max_bytes", "per_topic", "discard")
_SIZE = re.compile(r"(\d+)([kmgt]i?b|b)?")
_SIZE_UNIT = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}
_SIZE_UNIT.update({"kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4})
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


def parse_size(text: str) -> int:
    """Bytes of a size such as ``65536``, ``64KiB`` or ``1GB``."""
    match = _SIZE.fullmatch(text.strip().lower())
    if match is None:
        raise RetentionError(f"{text!r} is not a size: use bytes, or a number and a unit such as 64MiB or 1GB")
    return int(match.group(1)) * _SIZE_UNIT[match.group(2) or "b"]


def format_size(count: int) -> str:
    """``parse_size`` backwards: the largest binary unit that divides it exactly (``64MiB``), else bytes."""
    for unit in ("tib", "gib", "mib", "kib"):
        if count and count % _SIZE_UNIT[unit] == 0:
            return f"{count // _SIZE_UNIT[unit]}{unit[0].upper()}iB"
    return str(count)


def _count(name: str, value: str) -> int:
    if not value.strip().isdigit():
        raise RetentionError(f"{name}={value!r} is not a count: write a whole number of messages, such as 1000")
    return int(value)


def parse_rule_limits(text: str) -> clpb.RetentionRule:
    """``FILTER=PERIOD[,max_msgs=N][,max_bytes=SIZE][,per_topic=N][,discard=old|new]`` as a ``RetentionRule``.

    The limits are the trailing ``,NAME=VALUE`` parts whose name is one of
    those four; whatever comes before them is ``FILTER=PERIOD`` (a filter
    may hold ``,`` and ``=``). The rule is not checked as a whole here:
    ``check_limits`` does that.
    """
    parts = text.split(",")
    options: list[str] = []
    while len(parts) > 1 and parts[-1].partition("=")[0].strip() in _LIMIT_NAMES:
        options.insert(0, parts.pop())
    topic_filter, period_s = parse_rule(",".join(parts))
    rule = clpb.RetentionRule(topic_filter=topic_filter, period_s=period_s)
    seen: set[str] = set()
    for option in options:
        name, _, value = option.partition("=")
        name = name.strip()
        if name in seen:
            raise RetentionError(f"rule {text!r}: {name} is given twice")
        seen.add(name)
        try:
            if name == "max_msgs":
                rule.max_messages = _count(name, value)
            elif name == "per_topic":
                rule.max_messages_per_topic = _count(name, value)
            elif name == "max_bytes":
                rule.max_bytes = parse_size(value)
            else:
                discard = DISCARDS.get(value.strip().lower())
                if discard is None:
                    raise RetentionError(f"discard={value!r} is not a discard policy: use discard=old or discard=new")
                rule.discard = discard
        except (RetentionError, ValueError) as err:
            raise RetentionError(f"rule {text!r}: {err}") from None
    return rule


def has_limits(rule: clpb.RetentionRule) -> bool:
    """Whether a rule sets a limit beside its period."""
    return bool(rule.max_messages or rule.max_bytes or rule.max_messages_per_topic)


def discards_new(rule: clpb.RetentionRule) -> bool:
    """Whether a rule refuses new messages at its limits (discard=new)."""
    return rule.discard == clpb.RETENTION_DISCARD_NEW and bool(rule.max_messages or rule.max_bytes)


def format_limits(rule: clpb.RetentionRule) -> str:
    """A rule's limits as ``parse_rule_limits`` reads them (empty when it has none)."""
    parts = []
    if rule.max_messages:
        parts.append(f"max_msgs={rule.max_messages}")
    if rule.max_bytes:
        parts.append(f"max_bytes={format_size(rule.max_bytes)}")
    if rule.max_messages_per_topic:
        parts.append(f"per_topic={rule.max_messages_per_topic}")
    if has_limits(rule):
        parts.append("discard=new" if rule.discard == clpb.RETENTION_DISCARD_NEW else "discard=old")
    return ",".join(parts)


def check_limits(rules: Sequence[clpb.RetentionRule]) -> None:
    """Raise INVALID_REQUEST naming the rule unless every rule's limits make sense (``check_rules`` checks the rest).

    Refused: a limit over its maximum, a discard policy that is not one, a
    discard policy on a rule without limits, ``per_topic`` over ``max_msgs``
    (it could never apply), and ``discard=new`` with ``per_topic`` (refusing a
    topic's message needs a count per topic on the leader, for every topic:
    per-topic limits discard old messages only).
    """
    for number, rule in enumerate(rules, 1):
        name = f"retention rule {number} ({rule.topic_filter!r})"
        problem = _limits_problem(rule)
        if problem is not None:
            raise errors.error(Reason.INVALID_REQUEST, f"{name}: {problem}")


def _limits_problem(rule: clpb.RetentionRule) -> str | None:
    for field, value, most in (
        ("max_msgs", rule.max_messages, MAX_LIMIT_MESSAGES),
        ("per_topic", rule.max_messages_per_topic, MAX_LIMIT_MESSAGES),
        ("max_bytes", rule.max_bytes, MAX_LIMIT_BYTES),
    ):
        if value > most:
            return f"{field}={value} is over the most a rule may set ({most:,}); leave it out for no limit"
    if rule.discard not in (clpb.RETENTION_DISCARD_UNSPECIFIED, *DISCARDS.values()):
        return f"discard {rule.discard} is not a discard policy: use old (1) or new (2)"
    if not has_limits(rule):
        if rule.discard != clpb.RETENTION_DISCARD_UNSPECIFIED:
            return "a discard policy without a limit (max_msgs, max_bytes or per_topic) does nothing: add a limit"
        return None
    if rule.max_messages and rule.max_messages_per_topic > rule.max_messages:
        return (
            f"per_topic={rule.max_messages_per_topic} is over max_msgs={rule.max_messages}: it could never apply; "
            "lower it or leave it out"
        )
    if rule.discard == clpb.RETENTION_DISCARD_NEW and rule.max_messages_per_topic:
        return (
            "discard=new cannot go with per_topic (refusing a topic's message would need a count of every topic "
            "on each leader): per-topic limits discard the oldest; use max_msgs or max_bytes with discard=new"
        )
    return None
