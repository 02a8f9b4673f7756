"""What a message must be to be stored: the rules a node applies to each message, and a client before sending it.

One definition for both sides: a node refuses a message that breaks one of
these rules (that message alone: the rest of its batch is stored), and the
client library checks them before a message joins a batch, so a bad
publish fails by itself without a round trip. The payload's limit is the
node's ``max_payload_bytes``, which the client does not know: it is checked
where the limit is given (on the node).

>>> message_problem("a/b", b"x", "s", 1, [("k", "v")]) is None
True
>>> message_problem("a/+", b"", "s", 0, ())[0]
<Reason.INVALID_TOPIC: 'INVALID_TOPIC'>
>>> message_problem("a", b"", "s", 0, [("k", "v")] * 1025)[1]
'1,025 user properties, over the limit of 1,024'
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.protocol.topics import MAX_TOPIC_BYTES, TopicError, validate_topic

MAX_USER_PROPERTIES = 1024
"""MQTT 5 user properties of one message, at most."""
MAX_USER_PROPERTY_BYTES = 65_536
"""The user properties of one message: their names and values together, in UTF-8 bytes, at most."""
MAX_SENDER_BYTES = MAX_TOPIC_BYTES
"""A sender (the publisher's clientid) in UTF-8 bytes, at most."""

Problem = tuple[Reason, str]
"""Why a message cannot be stored: the error reason and what is wrong, in words (no "message N:" prefix)."""


def message_problem(
    topic: str,
    payload: bytes,
    sender: str,
    qos: int,
    properties: Collection[Any],
    max_payload_bytes: int | None = None,
) -> Problem | None:
    """What is wrong with a message, or None when a node stores it.

    ``properties``: its user properties, as ``(name, value)`` pairs or
    ``mqds.v1.UserProperty`` messages. ``max_payload_bytes``: the node's
    limit (None: not checked).
    """
    try:
        validate_topic(topic)
    except TopicError as err:
        return Reason.INVALID_TOPIC, str(err)
    if max_payload_bytes is not None and len(payload) > max_payload_bytes:
        return (
            Reason.PAYLOAD_TOO_LARGE,
            f"topic {topic!r}: payload is {len(payload)} bytes, over the limit of {max_payload_bytes} "
            "(max_payload_bytes)",
        )
    if qos not in (0, 1, 2):
        return Reason.INVALID_MESSAGE, f"qos must be 0, 1 or 2, got {qos!r}"
    # 16,383 characters are at most 65,535 UTF-8 bytes: most senders are not encoded.
    if len(sender) > MAX_SENDER_BYTES // 4 or not sender.isascii():
        size = _utf8_size(sender)
        if size is None:
            return Reason.INVALID_MESSAGE, f"sender clientid {sender!r} is not valid UTF-8"
        if size > MAX_SENDER_BYTES:
            return Reason.INVALID_MESSAGE, f"sender clientid is over {MAX_SENDER_BYTES:,} bytes"
    return properties_problem(properties)


def _utf8_size(text: str) -> int | None:
    """``text``'s size in UTF-8 bytes; None for a string UTF-8 cannot hold (a lone surrogate)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return None


def properties_problem(properties: Collection[Any]) -> Problem | None:
    """What is wrong with a message's user properties (too many, or too many bytes), or None."""
    if not properties:
        return None
    if len(properties) > MAX_USER_PROPERTIES:
        return (
            Reason.INVALID_MESSAGE,
            f"{len(properties):,} user properties, over the limit of {MAX_USER_PROPERTIES:,}",
        )
    size = 0
    for prop in properties:
        key, value = prop if isinstance(prop, tuple) else (prop.key, prop.value)
        key_size, value_size = _utf8_size(key), _utf8_size(value)
        if key_size is None or value_size is None:
            return Reason.INVALID_MESSAGE, f"user property {key!r}: {value!r} is not valid UTF-8"
        size += key_size + value_size
    if size > MAX_USER_PROPERTY_BYTES:
        return (
            Reason.INVALID_MESSAGE,
            f"user properties take {size:,} bytes (names and values), over the limit of {MAX_USER_PROPERTY_BYTES:,}",
        )
    return None


def check_message(
    where: str,
    topic: str,
    payload: bytes,
    sender: str,
    qos: int,
    properties: Collection[Any],
    max_payload_bytes: int | None = None,
) -> None:
    """Raise the ``MqdsError`` a node answers for a message it does not store (``where``: which message)."""
    problem = message_problem(topic, payload, sender, qos, properties, max_payload_bytes)
    if problem is not None:
        raise problem_error(where, problem)


def check_properties(where: str, properties: Collection[Any]) -> None:
    """Raise INVALID_MESSAGE for user properties over :data:`MAX_USER_PROPERTIES` or :data:`MAX_USER_PROPERTY_BYTES`."""
    problem = properties_problem(properties)
    if problem is not None:
        raise problem_error(where, problem)


def problem_error(where: str, problem: Problem) -> errors.MqdsError:
    """The error for ``problem``, its text prefixed with ``where`` (e.g. "message 3")."""
    reason, text = problem
    return errors.error(reason, f"{where}: {text}")
