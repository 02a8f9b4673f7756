"""Shared subscriptions in ``mqds broker``: ``$share/<group>/<filter>`` served by the cluster's share groups.

amqtt has no shared subscriptions (it takes ``$share/...`` as a plain filter
that no topic matches), so the plugin serves them: each connection with a
shared subscription is a member of the cluster's share group (member = its
clientid, :class:`~mqds.client.aio.AsyncSharedSubscription`), and a
:class:`SharedMember` task per (connection, shared subscription) fetches the
member's messages and sends them to the client. With the plugin's redelivery
policy (its ``queue_*`` settings) the cluster counts each delivery and gives a
message that was not acknowledged within the ack wait to whichever member
reads its shard then. ``$queue/<filter>`` is EMQX's name for the group
``$queue``. See ``DESIGN.md`` next to this package: "Shared subscriptions".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from mqds.broker.subscriptions import SHARED_PREFIXES
from mqds.client.aio.share_members import AsyncSharedSubscription
from mqds.client.model import Message
from mqds.protocol import share_groups
from mqds.protocol.errors import MqdsError
from mqds.protocol.topics import matches

if TYPE_CHECKING:
    from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
    from amqtt.session import Session

    from mqds.client import aio
    from mqds.protocol.delivery import Policy

__all__ = ["SharedFilter", "SharedMember", "SharedMembers", "shared_filter"]

log = logging.getLogger("mqds.broker.amqtt")

QUEUE_GROUP = "$queue"
"""The group of EMQX's ``$queue/<filter>``."""
_STOP_S = 5.0
"""How long stopping a member waits for its task before giving its messages back and leaving."""


@dataclass(frozen=True)
class SharedFilter:
    """A shared subscription's filter taken apart: ``$share/<group>/<filter>`` or ``$queue/<filter>``."""

    group: str
    topic_filter: str


def shared_filter(subscription: str) -> SharedFilter | None:
    """The group and filter of a shared subscription; None for a plain filter.

    Raises ValueError naming what is wrong with a malformed one (an empty or
    wildcard group, an empty or invalid filter): the plugin refuses it at SUBACK.
    """
    if not subscription.startswith(SHARED_PREFIXES):
        return None
    if subscription.startswith("$queue/"):
        group, rest = QUEUE_GROUP, subscription[len("$queue/") :]
    else:
        parts = subscription.split("/", 2)
        if len(parts) != 3:
            raise ValueError(f"{subscription!r}: expected $share/<group>/<filter>")
        group, rest = parts[1], parts[2]
    try:
        share_groups.check(group, rest, "member")
    except MqdsError as err:
        raise ValueError(f"{subscription!r}: {err.message}") from None
    return SharedFilter(group, rest)


class _Options(Protocol):
    max_inflight: int
    shared_poll_ms: int
    shared_lease_s: int
    timeout_s: float


class _Plugin(Protocol):
    """What the members need of the plugin (:class:`~mqds.broker.amqtt.plugin.MqdsPlugin`)."""

    @property
    def client(self) -> aio.Client: ...

    @property
    def config(self) -> _Options: ...

    @property
    def redelivery(self) -> Policy | None: ...

    def count(self, what: str, n: int = 1) -> None: ...

    async def others_allow(self, session: Session, topic: str) -> bool: ...


