"""Redelivery policies (``Sessions.Deliver``): the rules the client and the nodes share.

A consumer (a queue reader's clientid, or a share group's ``$share/<group>``,
with a topic filter) is given messages by ``Deliver`` and acknowledges each
one; what it does not acknowledge within its wait comes again, counted, until
its last delivery, after which it goes to the dead-letter topic. The policy
is JetStream's consumer settings by other names: ``ack_wait_ms`` (ack_wait),
``max_deliveries`` (max_deliver), ``backoff_ms`` (backoff), ``max_unacked``
(max_ack_pending, here per shard of the message: the shard keeps the
deliveries of its own messages).

>>> policy = Policy.of(ack_wait_ms=30_000, max_deliveries=5, backoff_ms=(1_000, 5_000))
>>> [policy.wait_us(n) for n in (1, 2, 3)]
[1000000, 5000000, 5000000]
>>> Policy.of(ack_wait_ms=2_000, max_deliveries=3).wait_us(2)
2000000
>>> try:
...     Policy.of(ack_wait_ms=0, max_deliveries=3)
... except errors.MqdsError as err:
...     print(err.reason.value, err.message)
INVALID_REQUEST delivery policy: ack_wait_ms 0: a delivery waits 1 to 86,400,000 ms for its ack
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.protocol.topics import MAX_TOPIC_BYTES, TopicError, matches, validate_topic

MAX_WAIT_MS = 86_400_000
"""The longest ack wait or backoff step: a day."""
MAX_DELIVERIES = 1_000
"""The most deliveries a policy may allow a message."""
MAX_BACKOFF = 100
"""The most backoff steps."""
MAX_UNACKED = 10_000
"""The most unacknowledged deliveries of a consumer in one shard: what a delivery step scans of its state."""
DEAD_LETTER_TOPIC = "mqds-dead-letter-topic"
"""User property of a dead-lettered message: the topic it was published on."""
DEAD_LETTER_DELIVERIES = "mqds-deliveries"
"""User property of a dead-lettered message: how many times it was delivered."""
DEAD_LETTER_CONSUMER = "mqds-dead-letter-consumer"
"""User property of a dead-lettered message: the consumer that did not acknowledge it (clientid, filter)."""


def _bad(message: str) -> errors.MqdsError:
    return errors.error(Reason.INVALID_REQUEST, f"delivery policy: {message}")


def _check_wait(name: str, value: int) -> None:
    if not 1 <= value <= MAX_WAIT_MS:
        raise _bad(f"{name} {value}: a delivery waits 1 to {MAX_WAIT_MS:,} ms for its ack")


@dataclass(frozen=True)
class Policy:
    """A checked delivery policy (build it with :meth:`of`)."""

    ack_wait_ms: int
    max_deliveries: int
    backoff_ms: tuple[int, ...] = ()
    max_unacked: int = 1_000
    dead_letter_topic: str = ""

    @classmethod
    def of(
        cls,
        ack_wait_ms: int,
        max_deliveries: int,
        backoff_ms: Sequence[int] = (),
        max_unacked: int = 1_000,
        dead_letter_topic: str = "",
        topic_filter: str | None = None,
    ) -> Policy:
        """The policy, or INVALID_REQUEST naming the first value out of bounds.

        With ``topic_filter`` (the consumer's), a dead-letter topic the filter
        matches is refused: its messages would come back to the consumer.
        """
        _check_wait("ack_wait_ms", ack_wait_ms)
        if not 1 <= max_deliveries <= MAX_DELIVERIES:
            raise _bad(f"max_deliveries {max_deliveries}: a message is delivered 1 to {MAX_DELIVERIES:,} times")
        if len(backoff_ms) > MAX_BACKOFF:
            raise _bad(f"backoff_ms has {len(backoff_ms):,} waits, at most {MAX_BACKOFF}")
        for i, wait in enumerate(backoff_ms):
            _check_wait(f"backoff_ms[{i}]", wait)
        if not 1 <= max_unacked <= MAX_UNACKED:
            raise _bad(f"max_unacked {max_unacked}: 1 to {MAX_UNACKED:,} messages in flight per shard")
        if dead_letter_topic:
            try:
                validate_topic(dead_letter_topic)
            except TopicError as err:
                raise errors.error(
                    Reason.INVALID_TOPIC, f"delivery policy: dead_letter_topic {dead_letter_topic!r}: {err}"
                ) from None
            if len(dead_letter_topic.encode("utf-8")) > MAX_TOPIC_BYTES:
                raise errors.error(Reason.INVALID_TOPIC, "delivery policy: dead_letter_topic over 65,535 bytes")
            if topic_filter is not None and matches(topic_filter, dead_letter_topic):
                raise _bad(
                    f"dead_letter_topic {dead_letter_topic!r} matches the consumer's filter {topic_filter!r}: "
                    "its dead letters would be delivered to it again"
                )
        return cls(ack_wait_ms, max_deliveries, tuple(backoff_ms), max_unacked, dead_letter_topic)

    def wait_us(self, deliveries: int) -> int:
        """How long the ``deliveries``-th delivery (1 the first) waits for its ack before it is due again."""
        if self.backoff_ms:
            return self.backoff_ms[min(deliveries, len(self.backoff_ms)) - 1] * 1000
        return self.ack_wait_ms * 1000
