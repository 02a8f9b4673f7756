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

:class:`AsyncSharedSubscription` is the same member for the asyncio client;
both keep their state and decide when to join again in :class:`ShareMember`.
A member needs only its client's broker-state calls
(:class:`~mqds.client.broker_state.BrokerStateCalls`, or the asyncio
:class:`~mqds.client.aio_broker_state.AsyncBrokerStateCalls`), which both
clients are.
"""

from __future__ import annotations

import time

from mqds.client.aio_broker_state import AsyncBrokerStateCalls
from mqds.client.broker_state import BrokerStateCalls
from mqds.client.model import Message
from mqds.client.share_group import ShareAssignment
from mqds.protocol import share_groups

__all__ = ["AsyncSharedSubscription", "ShareMember", "SharedSubscription"]


class ShareMember:
    """A member's state, shared by both clients' members: its group, its assignment, when it must join again.

    No I/O: :class:`SharedSubscription` and :class:`AsyncSharedSubscription`
    make the calls it names.
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


class SharedSubscription(ShareMember):
    """One member of a share group: ``fetch`` its shards' messages, ``ack`` them, ``leave`` at the end."""

    def __init__(
        self,
        client: BrokerStateCalls,
        group: str,
        topic_filter: str,
        member: str,
        *,
        lease_s: int = 30,
        start: str = "now",
    ) -> None:
        super().__init__(group, topic_filter, member, lease_s, start)
        self.client = client

    def join(self) -> ShareAssignment:
        """Join the group, or renew this member's lease; the shards it reads now."""
        if self._starts_position():
            self.client.start_read_position(self.position_clientid, self.topic_filter)
        return self._joined(self.client.join_share_group(self.group, self.topic_filter, self.member, self.lease_s))

    def fetch(self, max_count: int = 500) -> list[Message]:
        """The next stored messages of this member's shards after the group's position (renewing the lease
        once half of it passed, and learning the shards again then)."""
        if self._renew_due():
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


class AsyncSharedSubscription(ShareMember):
    """One member of a share group, for the asyncio client: as :class:`SharedSubscription`, its calls awaited."""

    def __init__(
        self,
        client: AsyncBrokerStateCalls,
        group: str,
        topic_filter: str,
        member: str,
        *,
        lease_s: int = 30,
        start: str = "now",
    ) -> None:
        super().__init__(group, topic_filter, member, lease_s, start)
        self.client = client

    async def join(self) -> ShareAssignment:
        """Join the group, or renew this member's lease; the shards it reads now."""
        if self._starts_position():
            await self.client.start_read_position(self.position_clientid, self.topic_filter)
        assignment = await self.client.join_share_group(self.group, self.topic_filter, self.member, self.lease_s)
        return self._joined(assignment)

    async def fetch(self, max_count: int = 500) -> list[Message]:
        """The next stored messages of this member's shards after the group's position (renewing the lease
        once half of it passed, and learning the shards again then)."""
        if self._renew_due():
            await self.join()
        if not self.shards:
            return []
        return await self.client.fetch_offline(
            self.position_clientid, self.topic_filter, max_count=max_count, shards=self.shards
        )

    async def ack(self, message: Message) -> None:
        """Acknowledge a delivered message: the group's position in its shard moves up to it."""
        await self.client.ack(self.position_clientid, self.topic_filter, message)

    async def leave(self) -> None:
        """Leave the group at once: its shards go to the other members."""
        await self.client.leave_share_group(self.group, self.topic_filter, self.member)
        self.assignment = None