class SharedMember:
    """One connection's shared subscription: joined to the group, a task sending the member's messages.

    The task fetches at most ``max_inflight`` messages at a time (with the
    policy, also at most its ``max_unacked``), sends them with at most
    ``max_inflight`` awaiting their PUBACK, acknowledges each in order once the
    client acknowledged it, and fetches again: at once after a full batch,
    else when a matching publish was stored (:meth:`wake`) or after
    ``shared_poll_ms``. Stopping gives back what was sent and not acknowledged
    (``Client.nack``: due again at once, for the member that reads its shard
    next) and leaves the group.
    """

    def __init__(
        self,
        plugin: _Plugin,
        session: Session,
        handler: BrokerProtocolHandler,
        subscription: str,
        shared: SharedFilter,
        qos: int,
    ) -> None:
        self.plugin = plugin
        self.clientid: str = session.client_id or ""
        self.session = session
        self.handler = handler
        self.subscription = subscription
        self.shared = shared
        self.qos = qos
        policy = plugin.redelivery
        self.member = AsyncSharedSubscription(
            plugin.client,
            shared.group,
            shared.topic_filter,
            self.clientid,
            lease_s=plugin.config.shared_lease_s,
            policy=policy,
        )
        self.batch = max(1, min(plugin.config.max_inflight, policy.max_unacked if policy is not None else 1 << 30))
        self.open = True
        self.rejoin = False
        self._wakeup = asyncio.Event()
        # Sent (or being sent) and not acknowledged in mqds yet: given back at the stop.
        self._unsettled: dict[tuple[Any, ...], tuple[Message, bool]] = {}
        self._sending: set[asyncio.Task[None]] = set()  # with a policy: the sends awaiting their PUBACK
        self._taken_at: dict[tuple[Any, ...], float] = {}  # with a policy: when each unsettled one was fetched
        self.task: asyncio.Task[None] | None = None

    async def join(self) -> None:
        """Join the group now (before SUBACK: what is published after it is the group's); a failure is logged
        and the task joins at its first fetch."""
        try:
            await self.member.join()
        except Exception as err:
            self.plugin.count("errors")
            log.warning("client %s: joining shared subscription %r failed: %s", self.clientid, self.subscription, err)

    def start(self) -> None:
        if self.task is None and self.open:
            self.task = asyncio.create_task(self._run(), name=f"mqds-amqtt-share-{self.clientid}")

    def wake(self) -> None:
        self._wakeup.set()

    def matches(self, topic: str) -> bool:
        return matches(self.shared.topic_filter, topic)

    async def _run(self) -> None:
        poll_s = self.plugin.config.shared_poll_ms / 1000
        while self.open:
            self._wakeup.clear()
            try:
                if self.session.transitions.state != "connected":
                    pass  # closing: nothing is taken that cannot be sent (the disconnect stops this task)
                elif self.rejoin:
                    self.rejoin = False
                    await self.member.join()
                    continue
                elif self.member.policy is not None:
                    room = self.batch - len(self._sending)
                    messages = await self.member.fetch(room) if room > 0 else []
                    for message in messages:
                        self._start_send(message)
                    if messages and len(messages) >= room:
                        continue
                else:
                    messages = await self.member.fetch(self.batch)
                    if messages:
                        await self._send(messages)
                        if len(messages) >= self.batch:
                            continue
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self.plugin.count("errors")
                log.warning("client %s: shared subscription %r: %s", self.clientid, self.subscription, err)
            if self.open:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), poll_s)

    def _start_send(self, message: Message) -> None:
        """With a policy: send one message on its own, acknowledging its delivery once the client did (in any
        order: each delivery ends by itself), so one the client is slow to acknowledge holds up no other."""
        self._unsettled[_key(message)] = (message, False)
        self._taken_at[_key(message)] = time.monotonic()
        task = asyncio.create_task(self._send_one(message))
        self._sending.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._sending.discard(task)
        self._wakeup.set()  # room for more

    async def _send_one(self, message: Message) -> None:
        if not await self.plugin.others_allow(self.session, message.topic):
            self.plugin.count("refused_by_topic_filter")
            await self._ack(message)  # this member may not have it: its delivery ends here
            return
        self._unsettled[_key(message)] = (message, True)
        try:
            await self.handler.mqtt_publish(message.topic, message.payload, min(self.qos, message.qos), False)
        except Exception:  # no PUBACK in time (amqtt waits 5 s), or the connection ended
            self.plugin.count("delivery_failed")
            if self.session.transitions.state == "connected":
                self._unsettled.pop(_key(message), None)  # due again after the ack wait, to this member or another
                self._taken_at.pop(_key(message), None)
            return  # else given back at the stop: due at once, for the member that reads its shard next
        self.plugin.count("delivered_shared")
        await self._ack(message)

    async def _send(self, messages: list[Message]) -> None:
        """Without a policy: send in order, up to ``max_inflight`` awaiting their PUBACK; acknowledge each in order
        once it came (an acknowledgement moves the group's position in the shard past the earlier messages), and
        stop at the first that failed (it comes again from the next fetch)."""
        window: collections.deque[tuple[Message, asyncio.Future[Any]]] = collections.deque()
        limit = max(1, self.plugin.config.max_inflight)
        for message in messages:
            self._unsettled[_key(message)] = (message, False)
        for message in messages:
            if not self.open or self.session.transitions.state != "connected":
                break
            if not await self.plugin.others_allow(self.session, message.topic):
                self.plugin.count("refused_by_topic_filter")
                await self._ack(message)  # this member may not have it: its delivery ends here
                continue
            self._unsettled[_key(message)] = (message, True)
            qos = min(self.qos, message.qos)
            window.append(
                (message, asyncio.ensure_future(self.handler.mqtt_publish(message.topic, message.payload, qos, False)))
            )
            if len(window) >= limit and not await self._settle(*window.popleft()):
                break
        while window:
            if not await self._settle(*window.popleft()):
                break
        for _, send in window:  # the connection failed: what is left is given back at the stop
            send.cancel()

    async def _settle(self, message: Message, send: asyncio.Future[Any]) -> bool:
        """Wait for one send; acknowledge it in mqds once the client did. False when it failed."""
        await asyncio.wait([send])
        if send.cancelled() or send.exception() is not None:
            self.plugin.count("delivery_failed")
            return False
        self.plugin.count("delivered_shared")
        await self._ack(message)
        return True

    async def _ack(self, message: Message) -> None:
        try:
            await self.member.ack(message)
            self._unsettled.pop(_key(message), None)
            self._taken_at.pop(_key(message), None)
            self.plugin.count("acked_shared")
        except Exception as err:  # comes again after the ack wait (or, without a policy, to the shard's next reader)
            self.plugin.count("ack_failed")
            log.warning("client %s: acknowledging shared %s failed: %s", self.clientid, message.topic, err)

    async def stop(self, leave: bool = True) -> None:
        """Stop sending, give back what was not acknowledged, and leave the group (``leave``)."""
        self.open = False
        self._wakeup.set()
        task = self.task
        tasks = [t for t in [task, *self._sending] if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_STOP_S)
        unsettled = list(self._unsettled.items())
        self._unsettled = {}
        policy = self.member.policy
        if policy is not None:
            # One taken longer ago than its shortest wait may be another member's delivery by now: a give-back
            # would end that one (the consumer is the group's), so it is left to come due by itself.
            wait_s = min((policy.ack_wait_ms, *policy.backoff_ms)) / 1000
            now = time.monotonic()
            unsettled = [(k, v) for k, v in unsettled if now - self._taken_at.get(k, 0.0) < wait_s]
        self._taken_at = {}
        timeout_s = self.plugin.config.timeout_s
        if policy is not None and unsettled:
            results = await asyncio.gather(
                *(
                    self.plugin.client.nack(
                        self.member.position_clientid, self.member.topic_filter, m, received=sent, timeout_s=timeout_s
                    )
                    for _, (m, sent) in unsettled
                ),
                return_exceptions=True,
            )
            given = sum(1 for r in results if not isinstance(r, BaseException))
            self.plugin.count("shared_given_back", given)
            if given < len(results):  # they come again after their ack wait
                log.warning("client %s: giving back %d shared messages failed", self.clientid, len(results) - given)
        if leave and self.member.assignment is not None:
            try:
                await self.plugin.client.leave_share_group(
                    self.shared.group, self.shared.topic_filter, self.clientid, timeout_s=timeout_s
                )
            except Exception as err:  # its shards move when its lease ends
                log.warning(
                    "client %s: leaving shared subscription %r failed: %s", self.clientid, self.subscription, err
                )


