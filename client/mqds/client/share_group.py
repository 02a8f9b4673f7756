"""Shared subscriptions through the client: a member of ``$share/<group>/<filter>``.

The members of a group share one read position per shard (that of the
pseudo-client ``$share/<group>``, ``mqds.protocol.share_groups``), and each
shard is read by one member at a time. ``SharedSubscription`` is one member:
it joins (and renews its lease as it fetches), fetches the stored messages of
its shards after the group's position, acknowledges them (moving the group's
position) and leaves. When a member joins or leaves, the shards are dealt
again; the new reader of a moved shard goes on from the group's position, so
nothing acknowledged is delivered again and nothing stored is skipped (what
the old reader delivered and did not acknowledge comes again: at least once,
as QoS 1). A member that stops renewing loses its shards when its lease ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mqds.client.model import Message
from mqds.client.operations import ShardCall
from mqds.protocol import share_groups
from mqds.protocol.sharding import shard_of
from mqds.v1 import sessions_pb2 as spb

if TYPE_CHECKING:
    from mqds.client.client import Client


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


class SharedSubscription:
    """One member of a share group: ``fetch`` its shards' messages, ``ack`` them, ``leave`` at the end."""

    def __init__(
        self,
        client: Client,
        group: str,
        topic_filter: str,
        member: str,
        *,
        lease_s: int = 30,
        start: str = "now",
    ) -> None:
        share_groups.check(group, topic_filter, member, lease_s)
        if start not in ("now", "earliest"):
            raise ValueError(f"start must be 'now' or 'earliest', got {start!r}")
        self.client = client
        self.group = group
        self.topic_filter = topic_filter
        self.member = member
        self.lease_s = lease_s
        self.start = start
        self.position_clientid = share_groups.position_client(group)
        self.assignment: ShareAssignment | None = None
        self._joined_at = 0.0

    def join(self) -> ShareAssignment:
        """Join the group, or renew this member's lease; the shards it reads now."""
        if self.assignment is None and self.start == "now":
            # The group's position starts now unless the group has one (MQTT: from the subscription on).
            self.client.start_read_position(self.position_clientid, self.topic_filter)
        self.assignment = self.client.join_share_group(self.group, self.topic_filter, self.member, self.lease_s)
        self._joined_at = time.monotonic()
        return self.assignment

    @property
    def shards(self) -> list[int]:
        return self.assignment.shards if self.assignment is not None else []

    def fetch(self, max_count: int = 500) -> list[Message]:
        """The next stored messages of this member's shards after the group's position (renewing the lease
        once half of it passed, and learning the shards again then)."""
        if self.assignment is None or time.monotonic() - self._joined_at >= self.lease_s / 2:
            self.join()
        if not self.shards:
            return []
        return self.client.fetch_offline(
            self.position_clientid, self.topic_filter, max_count=max_count, shards=self.shards
        )

    def ack(self, message: Message) -> None:
        """Acknowledge a delivered message: the group's position in its shard moves up to it."""
        self.client.ack(self.position_clientid, self.topic_filter, message)

    def leave(self) -> None:
        """Leave the group at once: its shards go to the other members."""
        self.client.leave_share_group(self.group, self.topic_filter, self.member)
        self.assignment = None
