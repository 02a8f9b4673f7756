"""What the plugin sends one client of a persistent session, in order, and the acknowledgements that follow.

A :class:`_Connection` per connection: one queue of items (connect, subscribe,
unsubscribe, live messages, close), a delivery window of ``max_inflight``
sends awaiting their PUBACK/PUBCOMP, and the ``message_acked`` calls that
follow the client's acknowledgements in order. See ``DESIGN.md`` next to
this package: "Persistent sessions are served from mqds".
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from mqds.broker.amqtt.internals import NEW_IN_AMQTT
from mqds.broker.subscriptions import SHARED_PREFIXES
from mqds.client.model import Message
from mqds.protocol.topics import matches

if TYPE_CHECKING:
    from amqtt.broker import BrokerContext
    from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
    from amqtt.session import Session

    from mqds.broker.actions import BrokerHooks

log = logging.getLogger("mqds.broker.amqtt")

# How many delivered positions a client remembers to skip live copies of what its offline fetch sent.
_SEEN_LIMIT = 65_536
_ACK_CONCURRENCY = 16
SLOW_ITEM_S = 5.0
"""A connection's item (connect, subscribe, close...) that takes longer is logged: what comes after it waits."""


class _Window(Protocol):
    max_inflight: int
    """Messages sent to one client that may await their PUBACK at once."""


class _Plugin(Protocol):
    """What a connection needs of the plugin (:class:`~mqds.broker.amqtt.plugin.MqdsPlugin`)."""

    @property
    def hooks(self) -> BrokerHooks: ...

    @property
    def broker_context(self) -> BrokerContext: ...

    @property
    def config(self) -> _Window: ...

    def count(self, what: str, n: int = 1) -> None: ...

    def amqtt_subscriptions(self, clientid: str) -> dict[str, int]: ...

    async def others_allow(self, session: Session, topic: str) -> bool: ...

    def keeps_retained(self, topic: str) -> bool: ...


@dataclass
class _Out:
    """One message to send to a client, and what to do once it is acknowledged."""

    message: Message
    qos: int
    kind: str  # "offline", "retained", "live" or "retained_copy": what the stats count it as
    retain: bool = False
    # Sent to the client; False for a stored copy of a retained publish that the retained lookup
    # covers: not sent, only acknowledged in its place in the order.
    send: bool = True
    # It has a stored position: pass it to message_acked once the client acknowledged it (PUBACK,
    # PUBCOMP), or once it was sent at QoS 0 (at most once: not again at the next connect).
    ack: bool = False


@dataclass
class _Connect:
    pass


@dataclass
class _Subscribe:
    topic_filter: str
    qos: int


@dataclass
class _Unsubscribe:
    topic_filter: str


@dataclass
class _Live:
    message: Message
    qos: int
    stored: bool


@dataclass
class _Close:
    record: bool  # run the client.disconnected rules (False: a newer connection of the client took over)


_Item = _Connect | _Subscribe | _Unsubscribe | _Live | _Close


