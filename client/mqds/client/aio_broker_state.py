"""The asyncio client's broker-state calls: clients, subscriptions, retained messages, offline delivery.

A part of :class:`mqds.client.aio.Client` (it inherits
:class:`AsyncBrokerStateCalls`), as :mod:`mqds.client.broker_state` is of the
synchronous client: what a broker keeps besides messages, each call keyed by
a clientid or a topic (``operations.py`` builds the requests and parses the
answers).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from typing import TypeVar

from mqds.client import operations as ops
from mqds.client.model import ClientState, Message, ReadPosition
from mqds.client.offline import OfflineFetch, SharedFetch
from mqds.client.operations import FanoutCall, ShardCall
from mqds.client.retry import time_left
from mqds.client.share_group import ShareAssignment, share_group_call

T = TypeVar("T")


class AsyncBrokerStateCalls(abc.ABC):
    """The broker-state calls of :class:`mqds.client.aio.Client`, which implements the three calls below."""

    @abc.abstractmethod
    def _deadline(self, timeout_s: float | None) -> float:
        """The monotonic time a call of ``timeout_s`` (None: the client's default) must end by."""

    @abc.abstractmethod
    async def _keyed_call(self, build: Callable[[int], ShardCall[T]], timeout_s: float | None) -> T:
        """A call to the shard of a key: ``build`` gets the cluster's shard count."""

    @abc.abstractmethod
    async def _fanout_call(self, call: FanoutCall[T], timeout_s: float | None) -> list[T]:
        """A call to every shard's leader, merged."""

    @abc.abstractmethod
    async def _n_shards(self, deadline: float) -> int:
        """The cluster's shard count (waiting for a first map until ``deadline``)."""

    async def client_connected(
        self, clientid: str, node: str, timeout_s: float | None = None, *, session_expiry_s: int | None = None
    ) -> ClientState:
        """Record that ``clientid`` connected to broker ``node`` (online, node, online time) and return that.

        ``session_expiry_s`` is the Session Expiry Interval it connected with
        (MQTT 5, seconds: 0 its session ends when it disconnects,
        ``SESSION_NEVER_EXPIRES`` never); None (an MQTT 3.1.1 client) takes
        the node's ``session_expiry_default_s``. Once it has been offline that
        long, its state, proxy subscriptions and read positions are removed.
        A session that ended before this connect starts afresh.
        """
        state = await self._keyed_call(lambda n: ops.client_connected(clientid, node, n, session_expiry_s), timeout_s)
        assert state is not None  # a connect always leaves a record
        return state

    async def client_disconnected(
        self,
        clientid: str,
        node: str | None = None,
        timeout_s: float | None = None,
        *,
        session_expiry_s: int | None = None,
    ) -> ClientState | None:
        """Record that ``clientid`` disconnected (offline, offline time); the new state, None if unknown.

        With ``node``, only if the client is still recorded on that node, so a
        late disconnect from a broker the client already left (it reconnected
        elsewhere) does not mark it offline; None then too.
        ``session_expiry_s`` replaces the interval it connected with (MQTT 5's
        DISCONNECT may carry one); the state says when the session expires.
        """
        return await self._keyed_call(lambda n: ops.client_disconnected(clientid, node, n, session_expiry_s), timeout_s)

    async def client_state(
        self, clientid: str, *, stale_ok: bool = False, timeout_s: float | None = None
    ) -> ClientState | None:
        """What mqds knows of ``clientid``'s connection, or None if it never connected."""
        return await self._keyed_call(lambda n: ops.client_state(clientid, n, stale_ok), timeout_s)

    async def clients_on_node(self, node: str, *, stale_ok: bool = False, timeout_s: float | None = None) -> list[str]:
        """The clientids recorded online on broker ``node``, sorted."""
        return await self._fanout_call(ops.clients_on_node(node, stale_ok), timeout_s)

    async def subscribe(self, clientid: str, topic_filter: str, qos: int = 1, timeout_s: float | None = None) -> None:
        """Add (or change the QoS of) a proxy subscription of ``clientid``."""
        await self._keyed_call(lambda n: ops.subscribe(clientid, topic_filter, qos, n), timeout_s)

    async def unsubscribe(self, clientid: str, topic_filter: str, timeout_s: float | None = None) -> bool:
        """Remove a proxy subscription; whether it existed. The read position stays (see ``forget_acks``)."""
        return await self._keyed_call(lambda n: ops.unsubscribe(clientid, topic_filter, n), timeout_s)

    async def subscriptions(
        self, clientid: str, *, stale_ok: bool = False, timeout_s: float | None = None
    ) -> dict[str, int]:
        """The proxy subscriptions of ``clientid``: topic filter -> QoS, the filters sorted."""
        return await self._keyed_call(lambda n: ops.subscriptions(clientid, n, stale_ok), timeout_s)

    async def retain(self, message: Message, timeout_s: float | None = None) -> Message | None:
        """Keep ``message`` as its topic's retained message; an empty payload deletes it.

        Returns the retained message as stored (``timestamp_us`` and ``shard``
        set, ``retain`` true), or None when it deleted. Retained messages are
        kept in the shard of their topic, apart from the message store.
        """
        return await self._keyed_call(lambda n: ops.retain(message, n), timeout_s)

    async def retained(
        self, topic_filter: str, *, stale_ok: bool = False, timeout_s: float | None = None
    ) -> list[Message]:
        """The retained message of every topic matching ``topic_filter``, sorted by topic."""
        return await self._fanout_call(ops.retained(topic_filter, stale_ok), timeout_s)

    async def fetch_offline(
        self,
        clientid: str,
        topic_filter: str,
        mode: str = "pubsub",
        max_count: int = 500,
        time_range_s: float | None = None,
        *,
        include_qos0: bool = False,
        start: str = "earliest",
        shards: Iterable[int] | None = None,
        timeout_s: float | None = None,
    ) -> list[Message]:
        """Stored messages for a subscriber that was offline: oldest first, at most ``max_count``.

        ``mode="pubsub"`` (one-to-many): the messages matching ``topic_filter``
        after this (clientid, filter)'s read position, which ``ack`` moves;
        every subscriber has its own. ``mode="queue"`` (one-to-one): the
        matching messages no queue reader has acknowledged yet; an
        unacknowledged one comes again. Only QoS 1 and 2 messages unless
        ``include_qos0``; with ``time_range_s``, only messages newer than that
        many seconds. Each message has ``shard`` and ``timestamp_us`` set: its
        position, which ``ack`` takes.

        ``start`` says where a pubsub pair without a read position begins:
        ``"earliest"``, the whole stored history (it gets no position until it
        acknowledges); ``"now"``, what is stored from now on, as MQTT has it for
        a new subscription (the pair's read position is started now, see
        ``start_read_position``; a pair that has one reads on from it).
        ``shards``: only these shards (a share group's member reads its own).
        """
        fetch = ops.FetchOffline.check(clientid, topic_filter, mode, max_count, time_range_s, include_qos0, start)
        deadline = self._deadline(timeout_s)
        position: ReadPosition | None = None
        if fetch.pubsub:
            read = self.start_read_position if fetch.start_now else self.read_position
            position = await read(clientid, topic_filter, timeout_s=timeout_s)
        return fetch.cut(await self._fanout_call(fetch.messages(position, shards), time_left(deadline)))

    async def fetch_offline_many(
        self,
        requests: Iterable[OfflineFetch | tuple[str, str]],
        mode: str = "pubsub",
        max_count: int = 500,
        time_range_s: float | None = None,
        *,
        include_qos0: bool = False,
        start: str = "earliest",
        timeout_s: float | None = None,
    ) -> list[list[Message]]:
        """``fetch_offline`` for many sessions at once, in shared calls: each request's messages, in order.

        ``requests`` are ``(clientid, topic_filter)`` pairs, which take this
        call's other arguments, or :class:`mqds.client.OfflineFetch` values
        with options of their own (a broker's rules differ by filter). Each
        request gets exactly the list ``fetch_offline`` would return for it
        (read position, ``mode``, ``max_count``, ``time_range_s``,
        ``include_qos0`` and ``start`` alike); a pair that two requests name,
        one with ``start="now"`` and one with ``"earliest"``, is read by the
        second as if the first came after it.

        What it costs: the read positions in one call per node for all the
        pairs whose shards it leads, then one ``FetchMessagesShared`` call
        per node for all the sessions, in which each shard is scanned once
        per topic filter (not once per session) and a message several
        sessions need travels once; both in chunks of 1,000 sessions
        (``MAX_SESSIONS_PER_CALL``). A session a node's answer bound cut
        short is asked for the rest at once. A message that several sessions
        get is one ``Message`` object in their lists: do not modify it.
        One failure (after the call's retries) fails the whole call.
        """
        requests = list(requests)
        if not requests:
            return []
        deadline = self._deadline(timeout_s)
        defaults = OfflineFetch("", "", mode, max_count, time_range_s, include_qos0, start)
        plan = SharedFetch(requests, defaults, await self._n_shards(deadline))
        for positions in plan.position_calls():
            plan.record_positions(await self._fanout_call(positions, time_left(deadline)))
        while rounds := plan.fetch_rounds():
            for shared in rounds:
                shared.record(await self._fanout_call(shared.call, time_left(deadline)))
        return plan.results()

    async def read_position(self, clientid: str, topic_filter: str, *, timeout_s: float | None = None) -> ReadPosition:
        """How far the (clientid, filter) pair has read in pubsub mode (``found`` False: it has no position)."""
        return await self._keyed_call(lambda n: ops.read_position(clientid, topic_filter, n), timeout_s)

    async def start_read_position(
        self, clientid: str, topic_filter: str, *, timeout_s: float | None = None
    ) -> ReadPosition:
        """Start the pair's read position now, unless it has one; the pair's position either way.

        A started position reads only what is stored after it: a new MQTT
        subscription's offline delivery begins at its SUBSCRIBE. Message
        timestamps come from each shard leader's clock, so "after" holds to
        within the nodes' clock skew (NTP keeps it to milliseconds).
        """
        return await self._keyed_call(lambda n: ops.start_read_position(clientid, topic_filter, n), timeout_s)

    async def ack(
        self, clientid: str, topic_filter: str, message: Message, mode: str = "pubsub", timeout_s: float | None = None
    ) -> None:
        """Acknowledge a message delivered to ``clientid`` through ``topic_filter``.

        ``pubsub``: moves this (clientid, filter)'s read position in the
        message's shard up to the message (acknowledging a message also
        acknowledges the earlier ones of its shard: brokers deliver in order).
        ``queue``: removes the message for every queue reader. ``message``
        must carry its position (``shard``, ``timestamp_us``), as
        ``fetch_offline`` and ``store_batch`` return it.
        """
        await self._keyed_call(lambda n: ops.ack(clientid, topic_filter, message, mode, n), timeout_s)

    async def forget_acks(self, clientid: str, topic_filter: str, timeout_s: float | None = None) -> bool:
        """Delete the (clientid, filter) read position (the seed backends' ``on_acked_delete``); whether it existed."""
        return await self._keyed_call(lambda n: ops.forget_acks(clientid, topic_filter, n), timeout_s)

    async def forget_session(self, clientid: str, timeout_s: float | None = None) -> tuple[int, int]:
        """Delete every proxy subscription and read position of ``clientid`` (an MQTT clean session discards
        the previous session); (subscriptions, read positions) deleted. Its client state stays."""
        return await self._keyed_call(lambda n: ops.forget_session(clientid, n), timeout_s)

    async def join_share_group(
        self, group: str, topic_filter: str, member: str, lease_s: int = 30, timeout_s: float | None = None
    ) -> ShareAssignment:
        """As :meth:`mqds.client.Client.join_share_group`."""
        return await self._keyed_call(
            lambda n: share_group_call("JoinShareGroup", group, topic_filter, member, lease_s, n), timeout_s
        )

    async def leave_share_group(
        self, group: str, topic_filter: str, member: str, timeout_s: float | None = None
    ) -> ShareAssignment:
        """As :meth:`mqds.client.Client.leave_share_group`."""
        return await self._keyed_call(
            lambda n: share_group_call("LeaveShareGroup", group, topic_filter, member, 0, n), timeout_s
        )
