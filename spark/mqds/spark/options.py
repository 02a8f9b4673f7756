"""The options of the ``mqds`` Spark source, parsed and checked once, with errors that name the option.

Spark hands a data source its options as a case-insensitive map of strings.
Every read turns them into one :class:`SourceOptions` before it talks to a
cluster, so a typo, an unparsable time or a bad token fails at ``load()`` with
a message saying which option and why, instead of deep inside an executor.
Nothing here needs pyspark: the job, the tests and the command line use it too.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from mqds.client.connection import ConnectionSettings, parse_endpoints
from mqds.protocol.topics import TopicError, validate_filter, validate_topic
from mqds.spark.snapshot import Snapshot

EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
ONE_US = datetime.timedelta(microseconds=1)

DEFAULT_TOPIC_FILTER = "#"
DEFAULT_MAX_RECORDS_PER_PARTITION = 500_000
DEFAULT_BATCH_SIZE = 10_000  # the nodes' max_next_batch: fewer calls, same answer bound
DEFAULT_TIMEOUT_S = 30.0

# Option names as documented (Spark lower-cases them; these spellings are for messages).
BATCH_ONLY = ("startTime", "endTime", "snapshot")
STREAM_ONLY = ("startingOffsets", "maxMessagesPerTrigger")
COMMON = (
    "endpoints",
    "topicFilter",
    "maxRecordsPerPartition",
    "failOnDataLoss",
    "batchSize",
    "timeout",
    "tls",
    "tlsCa",
    "tlsCert",
    "tlsKey",
    "tlsServerName",
    "token",
)
KNOWN = {name.lower(): name for name in (*COMMON, *BATCH_ONLY, *STREAM_ONLY)}
# Spark passes load(path) as "path"; the source has no use for it but must not refuse it.
IGNORED = {"path"}

# startingOffsets: per vnode, like the Kafka source's -2 (earliest) and -1 (latest).
EARLIEST = -2
LATEST = -1


class OptionError(ValueError):
    """An option of the mqds source is missing, unknown or malformed; the message names it."""


def parse_time_us(name: str, text: str) -> int:
    """A point in time as microseconds since the epoch, exactly (no float rounding).

    Accepts ISO-8601 (``2026-11-01T00:00:00Z``, ``2026-11-01T01:00:00+01:00``,
    ``2026-11-01``; a time without a zone is UTC, so every executor reads it
    the same) or an integer number of microseconds since the epoch.

    >>> parse_time_us("startTime", "1970-01-01T00:00:01.000002Z")
    1000002
    >>> parse_time_us("startTime", "1762000000000000")
    1762000000000000
    >>> parse_time_us("startTime", "yesterday")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    mqds.spark.options.OptionError: option startTime: 'yesterday' is not a time: use ISO-8601 such as ...
    """
    value = text.strip()
    if re.fullmatch(r"-?\d+", value):
        us = int(value)
        if us < 0:
            raise OptionError(f"option {name}: {value} is before the epoch")
        return us
    try:
        when = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise OptionError(
            f"option {name}: {text!r} is not a time: use ISO-8601 such as 2026-11-01T00:00:00Z "
            "(UTC when no zone is given) or microseconds since the epoch"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    us = (when - EPOCH) // ONE_US
    if us < 0:
        raise OptionError(f"option {name}: {text!r} is before the epoch")
    return us


def format_time_us(timestamp_us: int) -> str:
    """UTC ISO-8601 with microseconds and a Z; :func:`parse_time_us` reads it back exactly."""
    return (EPOCH + timestamp_us * ONE_US).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _bool(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise OptionError(f"option {name}: {text!r} is not true or false")


def _positive_int(name: str, text: str) -> int:
    try:
        value = int(text.strip().replace("_", ""))
    except ValueError:
        raise OptionError(f"option {name}: {text!r} is not a whole number") from None
    if value <= 0:
        raise OptionError(f"option {name}: must be 1 or more, got {value}")
    return value


def _positive_float(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise OptionError(f"option {name}: {text!r} is not a number of seconds") from None
    if not value > 0:
        raise OptionError(f"option {name}: must be above 0, got {text}")
    return value


@dataclass(frozen=True)
class StartingOffsets:
    """Where a new streaming query starts, per vnode: a timestamp, ``EARLIEST`` or ``LATEST``.

    ``default`` applies to vnodes the JSON form does not name (earliest, as
    the Kafka source does for partitions it does not list).
    """

    default: int
    per_vnode: tuple[tuple[int, int], ...] = ()

    def for_vnode(self, shard: int) -> int:
        return dict(self.per_vnode).get(shard, self.default)


def parse_starting_offsets(text: str) -> StartingOffsets:
    """``earliest``, ``latest``, or JSON: ``{"0": 1762000000000000, "3": "2026-11-01T00:00:00Z", "5": -1}``.

    A vnode's value is the timestamp of the last message *not* to read (as
    in the offsets a query checkpoints: the query reads what comes after),
    as microseconds or ISO-8601, or -2 (earliest) / -1 (latest).

    >>> parse_starting_offsets("latest")
    StartingOffsets(default=-1, per_vnode=())
    >>> parse_starting_offsets('{"2": -1, "0": 17}')
    StartingOffsets(default=-2, per_vnode=((0, 17), (2, -1)))
    """
    value = text.strip()
    if value.lower() == "earliest":
        return StartingOffsets(EARLIEST)
    if value.lower() == "latest":
        return StartingOffsets(LATEST)
    hint = (
        "use earliest, latest, or JSON mapping vnode numbers to a timestamp (microseconds or ISO-8601), "
        'or -2 (earliest) / -1 (latest), e.g. {"0": 1762000000000000, "1": -1}'
    )
    if not value.startswith("{"):
        raise OptionError(f"option startingOffsets: {text!r} is not known: {hint}")
    try:
        raw = json.loads(value)
    except ValueError as err:
        raise OptionError(f"option startingOffsets: not valid JSON ({err}): {hint}") from None
    if not isinstance(raw, dict):
        raise OptionError(f"option startingOffsets: {hint}")
    per_vnode: dict[int, int] = {}
    for key, item in raw.items():
        if not str(key).isdigit():
            raise OptionError(f"option startingOffsets: {key!r} is not a vnode number: {hint}")
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise OptionError(f"option startingOffsets: vnode {key}: {item!r} is not a position: {hint}")
        if isinstance(item, int):
            if item < EARLIEST:
                raise OptionError(f"option startingOffsets: vnode {key}: {item} is not a position: {hint}")
            per_vnode[int(key)] = item
        else:
            per_vnode[int(key)] = parse_time_us(f"startingOffsets (vnode {key})", item)
    return StartingOffsets(EARLIEST, tuple(sorted(per_vnode.items())))


@dataclass(frozen=True)
class SourceOptions:
    """Everything a read needs, checked. Picklable: it travels to the executors with the reader."""

    endpoints: tuple[str, ...]
    topic_filter: str = DEFAULT_TOPIC_FILTER
    start_us: int = 0
    """First timestamp to read (inclusive)."""
    end_us: int | None = None
    """First timestamp not to read (exclusive); None = up to the snapshot's fences."""
    snapshot: Snapshot | None = None
    max_records_per_partition: int = DEFAULT_MAX_RECORDS_PER_PARTITION
    fail_on_data_loss: bool = True
    batch_size: int = DEFAULT_BATCH_SIZE
    starting_offsets: StartingOffsets = field(default_factory=lambda: StartingOffsets(LATEST))
    max_messages_per_trigger: int | None = None
    settings: ConnectionSettings = field(default_factory=ConnectionSettings)


