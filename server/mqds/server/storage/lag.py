"""How far a consumer is behind in one shard: the matching messages after its position, counted up to a cap.

A read position, a share group's position or a push subscription stands at a
timestamp of each shard; what it has still to read is the shard's messages
matching its filter after that timestamp (``ordered.ordered``, oldest first).
:func:`measure` counts them up to a cap and says "at least" beyond it, and
gives the oldest one's timestamp, so the time lag (how long the oldest unread
message has waited) costs one message, whatever the count.
"""

from __future__ import annotations

from dataclasses import dataclass

from mqds.server.storage.expiry import message_left
from mqds.server.storage.ordered import StoredMessages, ordered
from mqds.v1 import storage_pb2 as pb


@dataclass(frozen=True)
class Lag:
    messages: int
    """Matching messages after the position, up to the cap."""
    at_least: bool
    """There are more than ``messages`` (the count stopped at its cap)."""
    oldest_us: int
    """The oldest one's timestamp; 0 when there is none."""


NONE = Lag(0, False, 0)


def measure(
    storage: StoredMessages, topic_filter: str, after_us: int, cap: int, now_us: int, include_qos0: bool = True
) -> Lag:
    """The lag of a position at ``after_us`` in ``storage``'s shard at ``now_us``: up to ``cap`` messages counted
    (``cap`` >= 1).

    Without ``include_qos0``, QoS 0 messages are not counted (offline delivery skips them); nor are messages
    whose Message Expiry Interval ended by ``now_us`` (no fetch or push hands them out any more).
    """
    if after_us >= storage.last_ts:
        return NONE
    count = 0
    oldest = 0
    for ts, stored in ordered(storage, topic_filter, after_us + 1):
        if not include_qos0 and pb.Message.FromString(stored).qos == 0:
            continue
        if message_left(ts, stored, now_us) is None:
            continue
        if count == cap:
            return Lag(count, True, oldest)
        if not count:
            oldest = ts
        count += 1
    return Lag(count, False, oldest)
