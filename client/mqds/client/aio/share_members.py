"""Shared subscriptions through the client: a member of ``$share/<group>/<filter>``, for either client.

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

With a delivery ``policy`` (:class:`mqds.protocol.delivery.Policy`) the group
is a redelivering consumer instead (``Client.deliver``, consumer
``$share/<group>``): ``fetch`` returns its shards' due redeliveries and new
messages, each delivery counted in the cluster, ``ack`` ends a delivery (mode
``delivery``), and what a member took and did not acknowledge is delivered
again after the ack wait to whichever member reads that shard then (the one
that took it, or another after it left), and dead-lettered after its last
delivery. All members of a group use the same mode.

Each driver's ``SharedSubscription`` makes a member's calls through its
client; a member's state, and when it must join again, is
:class:`~mqds.client.core.share_group.ShareMember` (no I/O).
``client/generate_sync.py`` writes the synchronous client's
``share_members.py`` from this file.
"""

from __future__ import annotations

from mqds.client.aio.client import Client
from mqds.client.core.share_group import ShareAssignment, ShareMember
from mqds.client.model import Message
from mqds.protocol.delivery import Policy

__all__ = ["AsyncSharedSubscription"]


class AsyncSharedSubscription(ShareMember):
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
        policy: Policy | None = None,
    ) -> None:
        super().__init__(group, topic_filter, member, lease_s, start)
        self.client = client
        self.policy = policy
        """With a delivery policy, the cluster redelivers what the group's members do not acknowledge."""
        self._start_us = 0

    async def join(self) -> ShareAssignment:
        """Join the group, or renew this member's lease; the shards it reads now."""
        if self._starts_position():
            position = await self.client.start_read_position(self.position_clientid, self.topic_filter)
            self._start_us = position.start_us  # where the group's deliveries begin in a shard new to it
        assignment = await self.client.join_share_group(self.group, self.topic_filter, self.member, self.lease_s)
        return self._joined(assignment)

    async def fetch(self, max_count: int = 500) -> list[Message]:
        """The next stored messages of this member's shards after the group's position (renewing the lease
        once half of it passed, and learning the shards again then)."""
        if self._renew_due():
            await self.join()
        if not self.shards:
            return []
        if self.policy is not None:
            delivered = await self.client.deliver(
                self.position_clientid,
                self.topic_filter,
                self.policy,
                max_count,
                start_after_us=self._start_us,
                shards=self.shards,
            )
            return delivered.messages
        return await self.client.fetch_offline(
            self.position_clientid, self.topic_filter, max_count=max_count, shards=self.shards
        )

    async def ack(self, message: Message) -> None:
        """Acknowledge a delivered message: the group's position in its shard moves up to it (with a policy: its
        delivery ends)."""
        mode = "pubsub" if self.policy is None else "delivery"
        await self.client.ack(self.position_clientid, self.topic_filter, message, mode=mode)

    async def leave(self) -> None:
        """Leave the group at once: its shards go to the other members."""
        await self.client.leave_share_group(self.group, self.topic_filter, self.member)
        self.assignment = None