def parse_options(options: Mapping[str, str], *, streaming: bool | None = False) -> SourceOptions:
    """Check the options of one read and return them parsed.

    ``streaming``: True for ``readStream``, False for ``read``; None when not
    known yet (options of the other kind are then not refused).
    """
    given = {str(k).lower(): str(v) for k, v in options.items() if v is not None}
    unknown = sorted(k for k in given if k not in KNOWN and k not in IGNORED)
    if unknown:
        raise OptionError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for the mqds source; "
            f"it takes {', '.join(sorted(KNOWN.values()))}"
        )
    other_kind = () if streaming is None else BATCH_ONLY if streaming else STREAM_ONLY
    wrong_mode = [KNOWN[k.lower()] for k in other_kind if k.lower() in given]
    if wrong_mode:
        if streaming:
            raise OptionError(
                f"option {', '.join(wrong_mode)} applies to batch reads (spark.read) only; a stream starts at "
                "startingOffsets and reads what comes"
            )
        raise OptionError(
            f"option {', '.join(wrong_mode)} applies to streaming reads (spark.readStream) only; a batch read "
            "takes startTime, endTime and snapshot"
        )

    def get(name: str) -> str | None:
        return given.get(name.lower())

    endpoints_text = get("endpoints")
    if not endpoints_text or not endpoints_text.strip():
        raise OptionError("option endpoints is required: the mqds nodes as host:port,host:port,...")
    try:
        endpoints = tuple(parse_endpoints(endpoints_text))
    except ValueError as err:
        raise OptionError(f"option endpoints: {err}") from None

    given_filter = get("topicFilter")
    if streaming and (given_filter is None or not given_filter.strip()):
        # A batch read of everything ends; a stream of '#' reads every message the cluster ever takes, on
        # every trigger, and nobody asked for that by leaving an option out.
        raise OptionError(
            "option topicFilter is required for a stream (spark.readStream): the messages to read, e.g. "
            "'sensor/+/temp'; pass '#' to stream every message"
        )
    topic_filter = (given_filter or DEFAULT_TOPIC_FILTER).strip()
    try:
        validate_filter(topic_filter)
    except TopicError as err:
        raise OptionError(f"option topicFilter: {err}") from None

    start_text, end_text = get("startTime"), get("endTime")
    start_us = parse_time_us("startTime", start_text) if start_text else 0
    end_us = parse_time_us("endTime", end_text) if end_text else None
    if end_us is not None and end_us <= start_us:
        raise OptionError(
            f"option endTime ({format_time_us(end_us)}) must be after startTime ({format_time_us(start_us)}): "
            "the window is [startTime, endTime)"
        )
    snapshot_text = get("snapshot")
    try:
        snapshot = Snapshot.from_token(snapshot_text) if snapshot_text else None
    except ValueError as err:
        raise OptionError(f"option snapshot: {err}") from None

    max_records = get("maxRecordsPerPartition")
    batch_size = get("batchSize")
    fail = get("failOnDataLoss")
    trigger = get("maxMessagesPerTrigger")
    starting = get("startingOffsets")
    timeout = get("timeout")
    try:
        settings = ConnectionSettings(
            timeout_s=_positive_float("timeout", timeout) if timeout else DEFAULT_TIMEOUT_S,
            tls=_bool("tls", get("tls") or "false"),
            tls_ca=get("tlsCa"),
            tls_client_cert=get("tlsCert"),
            tls_client_key=get("tlsKey"),
            tls_server_name=get("tlsServerName"),
            auth_token=get("token"),
        )
    except OptionError:
        raise
    except ValueError as err:
        raise OptionError(f"connection options (tls, tlsCa, tlsCert, tlsKey, tlsServerName, token): {err}") from None
    return SourceOptions(
        endpoints=endpoints,
        topic_filter=topic_filter,
        start_us=start_us,
        end_us=end_us,
        snapshot=snapshot,
        max_records_per_partition=(
            _positive_int("maxRecordsPerPartition", max_records) if max_records else DEFAULT_MAX_RECORDS_PER_PARTITION
        ),
        fail_on_data_loss=_bool("failOnDataLoss", fail) if fail else True,
        batch_size=_positive_int("batchSize", batch_size) if batch_size else DEFAULT_BATCH_SIZE,
        starting_offsets=parse_starting_offsets(starting) if starting else StartingOffsets(LATEST),
        max_messages_per_trigger=_positive_int("maxMessagesPerTrigger", trigger) if trigger else None,
        settings=settings,
    )


