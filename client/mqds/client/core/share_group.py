"""Share groups through the client: the join and leave calls, and the assignment they answer with.

The members of a group ``$share/<group>/<filter>`` share one read position
per shard (that of the pseudo-client ``$share/<group>``,
``mqds.protocol.share_groups``), and each shard is read by one member at a
time. :func:`share_group_call` builds ``JoinShareGroup`` and
``LeaveShareGroup``, sent to the shard that keeps the group, for both
clients' ``join_share_group`` / ``leave_share_group``; a member that
fetches, acknowledges and renews is each driver's ``share_members`` module
(:class:`mqds.client.SharedSubscription`); its state is :class:`ShareMember`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mqds.client.core.operations import ShardCall
from mqds.protocol import share_groups
from mqds.protocol.sharding import shard_of
from mqds.v1 import sessions_pb2 as spb


@dataclass(frozen=True)
class ShareAssignment:
    """A share group after a join or a leave: its live members, the shards of the member that asked."""

    members: list[str]
    shards: list[int]
    position_clientid: str
    """The pseudo-client whose read positions the members share (``$share/<group>``)."""


def share_group_call(
    method: str, group: str, topic_filter: str, member: str, lease_s: int, n_shards: int
) -> ShardCall[ShareAssignment]:
    """JoinShareGroup or LeaveShareGroup, sent to the shard that keeps the group."""
    share_groups.check(group, topic_filter, member, lease_s or 1)
    request = spb.ShareGroupRequest(group=group, topic_filter=topic_filter, member=member, lease_s=lease_s)
    return ShardCall(
        method,
        shard_of(share_groups.position_client(group), n_shards),
        request,
        lambda r: ShareAssignment(list(r.members), list(r.shards), r.position_clientid),
        service="Sessions",
    )


class ShareMember:
    """A member's state, shared by both clients' members: its group, its assignment, when it must join again.

    No I/O: :class:`mqds.client.SharedSubscription` and
    :class:`mqds.client.aio.AsyncSharedSubscription` make the calls it names.
    """

    def __init__(self, group: str, topic_filter: str, member: str, lease_s: int, start: str) -> None:
        share_groups.check(group, topic_filter, member, lease_s)
        if start not in ("now", "earliest"):
            raise ValueError(f"start must be 'now' or 'earliest', got {start!r}")
        self.group = group
        self.topic_filter = topic_filter
        self.member = member
        self.lease_s = lease_s
        self.start = start
        self.position_clientid = share_groups.position_client(group)
        self.assignment: ShareAssignment | None = None
        self._joined_at = 0.0

    @property
    def shards(self) -> list[int]:
        """The shards this member reads now ([] before it joined, or after it left)."""
        return self.assignment.shards if self.assignment is not None else []

    def _starts_position(self) -> bool:
        """Whether joining starts the group's position first: the first join of a member with ``start="now"``
        (the position starts now unless the group has one: MQTT delivers from the subscription on)."""
        return self.assignment is None and self.start == "now"

    def _joined(self, assignment: ShareAssignment) -> ShareAssignment:
        self.assignment = assignment
        self._joined_at = time.monotonic()
        return assignment

    def _renew_due(self) -> bool:
        """Whether a fetch joins again first: not joined yet, or half of the lease passed."""
        return self.assignment is None or time.monotonic() - self._joined_at >= self.lease_s / 2