class SharedMembers:
    """The broker's shared-subscription members: one per (client, shared subscription) of a live connection."""

    def __init__(self, plugin: _Plugin) -> None:
        self.plugin = plugin
        self._members: dict[tuple[str, str], SharedMember] = {}

    def __len__(self) -> int:
        return len(self._members)

    async def begin(
        self, session: Session, handler: BrokerProtocolHandler, subscriptions: list[tuple[str, int]]
    ) -> None:
        """Before SUBACK: join the group of each new shared subscription (started by :meth:`confirm`)."""
        joins = []
        for subscription, qos in subscriptions:
            try:
                shared = shared_filter(subscription)
            except ValueError:
                continue  # refused at SUBACK (topic_filtering)
            if shared is None or not isinstance(qos, int) or not 0 <= qos <= 2:
                continue
            key = (session.client_id or "", subscription)
            member = self._members.get(key)
            if member is not None and member.handler is handler and member.open:
                member.qos = qos  # subscribed again: same member, the new QoS
                continue
            if member is not None:
                await member.stop(leave=False)  # a previous connection's: this one joins in its place
            member = SharedMember(self.plugin, session, handler, subscription, shared, qos)
            self._members[key] = member
            joins.append(member.join())
        await asyncio.gather(*joins)

    async def confirm(self, clientid: str, granted: set[str]) -> None:
        """After SUBACK: start the members whose subscription amqtt granted; the others leave."""
        for (owner, subscription), member in list(self._members.items()):
            if owner != clientid or member.task is not None:
                continue
            if subscription in granted:
                member.start()
                self.plugin.count("shared_members")
                self._regroup(member)
            else:
                await self._remove(member)

    async def resume(self, session: Session, handler: BrokerProtocolHandler, subscriptions: dict[str, int]) -> None:
        """A persistent session connected again with the shared subscriptions amqtt kept for it: join and start."""
        shared = [(f, q) for f, q in subscriptions.items() if f.startswith(SHARED_PREFIXES)]
        if shared:
            await self.begin(session, handler, shared)
            await self.confirm(session.client_id or "", {f for f, _ in shared})

    async def unsubscribed(self, clientid: str, subscription: str) -> None:
        member = self._members.get((clientid, subscription))
        if member is not None:
            await self._remove(member)

    async def disconnected(self, clientid: str) -> None:
        """The client's connection ended: each of its members gives back what it sent unacknowledged and leaves."""
        members = [m for (owner, _), m in self._members.items() if owner == clientid]
        await asyncio.gather(*(self._remove(m) for m in members))

    def wake(self, topic: str) -> None:
        """A message on ``topic`` was stored: the members whose filter matches fetch now."""
        for member in self._members.values():
            if member.open and member.matches(topic):
                member.wake()

    async def close(self) -> None:
        await asyncio.gather(*(self._remove(m) for m in list(self._members.values())))

    async def _remove(self, member: SharedMember) -> None:
        key = (member.clientid, member.subscription)
        if self._members.get(key) is member:
            del self._members[key]
        await member.stop()
        self._regroup(member)

    def _regroup(self, changed: SharedMember) -> None:
        """A member of this broker joined or left: its group's other members here learn their shards again now
        (members on other brokers do at their next lease renewal)."""
        for member in self._members.values():
            if member is not changed and member.shared == changed.shared and member.open:
                member.rejoin = True
                member.wake()


def _key(message: Message) -> tuple[Any, ...]:
    return (message.shard, message.timestamp_us)
