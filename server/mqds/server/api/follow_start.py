"""Starting Follow subscriptions: a start's checks, and the cohorts its subscriptions begin in.

A start (``FollowStart``) names one subscription or, with ``also``, many
alike: each id a subscription with the start's other fields. What breaks the
protocol (an id in use or named twice, zero credit, more subscriptions than
``follow_max_subscriptions`` on the call) is raised and ends the call (see
:func:`take`); what cannot be served (a bad filter, a shard that does not
exist, a position a day past the node's clock) is answered with a failure
for each id, and the call goes on (see :func:`begin`).
"""

from __future__ import annotations

from collections.abc import Mapping

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.protocol.topics import TopicError, validate_filter
from mqds.server.api.follow_cohort import Cohort, FollowSub
from mqds.v1 import storage_pb2 as pb

AHEAD_US = 86_400 * 1_000_000
"""A position this far past the node's clock is refused (no shard's clock is a day ahead)."""


def take(start: pb.FollowStart, subs: Mapping[int, FollowSub], max_subscriptions: int) -> list[FollowSub]:
    """The subscriptions ``start`` names, not begun yet; raises INVALID_REQUEST where it breaks the protocol.

    ``subs`` are the call's subscriptions now. The bound is checked first:
    it bounds the work of the checks after it.
    """
    count = 1 + len(start.also)
    if len(subs) + count > max_subscriptions:
        adds = "" if count == 1 else f" and this start adds {count:,}"
        raise errors.error(
            Reason.INVALID_REQUEST,
            f"this call already carries {len(subs):,} subscriptions{adds} (follow_max_subscriptions is "
            f"{max_subscriptions:,}); open another call",
        )
    ids = [start.id, *start.also]
    for sid in ids:
        if sid in subs:
            raise errors.error(Reason.INVALID_REQUEST, f"subscription id {sid} is already in use on this call")
    if count > 1 and len(set(ids)) < count:
        raise errors.error(Reason.INVALID_REQUEST, f"the start of subscription {start.id} names an id twice (its also)")
    if start.credit < 1:
        raise errors.error(
            Reason.INVALID_REQUEST,
            f"subscription {start.id} starts with credit {start.credit}: grant at least 1 message",
        )
    return [FollowSub(start, sid) for sid in ids]


def begin(group: list[FollowSub], n_shards: int, now_us: int) -> tuple[list[Cohort], list[bytes]]:
    """The cohorts the subscriptions of one start begin in, or a failure answer for each.

    With shared answers they begin as one cohort (they stand at one
    position), else each in a cohort of its own.
    """
    start = group[0].start
    try:
        try:
            levels = validate_filter(start.topic_filter)
        except TopicError as err:
            raise errors.error(Reason.INVALID_TOPIC_FILTER, str(err)) from None
        if not 0 <= start.shard < n_shards:
            raise errors.error(
                Reason.UNKNOWN_SHARD, f"shard {start.shard} does not exist; shards are 0 to {n_shards - 1}"
            )
        limit = now_us + AHEAD_US
        if start.after_us > limit or start.start_time_us > limit:
            raise errors.error(
                Reason.INVALID_REQUEST,
                f"position {max(start.after_us, start.start_time_us)} is more than a day after this node's "
                "clock; start from a position an answer returned",
            )
    except MqdsError as err:
        return [], [failure(sub.id, start.shard, start.after_us, err) for sub in group]
    cohorts: list[Cohort] = []
    for sub in group:
        if not cohorts or not start.shared_answers:
            cohorts.append(Cohort(start, levels, start.after_us, start.shared_answers))
        cohorts[-1].add(sub, sub.limit_at)
    return cohorts, []


def failure(sub_id: int, shard: int, position: int, err: MqdsError) -> bytes:
    """A subscription's failure answer (it ends the subscription), encoded."""
    response = pb.FollowResponse(id=sub_id, shard=shard, position_us=position)
    response.failure.shard = shard
    response.failure.reason = err.reason.value
    response.failure.message = err.message
    response.failure.metadata.update(err.metadata)
    return response.SerializeToString()
