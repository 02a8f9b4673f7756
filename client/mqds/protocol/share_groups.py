"""Shared subscriptions (``$share/<group>/<filter>``): the rules the client and the nodes share.

The members of a group (group name and topic filter) share one read
position per shard: the read position of the pseudo-client ``$share/<group>``
for the filter, kept in that pseudo-client's shard like any client's. Each
shard is read by one member at a time: the shards are dealt round-robin to
the live members in name order (``assign``): each gets its share, and a member
that joins or leaves moves shards between the others (a moved shard's new
reader goes on from the group's position: what the old one delivered and did
not acknowledge comes again, at least once, as MQTT's QoS 1). A member stays
in the group while it renews its lease (joins again).

>>> assign(["b", "a"], 5)
{'a': [0, 2, 4], 'b': [1, 3]}
>>> position_client("workers")
'$share/workers'
"""

from __future__ import annotations

from collections.abc import Sequence

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.protocol.topics import MAX_TOPIC_BYTES, TopicError, validate_filter

MAX_LEASE_S = 3600
"""The longest lease a member may take; it renews by joining again."""
MAX_NAME_BYTES = 1024
"""The longest group or member name."""


def position_client(group: str) -> str:
    """The pseudo-client whose read positions the group's members share (and whose shard keeps the group)."""
    return f"$share/{group}"


def check(group: str, topic_filter: str, member: str, lease_s: int = 1) -> None:
    """Raise INVALID_REQUEST (or INVALID_TOPIC_FILTER) naming what is wrong, unless the request is sound."""
    if not group or any(c in group for c in "/+#") or len(group.encode("utf-8")) > MAX_NAME_BYTES:
        raise errors.error(
            Reason.INVALID_REQUEST,
            f"share group name {group!r}: 1 to {MAX_NAME_BYTES} bytes, without '/', '+' or '#' (as MQTT's ShareName)",
        )
    if not member or len(member.encode("utf-8")) > MAX_NAME_BYTES:
        raise errors.error(Reason.INVALID_REQUEST, f"member name: 1 to {MAX_NAME_BYTES} bytes (a clientid)")
    try:
        validate_filter(topic_filter)
    except TopicError as err:
        raise errors.error(Reason.INVALID_TOPIC_FILTER, str(err)) from None
    if len(topic_filter.encode("utf-8")) > MAX_TOPIC_BYTES:
        raise errors.error(Reason.INVALID_TOPIC_FILTER, "topic filter over 65,535 bytes")
    if not 1 <= lease_s <= MAX_LEASE_S:
        raise errors.error(Reason.INVALID_REQUEST, f"lease_s {lease_s}: a member's lease is 1 to {MAX_LEASE_S} seconds")


def assign(members: Sequence[str], n_shards: int) -> dict[str, list[int]]:
    """Each live member's shards: dealt round-robin in name order (every member gets its share)."""
    ordered = sorted(set(members))
    dealt: dict[str, list[int]] = {m: [] for m in ordered}
    if ordered:
        for shard in range(n_shards):
            dealt[ordered[shard % len(ordered)]].append(shard)
    return dealt