class _Connection:
    """One connection of a client: everything the plugin sends it, in order, and its acknowledgements.

    A worker task handles the items one at a time; it starts only when the
    client's previous connection finished (its acknowledgements recorded, its
    disconnect recorded), so a reconnect fetches after what was acknowledged.
    """

    def __init__(
        self,
        plugin: _Plugin,
        clientid: str,
        session: Session,
        handler: BrokerProtocolHandler | None,
        previous: _Connection | None,
    ) -> None:
        self.plugin = plugin
        self.clientid = clientid
        self.session = session
        self.handler = handler
        self.persistent = session.clean_session is False
        # New to amqtt (the session.created rules run), even when mqds resumed it (_resume_session).
        self.new_session = session.parent == 0 or bool(session.attributes.pop(NEW_IN_AMQTT, False))
        self.open = True
        # Filters whose offline fetch has started: live messages matching them are sent by the plugin.
        self.active: dict[str, int] = {}
        self._items: collections.deque[_Item] = collections.deque()
        self._wakeup = asyncio.Event()
        self._seen: collections.OrderedDict[tuple[Any, ...], None] = collections.OrderedDict()
        # The retained publishes routed to this connection's live filters (topic, sender, payload): made
        # after the subscription, so each comes live (from amqtt, or the plugin's live and offline paths),
        # never from a retained lookup as well, nor flagged retained (MQTT). Bounded like _seen.
        self._routed: collections.OrderedDict[tuple[Any, ...], None] = collections.OrderedDict()
        self._failed_shards: set[int] = set()
        # Stored messages not delivered, each with whether it was sent (the connection closed before its
        # PUBACK) or not (closed before it was sent): given back at the close (``BrokerHooks.message_nacked``),
        # so a queue reader's next connection gets them at once, and one never sent is not counted.
        self._unsent: list[tuple[Message, bool]] = []
        # Delivered-and-confirmed messages to acknowledge; a future is a barrier
        # (set once everything queued before it was acknowledged); None ends the loop.
        self._acks: asyncio.Queue[Message | asyncio.Future[None] | None] = asyncio.Queue()
        self.task = asyncio.create_task(self._run(previous), name=f"mqds-amqtt-{clientid}")

    # -- the queue -----------------------------------------------------------------

    def put(self, item: _Item) -> None:
        self._items.append(item)
        self._wakeup.set()

    def close(self, record: bool) -> None:
        """Stop sending (at once) and finish: acknowledgements first, then the disconnect rules."""
        if self.open:
            self.open = False
            self.put(_Close(record))

    async def _next(self) -> _Item:
        while not self._items:
            self._wakeup.clear()
            await self._wakeup.wait()
        return self._items.popleft()

    def routed(self, message: Message) -> None:
        """amqtt routes the retained publish ``message`` now, and it matches one of this connection's live filters."""
        self._routed[_identity(message)] = None
        if len(self._routed) > _SEEN_LIMIT:
            self._routed.popitem(last=False)

    def _take_live(self, first: _Live) -> list[_Live]:
        """``first`` and the live messages queued right after it: sent as one pipelined batch."""
        batch = [first]
        while self._items and isinstance(self._items[0], _Live):
            item = self._items.popleft()
            assert isinstance(item, _Live)
            batch.append(item)
        return batch

    async def _run(self, previous: _Connection | None) -> None:
        if previous is not None:
            await asyncio.wait([previous.task])
        acks = asyncio.create_task(self._ack_loop(), name=f"mqds-amqtt-acks-{self.clientid}")
        record = True
        try:
            while True:
                item = await self._next()
                if isinstance(item, _Close):
                    record = item.record
                    break
                what, started = type(item).__name__.strip("_"), time.monotonic()
                try:
                    await self._handle(item)
                except Exception as err:
                    self.plugin.count("errors")
                    log.warning("client %s: %s failed: %s", self.clientid, what, err)
                self._note_slow(what.lower(), started)
        finally:
            self.open = False
            started = time.monotonic()
            self._acks.put_nowait(None)
            await asyncio.wait([acks])
            await self._give_back()
            self._note_slow("the acknowledgements before its disconnect", started)
            if record:
                started = time.monotonic()
                try:
                    await self.plugin.hooks.client_disconnected(self.clientid)
                except Exception as err:
                    self.plugin.count("errors")
                    log.warning("client %s: recording the disconnect failed: %s", self.clientid, err)
                self._note_slow("recording its disconnect", started)

    def _note_slow(self, what: str, started: float) -> None:
        """Log ``what`` when it took over :data:`SLOW_ITEM_S`: the client's later items waited that long."""
        took = time.monotonic() - started
        if took > SLOW_ITEM_S:
            self.plugin.count("slow_items")
            log.warning(
                "client %s: %s took %.1f s (the mqds calls it makes were slow); what came after it waited",
                self.clientid,
                what,
                took,
            )

    async def _handle(self, item: _Item) -> None:
        hooks = self.plugin.hooks
        if isinstance(item, _Connect):
            await self._connected()
        elif isinstance(item, _Subscribe):
            await self._subscribed(item.topic_filter, item.qos, send_retained=True)
        elif isinstance(item, _Unsubscribe):
            await hooks.session_unsubscribed(self.clientid, item.topic_filter)
        elif isinstance(item, _Live):
            outs = []
            for live in self._take_live(item):
                if live.stored and self._key(live.message) in self._seen:
                    continue  # the offline fetch already sent it
                outs.append(_Out(live.message, live.qos, "live", ack=live.stored))
            await self._deliver(outs)

    # -- what happens on connect and subscribe ---------------------------------------

    async def _connected(self) -> None:
        hooks = self.plugin.hooks
        clean = not self.persistent
        # MQTT 3.1.1 has no Session Expiry Interval: a clean session lasts as long as its connection (0), a
        # persistent one as the node's session_expiry_default_s says (None).
        expiry = 0 if clean else None
        # Retained messages go with a subscription when it is made (SUBSCRIBE, or a proxy subscription the
        # session did not have), never again when a session resumes: the filters it had are those amqtt
        # kept for it, and, for a session resumed from mqds (new to amqtt, session present), its proxies.
        had = set(self.plugin.amqtt_subscriptions(self.clientid))
        resumed_from_mqds = self.new_session and self.session.parent == 1
        proxies: dict[str, int] = {}
        if clean or hooks.config.rules_for("client.connected"):  # a clean session discards the previous one
            proxies.update(await hooks.client_connected(self.clientid, clean_start=clean, session_expiry_s=expiry))
        if self.new_session and hooks.config.rules_for("session.created"):
            proxies.update(await hooks.session_created(self.clientid, clean_start=clean, session_expiry_s=expiry))
        for topic_filter, qos in proxies.items():
            if topic_filter.startswith(SHARED_PREFIXES):
                log.warning(
                    "client %s: stored shared subscription %r not applied (shared subscriptions last as long as "
                    "the broker keeps the session)",
                    self.clientid,
                    topic_filter,
                )
                continue
            await self.plugin.broker_context.add_subscription(self.clientid, topic_filter, qos)
            self.plugin.count("proxy_subscriptions")
        if resumed_from_mqds:
            had |= set(proxies)
        for topic_filter, qos in self.plugin.amqtt_subscriptions(self.clientid).items():
            if not self.open:
                return
            if topic_filter.startswith(SHARED_PREFIXES):
                continue  # a member of its share group again (the plugin's SharedMembers.resume)
            await self._subscribed(topic_filter, qos, send_retained=topic_filter not in had)

    async def _subscribed(self, topic_filter: str, qos: int, *, send_retained: bool) -> None:
        # Active before the fetch: a live message stored after the fetch read is sent live;
        # one stored before is in the fetch (and its live copy skipped).
        self.active[topic_filter] = qos
        hooks = self.plugin.hooks
        delivery = await hooks.session_subscribed(
            self.clientid, topic_filter, qos, send_retained=send_retained, clean_start=not self.persistent
        )
        # When the retained lookup ran, it alone sends retained messages: flagged, once, never a deleted one.
        covered = delivery.looked_up
        outs = self._with_older_live(self._offline_outs(delivery.offline, qos, covered))
        for m in delivery.retained:
            key = ("retained", m.topic, m.timestamp_us)
            if key in self._seen or _identity(m) in self._routed:
                continue  # sent already, or published after the subscription was made: it comes live
            self._remember(key)
            outs.append(_Out(m, min(m.qos, qos), "retained", retain=True))
        await self._deliver(outs)
        more = delivery.more
        # A backlog over max_returned_count comes page by page: the read position
        # moves only with acknowledgements, so each page is acknowledged before
        # the next is fetched. Live messages wait behind (they are later), so
        # none is acknowledged past a message of the backlog not yet sent.
        while more and self.open:
            await self._acknowledged()
            page, more = await hooks.next_offline_page(self.clientid, topic_filter)
            outs = self._with_older_live(self._offline_outs(page, qos, covered))
            if not outs:
                break  # nothing new (a delivery or an acknowledgement failed): the rest comes at the next connect
            await self._deliver(outs)

    def _offline_outs(self, messages: list[Message], qos: int, covered: bool) -> list[_Out]:
        """The stored messages to send; with ``covered``, stored copies of retained publishes made before the
        subscription are only acknowledged (the retained lookup sends the topic's retained message, if it
        still has one); one published since is sent as the live message it is."""
        return [
            _Out(m, min(m.qos, qos), "retained_copy", ack=True, send=False)
            if covered and m.retain and self.plugin.keeps_retained(m.topic) and _identity(m) not in self._routed
            else _Out(m, min(m.qos, qos), "offline", ack=True)
            for m in messages
            if self._key(m) not in self._seen
        ]

    def _with_older_live(self, outs: list[_Out]) -> list[_Out]:
        """``outs`` (fetched, oldest first) with the queued live messages older than a fetched one of their shard.

        The filter went live at the SUBSCRIBE event and its read position
        started a little later, so a message stored in between is not in the
        fetch but waits in the queue, behind the fetch's later messages of its
        shard (another subscription of the client may match it too). Taken out
        of the queue and merged in timestamp order, each shard's messages, so
        each publisher's, arrive in order, and acknowledgements follow that
        order. Queued copies of fetched messages are dropped.
        """
        newest: dict[int, int] = {}
        for out in outs:
            shard, ts = out.message.shard, out.message.timestamp_us
            if shard is not None and ts is not None:
                newest[shard] = max(newest.get(shard, 0), ts)
        if not newest:
            return outs
        fetched = {self._key(out.message) for out in outs}
        older: list[_Out] = []
        keep: collections.deque[_Item] = collections.deque()
        for item in self._items:
            shard = item.message.shard if isinstance(item, _Live) and item.stored else None
            if not isinstance(item, _Live) or shard is None or (item.message.timestamp_us or 0) >= newest.get(shard, 0):
                keep.append(item)
            elif self._key(item.message) not in fetched and self._key(item.message) not in self._seen:
                older.append(_Out(item.message, item.qos, "live", ack=True))
        if len(keep) == len(self._items):
            return outs
        self._items = keep
        return sorted([*outs, *older], key=lambda out: (out.message.timestamp_us or 0, out.message.shard or 0))

    async def _acknowledged(self) -> None:
        """Wait until every message confirmed so far was acknowledged in mqds (or failed to be)."""
        barrier: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._acks.put_nowait(barrier)
        await barrier

    # -- sending ---------------------------------------------------------------------

    @staticmethod
    def _key(message: Message) -> tuple[Any, ...]:
        return (message.shard, message.timestamp_us)

    def _remember(self, key: tuple[Any, ...]) -> None:
        self._seen[key] = None
        if len(self._seen) > _SEEN_LIMIT:
            self._seen.popitem(last=False)

    def live_qos(self, topic: str) -> int | None:
        """The QoS of this connection's subscriptions matching ``topic`` (the highest), None if none matches."""
        found = [qos for topic_filter, qos in self.active.items() if matches(topic_filter, topic)]
        return max(found) if found else None

    async def _deliver(self, outs: list[_Out]) -> None:
        """Send in order, up to ``max_inflight`` awaiting their acknowledgement; settle in order."""
        window: collections.deque[tuple[_Out, asyncio.Task[Any]]] = collections.deque()
        limit = max(1, self.plugin.config.max_inflight)
        for i, out in enumerate(outs):
            handler = self.handler
            if not self.open or handler is None or self.session.transitions.state != "connected":
                # Fetched and never sent: given back at the close, like a send that failed.
                self._unsent.extend((o.message, False) for o in outs[i:] if o.ack)
                del self._unsent[_SEEN_LIMIT:]
                break
            if not await self.plugin.others_allow(self.session, out.message.topic):
                self.plugin.count("refused_by_topic_filter")
                continue
            if out.ack:
                self._remember(self._key(out.message))
            if not out.send:
                window.append((out, asyncio.ensure_future(asyncio.sleep(0))))
                continue
            send = handler.mqtt_publish(out.message.topic, out.message.payload, out.qos, out.retain)
            window.append((out, asyncio.ensure_future(send)))
            if len(window) >= limit:
                self._settle(*await _first(window))
        while window:
            self._settle(*await _first(window))

    def _settle(self, out: _Out, task: asyncio.Task[Any]) -> None:
        shard = out.message.shard
        if task.cancelled() or task.exception() is not None:
            self.plugin.count("delivery_failed")
            if shard is not None:
                self._failed_shards.add(shard)
            if out.ack and len(self._unsent) < _SEEN_LIMIT:
                self._unsent.append((out.message, out.send))
            return
        self.plugin.count(f"delivered_{out.kind}")
        if out.ack and shard not in self._failed_shards:
            self._acks.put_nowait(out.message)

    async def _ack_loop(self) -> None:
        """Pass acknowledged messages to message_acked: what is queued at a time, coalesced, a few calls at once."""
        while True:
            item = await self._acks.get()
            batch: list[Message] = []
            barriers: list[asyncio.Future[None]] = []
            closing = item is None
            while item is not None:
                if isinstance(item, asyncio.Future):
                    barriers.append(item)
                else:
                    batch.append(item)
                if self._acks.empty():
                    break
                item = self._acks.get_nowait()
                closing = item is None
            if batch:
                await self._ack(batch)
            for barrier in barriers:
                if not barrier.done():
                    barrier.set_result(None)
            if closing:
                return

    async def _give_back(self) -> None:
        """Give back what was not delivered (a queue reader's redeliveries), a few calls at once."""
        limit = asyncio.Semaphore(_ACK_CONCURRENCY)

        async def give_back(message: Message, sent: bool) -> None:
            async with limit:
                try:
                    await self.plugin.hooks.message_nacked(self.clientid, message, sent=sent)
                except Exception as err:  # it comes again after its ack wait
                    log.warning("client %s: giving back %s failed: %s", self.clientid, message.topic, err)

        unsent, self._unsent = self._unsent, []
        await asyncio.gather(*(give_back(message, sent) for message, sent in unsent))

    def _coalesce(self, batch: list[Message]) -> list[Message]:
        """The calls that acknowledge ``batch`` (in delivery order, every one acknowledged by the client).

        A pubsub acknowledgement moves a (client, filter) read position up to
        the message in its shard, covering that filter's earlier messages of
        the shard; so, of the messages with the same shard and the same
        matching filters, the last one stands for all. A message matching a
        queue-mode filter is removed on its own acknowledgement: kept as is.
        """
        config = self.plugin.hooks.config
        known = self.plugin.hooks.known_filters(self.clientid)
        calls: list[Message] = []
        last: dict[tuple[int | None, frozenset[str]], int] = {}
        for message in batch:
            filters = frozenset(f for f in known if matches(f, message.topic))
            ack_rules = [rule for rule in config.rules_for("message.acked", message.topic) if rule.kind == "ack"]
            default_mode = (ack_rules[0].mode if ack_rules else None) or "pubsub"
            queued = any(
                (fetch.mode if fetch is not None and fetch.mode else default_mode) == "queue"
                for fetch in (config.fetch_rule(f) for f in filters)
            )
            if queued or not filters:
                calls.append(message)
                continue
            key = (message.shard, filters)
            if key in last:
                calls[last[key]] = message
            else:
                last[key] = len(calls)
                calls.append(message)
        return calls

    async def _ack(self, batch: list[Message]) -> None:
        limit = asyncio.Semaphore(_ACK_CONCURRENCY)

        async def ack(message: Message) -> bool:
            async with limit:
                try:
                    await self.plugin.hooks.message_acked(self.clientid, message)
                    return True
                except Exception as err:
                    log.warning("client %s: acknowledging %s failed: %s", self.clientid, message.topic, err)
                    return False

        calls = self._coalesce(batch)
        done = await asyncio.gather(*(ack(message) for message in calls))
        self.plugin.count("ack_calls", len(calls))
        if all(done):
            self.plugin.count("acked", len(batch))
        else:  # read positions stay behind: those messages come again at the next connect
            self.plugin.count("ack_failed", len(batch))


def _identity(message: Message) -> tuple[Any, ...]:
    """A message and its retained copy alike (the retained record has a position of its own)."""
    return (message.topic, message.sender, len(message.payload), hash(message.payload))


async def _first(window: collections.deque[tuple[_Out, asyncio.Task[Any]]]) -> tuple[_Out, asyncio.Task[Any]]:
    """Wait for the oldest send of ``window`` (without raising its error) and take it out."""
    out, task = window.popleft()
    await asyncio.wait([task])
    return out, task
