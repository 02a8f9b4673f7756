"""What a delete of stored messages may name: the checks the client and the nodes share.

A delete names the messages matching a topic filter, of one sender if given,
stored in ``[since_us, until_us)`` (0: no bound). A sender's messages are all
in one shard (``shard_of(sender)``); otherwise every shard holds some. Deleting
everything (filter ``#``, no sender, no time range) must be confirmed.
"""

from __future__ import annotations

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.protocol.topics import MAX_TOPIC_BYTES, TopicError, validate_filter


def check_delete(topic_filter: str, sender: str, since_us: int, until_us: int, confirm_all: bool) -> None:
    """Raise INVALID_TOPIC_FILTER or INVALID_REQUEST, saying what is wrong, unless the delete is well formed.

    >>> check_delete("telemetry/#", "", 0, 0, False)
    >>> check_delete("#", "", 0, 0, False)
    Traceback (most recent call last):
    ...
    mqds.protocol.errors.InvalidArgumentError: INVALID_REQUEST: this would delete every stored message \
(filter '#', no sender, no time range): confirm it (confirm_all, mqds delete --all), or narrow the delete
    """
    if not topic_filter:
        raise errors.error(Reason.INVALID_TOPIC_FILTER, "the topic filter is empty: name the messages ('#' for all)")
    try:
        validate_filter(topic_filter)
    except TopicError as err:
        raise errors.error(Reason.INVALID_TOPIC_FILTER, str(err)) from None
    if len(sender.encode("utf-8")) > MAX_TOPIC_BYTES:
        raise errors.error(Reason.INVALID_REQUEST, "the sender is over 65,535 bytes: no such clientid can be stored")
    if since_us < 0 or until_us < 0:
        raise errors.error(Reason.INVALID_REQUEST, "times are microseconds since the Unix epoch: not negative")
    if until_us and since_us >= until_us:
        raise errors.error(
            Reason.INVALID_REQUEST, f"the time range is empty: since_us {since_us} is not before until_us {until_us}"
        )
    if topic_filter == "#" and not sender and not since_us and not until_us and not confirm_all:
        raise errors.error(
            Reason.INVALID_REQUEST,
            "this would delete every stored message (filter '#', no sender, no time range): "
            "confirm it (confirm_all, mqds delete --all), or narrow the delete",
        )