# -- topic filters ---------------------------------------------------------------------


def intersect_filters(a: str, b: str) -> str | None:
    """The filter matching exactly the topics both valid filters match, or None when no topic matches both.

    Used to narrow the server-side filter with what Spark pushes down.

    >>> intersect_filters("sensor/+/temp", "sensor/42/#")
    'sensor/42/temp'
    >>> intersect_filters("a/#", "a")
    'a'
    >>> intersect_filters("#", "$SYS/x") is None
    True
    >>> intersect_filters("a/+", "b/#") is None
    True
    """
    la, lb = a.split("/"), b.split("/")
    if (la[0] in ("+", "#") and lb[0].startswith("$")) or (lb[0] in ("+", "#") and la[0].startswith("$")):
        return None
    out: list[str] = []
    i = 0
    while True:
        end_a, end_b = i == len(la), i == len(lb)
        if end_a and end_b:
            return "/".join(out)
        if end_a or end_b:
            rest = lb[i:] if end_a else la[i:]
            # Only a trailing '#' matches "nothing more" (a/# matches a).
            return "/".join(out) if rest == ["#"] else None
        x, y = la[i], lb[i]
        if x == "#":
            return "/".join(out + lb[i:])
        if y == "#":
            return "/".join(out + la[i:])
        if x == "+":
            out.append(y)
        elif y == "+" or x == y:
            out.append(x)
        else:
            return None
        i += 1


def topic_as_filter(topic: str) -> str | None:
    """A topic name as a filter that matches only it; None when it is not a valid topic (nothing matches)."""
    try:
        validate_topic(topic)
    except TopicError:
        return None
    return topic


def prefix_as_filter(prefix: str) -> str | None:
    """A filter matching every topic that starts with ``prefix`` (and maybe a few more); None if it cannot narrow.

    Only whole levels can be expressed: ``sensor/4`` gives ``sensor/#``.
    Spark checks the prefix itself on the rows afterwards.

    >>> prefix_as_filter("sensor/42/t")
    'sensor/42/#'
    >>> prefix_as_filter("sens") is None
    True
    """
    if "+" in prefix or "#" in prefix or "\x00" in prefix:
        return None
    levels = prefix.split("/")[:-1]
    if not levels:
        return None
    return "/".join([*levels, "#"])
