"""mqds persistence inside the amqtt MQTT broker: an amqtt plugin that drives :class:`~mqds.broker.BrokerHooks`.

Enable it in amqtt's broker configuration (``plugins`` replaces amqtt's
default list, so keep an authentication plugin), or run ``mqds broker``,
which starts amqtt with it::

    plugins:
      amqtt.plugins.authentication.AnonymousAuthPlugin: {allow_anonymous: true}
      mqds.broker.amqtt_plugin.MqdsPlugin:
        endpoints: "mqds-0:7101,mqds-1:7101"
        hooks: /etc/mqds/hooks.toml      # the rules; without it, DEFAULT_RULES
        node: broker-1

The rules (:mod:`mqds.broker.hooks`) decide what is stored; this module
decides how amqtt's events reach them and how stored messages reach clients.

**Publishes.** Every message amqtt accepts for routing goes to
``message_publish``. A shard's messages are stored in waves (see
``_ShardWriter``): one ``store_batch`` call per wave, in arrival order, each
wave after the previous one finished. So each publisher's messages are stored
in the order it sent them, and the plugin learns a shard's positions in
timestamp order. That order is what makes acknowledgements safe:
acknowledging a message moves the read position of its shard past every
earlier message of that shard.

**Persistent sessions are served from mqds.** For a session with clean
session off, amqtt does not deliver messages on topics the rules store: the
plugin, a topic-filter plugin too, refuses amqtt's ``receive`` for them (so
amqtt neither sends them nor queues them in memory for an offline session).
The plugin delivers each one itself once it is stored, knowing its position,
through the session's protocol handler; ``mqtt_publish`` returns when the
subscriber's PUBACK (QoS 1) or PUBCOMP (QoS 2) arrives, and only then is the
message passed to ``message_acked``. amqtt has no event for an acknowledgement
of a message it sent itself, and a live message it broadcasts carries nothing
that ties it to its stored copy; sending it ourselves is the one way to know
both ends. Everything sent to one client goes through one queue, in order:
at connect, the proxy subscriptions (``client_connected``/``session_created``)
are added to amqtt's session and each subscription's offline then retained
messages (``session_subscribed``) are sent; live messages that arrive
meanwhile wait behind them and are skipped if the offline fetch already
brought them. Acknowledgements follow PUBACKs in order; after a failed
delivery, nothing later of that shard is acknowledged on that connection, so
a reconnect gets it again (at least once: redelivery after a failure, never a
skipped message).

**Where a subscription starts** (MQTT's rules, see :mod:`mqds.broker.actions`):
a persistent session's new subscription gets what is stored from its
SUBSCRIBE on (its read position starts then; the plugin treats the filter
as live from the SUBSCRIBE event, so nothing between the two is missed), and
at each reconnect what was stored while it was away. **Clean sessions** are
delivered live by amqtt as usual and start with nothing: at connect the
plugin discards what mqds kept of the client's previous session (stored
subscriptions, read positions; no proxy subscriptions are restored), stores
none of theirs, fetches no offline messages for them, and sends each new
subscription only its retained messages.

**Session present.** amqtt sets CONNACK's session present only for a session
it holds in memory; before it sends CONNACK (``_handle_client_session`` is
wrapped), a persistent session amqtt does not hold is asked of mqds
(``BrokerHooks.session_present``: stored subscriptions a lookup rule
restores), so a session resumed after a broker restart is present. Clean
sessions keep 0.

**Retained messages** are kept in mqds when a ``retain`` rule applies to the
topic; amqtt's in-memory copy is then dropped, so a subscriber gets the one
copy from mqds (``on_retain_lookup``), also after a broker restart. When the
lookup ran, the stored copies of retained publishes that an offline fetch
brings are acknowledged in order but not sent: each retained message comes
once, flagged, and a deleted one (or its empty delete marker) not at all.

**A publisher's PUBACK/PUBREC comes once the message is stored**
(``puback_after_store``, the default): see :mod:`mqds.broker.amqtt_puback`,
which takes over each connection's incoming QoS 1/2 flows
(``_handle_client_session`` is wrapped to install it); ``await_store`` gives
it a future that ``message_broadcast`` sets once the message's wave was
stored (``_handle_message_delivery`` is wrapped to release the messages amqtt
did not broadcast). A failed store is not acknowledged; the connection closes.

**Nothing a publisher sent is dropped at its disconnect.** amqtt's own flow
(``puback_after_store`` off) sends the PUBACK of a QoS 1 publish when it
queues the message in the session, and one task per connection takes the
queue's messages to routing.
When the connection ends (the client's DISCONNECT, a lost connection, the
broker's shutdown), that task stops and amqtt drops what is still queued:
with a publisher that sends a burst of 300 and disconnects once they are
acknowledged, about half of them vanished without any plugin seeing them. The
plugin wraps that task (``_client_message_loop``): once amqtt's loop ended,
each message left in the queue goes through amqtt's own delivery step
(checks, topic filters, the ``message_broadcast`` event that stores it,
routing to live subscribers), in order, after those before it. Stopping a
handler (``_stop_handler``: the shutdown, before it clears the sessions'
queues) waits for that, and a will message is stored after it.

amqtt's internals this relies on (0.12): ``BrokerContext._broker_instance``
for the sessions' protocol handlers, ``BrokerProtocolHandler.mqtt_publish``,
``Broker.subscriptions``, ``Broker.retained_messages``, and
``Broker._client_message_loop``, ``_handle_message_delivery`` and
``_stop_handler`` for the messages left at a disconnect,
``Broker._handle_client_session`` and the protocol handler's
``_handle_qos1_message_flow``, ``_handle_qos2_message_flow``,
``_send_packet`` and ``_pubrel_waiters`` for the publishers' acknowledgements,
``Broker._handle_client_session`` and ``Session.parent`` (CONNACK's session
present) for resumed sessions, ``Broker._handle_subscription`` (to act
before SUBACK), ``Broker._del_all_subscriptions`` for a clean session amqtt
would resume.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from amqtt.broker import BrokerContext
from amqtt.contexts import Action, BaseContext
from amqtt.mqtt.disconnect import DisconnectPacket
from amqtt.plugins.base import BaseTopicPlugin

from mqds.broker import amqtt_protocol
from mqds.broker.actions import BrokerHooks
from mqds.broker.amqtt_puback import PublishAcks
from mqds.broker.hooks import load_config, parse_config
from mqds.client import aio
from mqds.client.connection import ConnectionSettings
from mqds.client.model import Message
from mqds.protocol.sharding import shard_of
from mqds.protocol.topics import matches

if TYPE_CHECKING:
    from amqtt.broker import Broker
    from amqtt.mqtt.packet import MQTTPacket
    from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
    from amqtt.session import ApplicationMessage, Session

__all__ = ["DEFAULT_RULES", "MqdsPlugin", "settings_from"]

log = logging.getLogger("mqds.broker.amqtt")

# amqtt speaks MQTT 3.1.1 only: other protocol levels get CONNACK 0x01 instead of a hang.
amqtt_protocol.install()

DEFAULT_RULES = parse_config(
    {
        "rule": [
            {"hook": "client.connected", "action": "on_client_connected"},
            {"hook": "client.connected", "action": "on_subscribe_lookup"},
            {"hook": "client.disconnected", "action": "on_client_disconnected"},
            {"hook": "session.subscribed", "topic": "#", "action": "on_subscription_store"},
            {"hook": "session.subscribed", "topic": "#", "action": "on_message_fetch_for_pubsub"},
            {"hook": "session.subscribed", "topic": "#", "action": "on_retain_lookup"},
            {"hook": "session.unsubscribed", "topic": "#", "action": "on_subscription_delete"},
            {"hook": "session.unsubscribed", "topic": "#", "action": "on_acked_delete"},
            {"hook": "message.publish", "topic": "#", "action": "on_message_publish"},
            {"hook": "message.publish", "topic": "#", "action": "on_message_retain"},
            {"hook": "message.acked", "topic": "#", "action": "on_message_acked"},
        ]
    },
    source="mqds.broker.amqtt_plugin.DEFAULT_RULES",
)
"""The rules without a hooks file: store every QoS 1/2 message and retained message, keep subscriptions,
deliver offline messages in pubsub mode (every subscriber its own read position), acknowledge on PUBACK."""

# Session attribute: the client sent DISCONNECT (so amqtt did not send its will).
_SENT_DISCONNECT = "mqds.sent_disconnect"
# Session attribute: amqtt had no session for the client (its CONNACK may still say session present).
_NEW_IN_AMQTT = "mqds.new_in_amqtt"
# At most this many concurrent stores of one shard (see _ShardWriter).
_WAVE_LIMIT = 64
# The writer used while the cluster's shard count is unknown.
_ANY_SHARD = -1
# How many delivered positions a client remembers to skip live copies of what its offline fetch sent.
_SEEN_LIMIT = 65_536
_ACK_CONCURRENCY = 16


def settings_from(config: Any) -> ConnectionSettings:
    """The mqds connection settings of a plugin configuration (``MqdsPlugin.Config``)."""
    return ConnectionSettings(
        timeout_s=float(config.timeout_s),
        tls=config.tls,
        tls_ca=config.tls_ca,
        tls_client_cert=config.tls_cert,
        tls_client_key=config.tls_key,
        tls_server_name=config.tls_server_name,
        auth_token=config.token,
    )


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


class _ShardWriter:
    """Stores one shard's messages in waves: one store call per wave, one wave after another.

    A wave takes the oldest waiting messages (``_WAVE_LIMIT`` at most) and
    stores them with one ``store_batch`` call, in arrival order; the next wave
    starts when this one finished. So every message of a wave gets a later
    timestamp than every message of the waves before it, and a publisher's
    messages are stored in the order it sent them; the plugin hands a wave on
    sorted by timestamp, which is the order acknowledgements must follow. One
    call per wave is one Raft write for the shard, however many messages it
    holds (about 7 ms each one by one).
    """

    def __init__(self, plugin: MqdsPlugin) -> None:
        self.plugin = plugin
        self.waiting: collections.deque[tuple[Message, asyncio.Future[bool]]] = collections.deque()
        self.task: asyncio.Task[None] | None = None

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or (self.task is not None and not self.task.done())

    def add(self, message: Message) -> asyncio.Future[bool]:
        """Queue ``message``; the future is done once it was stored (or failed) and handed on.

        Its result: False when mqds should have stored or retained the message
        and did not (the store failed), else True (stored, or nothing to store).
        """
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.waiting.append((message, done))
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run(), name="mqds-amqtt-store")
        return done

    def _wave(self) -> list[tuple[Message, asyncio.Future[bool]]]:
        return [self.waiting.popleft() for _ in range(min(_WAVE_LIMIT, len(self.waiting)))]

    async def _run(self) -> None:
        while self.waiting:
            wave = self._wave()
            oks = [False] * len(wave)
            try:
                answer = await self.plugin.store([message for message, _ in wave])
                results = answer if answer is not None else [None] * len(wave)
                oks = [
                    answer is not None and (result is not None or not self.plugin.stores(message))
                    for (message, _), result in zip(wave, results, strict=True)
                ]
                stored = sorted((s for s in results if s is not None), key=lambda s: s.timestamp_us or 0)
                for (message, _), result in zip(wave, results, strict=True):
                    if result is None:
                        self.plugin.hand_on(message, stored=False)
                for message in stored:
                    self.plugin.hand_on(message, stored=True)
            finally:
                for (_, done), ok in zip(wave, oks, strict=True):
                    if not done.done():
                        done.set_result(ok)


class _Connection:
    """One connection of a client: everything the plugin sends it, in order, and its acknowledgements.

    A worker task handles the items one at a time; it starts only when the
    client's previous connection finished (its acknowledgements recorded, its
    disconnect recorded), so a reconnect fetches after what was acknowledged.
    """

    def __init__(
        self,
        plugin: MqdsPlugin,
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
        self.new_session = session.parent == 0 or bool(session.attributes.pop(_NEW_IN_AMQTT, False))
        self.open = True
        # Filters whose offline fetch has started: live messages matching them are sent by the plugin.
        self.active: dict[str, int] = {}
        self._items: collections.deque[_Item] = collections.deque()
        self._wakeup = asyncio.Event()
        self._seen: collections.OrderedDict[tuple[Any, ...], None] = collections.OrderedDict()
        self._failed_shards: set[int] = set()
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
                try:
                    await self._handle(item)
                except Exception as err:
                    self.plugin.count("errors")
                    log.warning("client %s: %s failed: %s", self.clientid, type(item).__name__.strip("_"), err)
        finally:
            self.open = False
            self._acks.put_nowait(None)
            await asyncio.wait([acks])
            if record:
                try:
                    await self.plugin.hooks.client_disconnected(self.clientid)
                except Exception as err:
                    self.plugin.count("errors")
                    log.warning("client %s: recording the disconnect failed: %s", self.clientid, err)

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
        proxies: dict[str, int] = {}
        if clean or hooks.config.rules_for("client.connected"):  # a clean session discards the previous one
            proxies.update(await hooks.client_connected(self.clientid, clean_start=clean))
        if self.new_session and hooks.config.rules_for("session.created"):
            proxies.update(await hooks.session_created(self.clientid, clean_start=clean))
        for topic_filter, qos in proxies.items():
            if topic_filter.startswith(("$share/", "$queue/")):
                log.warning(
                    "client %s: shared subscription %r not applied (amqtt has none)", self.clientid, topic_filter
                )
                continue
            await self.plugin.broker_context.add_subscription(self.clientid, topic_filter, qos)
            self.plugin.count("proxy_subscriptions")
        for topic_filter, qos in self.plugin.amqtt_subscriptions(self.clientid).items():
            if not self.open:
                return
            await self._subscribed(topic_filter, qos, send_retained=True)

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
            if key in self._seen:
                continue
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
        """The stored messages to send; with ``covered``, stored copies of retained publishes are only
        acknowledged (the retained lookup sends the topic's retained message, if it still has one)."""
        return [
            _Out(m, min(m.qos, qos), "retained_copy", ack=True, send=False)
            if covered and m.retain and self.plugin.keeps_retained(m.topic)
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
        for out in outs:
            handler = self.handler
            if not self.open or handler is None or self.session.transitions.state != "connected":
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


async def _first(window: collections.deque[tuple[_Out, asyncio.Task[Any]]]) -> tuple[_Out, asyncio.Task[Any]]:
    """Wait for the oldest send of ``window`` (without raising its error) and take it out."""
    out, task = window.popleft()
    await asyncio.wait([task])
    return out, task


class MqdsPlugin(BaseTopicPlugin):
    """amqtt broker plugin: stores, replays and acknowledges through mqds (see the module's documentation)."""

    @dataclass
    class Config:
        """The plugin's options in amqtt's broker configuration."""

        endpoints: str = "127.0.0.1:7101"
        """mqds nodes to start from, comma-separated host:port."""
        hooks: str | None = None
        """The hook rules file (TOML or YAML); None for DEFAULT_RULES."""
        node: str | None = None
        """This broker's name, recorded with its online clients; default: the rules' node, then the host name."""
        timeout_s: float = 10.0
        """Deadline of one mqds call, retries included, in seconds."""
        tls: bool = False
        tls_ca: str | None = None
        tls_cert: str | None = None
        tls_key: str | None = None
        tls_server_name: str | None = None
        token: str | None = None
        """Bearer token sent with every mqds call."""
        max_inflight: int = 32
        """Messages sent to one client by the plugin that may await their PUBACK at once."""
        puback_after_store: bool = True
        """Send a publisher's PUBACK (QoS 1) / PUBREC (QoS 2) for a message a rule stores only once mqds
        stored it (see :mod:`mqds.broker.amqtt_puback`); False: amqtt's own, as soon as the message is
        queued, before it is stored (a broker killed then loses what it acknowledged and had not stored)."""

    def __init__(self, context: BaseContext) -> None:
        super().__init__(context)
        if not isinstance(context, BrokerContext) or not isinstance(context.config, MqdsPlugin.Config):
            raise TypeError(f"{type(self).__name__} is an amqtt broker plugin: list it in the broker's plugins")
        self.broker_context: BrokerContext = context
        self.config: MqdsPlugin.Config = context.config
        rules = load_config(self.config.hooks) if self.config.hooks else DEFAULT_RULES
        self.client: aio.Client = aio.Client(self.config.endpoints, settings=settings_from(self.config))
        self.node: str = self.config.node or rules.node or socket.gethostname()
        self.hooks: BrokerHooks = BrokerHooks(self.client, rules, self.node)
        self.stats: collections.Counter[str] = collections.Counter()
        self.started_at: float = time.monotonic()
        self._connections: dict[str, _Connection] = {}
        self._writers: dict[int, _ShardWriter] = {}
        self._n_shards: int | None = None
        self._learning: asyncio.Task[None] | None = None
        self._publishing: set[asyncio.Task[Any]] = set()
        # Per protocol handler: the task running its message loop, and a future set once the
        # messages amqtt left in its session's queue were handed on (see _keep_acknowledged).
        self._loops: dict[BrokerProtocolHandler, tuple[asyncio.Task[Any] | None, asyncio.Future[None]]] = {}
        # Incoming publishes whose PUBACK/PUBREC waits for their store: id -> (the message, its outcome).
        self._awaiting: dict[int, tuple[ApplicationMessage, asyncio.Future[bool]]] = {}

    # -- amqtt's internals, in one place ---------------------------------------------

    @property
    def broker(self) -> Broker:
        broker: Broker = self.broker_context._broker_instance
        return broker

    def amqtt_subscriptions(self, clientid: str) -> dict[str, int]:
        """The subscriptions amqtt holds for ``clientid``: filter -> QoS."""
        return {
            topic_filter: qos
            for topic_filter, subscribers in self.broker.subscriptions.items()
            for session, qos in subscribers
            if session.client_id == clientid
        }

    def _keep_acknowledged(self) -> None:
        """Make amqtt acknowledge publishes once stored, and route what it left queued when a connection ended.

        Wraps methods of this broker instance (not the class): the
        connection's message loop, which then hands on what is left in the
        session's queue through amqtt's own delivery step, and
        ``_stop_handler``, which then waits for that (so the shutdown clears
        the queues only after); ``_handle_client_session``, which then sets
        session present for a session mqds holds (``_resume_session``) before
        CONNACK (and does not resume a clean session that ended);
        ``_handle_subscription``, which then starts a persistent session's new
        subscriptions in mqds before SUBACK (``_begin_subscriptions``); and,
        with ``puback_after_store``, gives each connection's
        protocol handler a :class:`PublishAcks` before its reader starts; with
        ``puback_after_store`` also
        ``_handle_message_delivery``, which then releases the acknowledgement
        of a message amqtt did not pass on to be stored (refused by a topic
        filter, an invalid topic).
        """
        broker = self.broker
        if getattr(broker, "_mqds_keeps_acknowledged", False):
            return
        message_loop = broker._client_message_loop
        stop_handler = broker._stop_handler
        session_handling = broker._handle_client_session
        message_delivery = broker._handle_message_delivery
        subscription_handling = broker._handle_subscription

        async def handle_client_session(
            reader: Any,
            writer: Any,
            client_session: Session,
            handler: BrokerProtocolHandler,
            server: Any,
            listener_name: str,
        ) -> None:
            if self.config.puback_after_store:
                PublishAcks(self, handler).install()
            await self._not_a_clean_session_that_ended(client_session)
            await self._resume_session(client_session)
            await session_handling(reader, writer, client_session, handler, server, listener_name)

        async def handle_message_delivery(
            client_session: Session, handler: BrokerProtocolHandler, wait_deliver: asyncio.Future[Any]
        ) -> bool:
            try:
                return await message_delivery(client_session, handler, wait_deliver)
            finally:
                if self._awaiting and wait_deliver.done() and not wait_deliver.cancelled():
                    message = wait_deliver.result() if wait_deliver.exception() is None else None
                    if message is not None and id(message) in self._awaiting:
                        # After the message_broadcast event's task (created before this returned) took it,
                        # if amqtt fired that event: call_soon runs in order.
                        asyncio.get_running_loop().call_soon(self._settle_store, message, True)

        async def handle_subscription(
            client_session: Session, handler: BrokerProtocolHandler, subscribe_waiter: asyncio.Future[Any]
        ) -> None:
            await self._begin_subscriptions(client_session, subscribe_waiter)
            await subscription_handling(client_session, handler, subscribe_waiter)

        async def client_message_loop(client_session: Session, handler: BrokerProtocolHandler) -> None:
            left: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._loops[handler] = (asyncio.current_task(), left)
            try:
                await message_loop(client_session, handler)
                await self._hand_on_left(client_session, handler)
            finally:
                if not left.done():
                    left.set_result(None)
                self._loops.pop(handler, None)

        async def stop_handler_then_wait(handler: BrokerProtocolHandler) -> None:
            await stop_handler(handler)
            await self.handed_on(handler)

        broker._client_message_loop = client_message_loop  # type: ignore[method-assign]
        broker._stop_handler = stop_handler_then_wait  # type: ignore[method-assign]
        broker._handle_client_session = handle_client_session  # type: ignore[method-assign]
        broker._handle_subscription = handle_subscription  # type: ignore[method-assign]
        if self.config.puback_after_store:
            broker._handle_message_delivery = handle_message_delivery  # type: ignore[method-assign]
        broker._mqds_keeps_acknowledged = True  # type: ignore[attr-defined]

    async def _begin_subscriptions(self, session: Session, subscribe_waiter: asyncio.Future[Any]) -> None:
        """Before amqtt sends SUBACK to a persistent session: its new subscriptions start now, in mqds and live.

        Each filter is live for the plugin from here (messages handed on now
        are sent to the client), and the read position of each new pubsub
        subscription is started (``BrokerHooks.begin_subscription``), so what
        is published after SUBACK is delivered at a later reconnect if not
        now. If mqds does not answer in time, SUBACK goes all the same; the
        offline fetch then starts the position a little later.
        """
        clientid = session.client_id
        if session.clean_session is not False or not clientid or subscribe_waiter.exception() is not None:
            return
        topics = [(f, q) for f, q in getattr(subscribe_waiter.result(), "topics", []) if isinstance(f, str) and f]
        connection = self._connections.get(clientid)
        if connection is not None and connection.open:
            for topic_filter, qos in topics:
                if isinstance(qos, int) and 0 <= qos <= 2:
                    connection.active[topic_filter] = qos
        results = await asyncio.gather(
            *(self.hooks.begin_subscription(clientid, topic_filter) for topic_filter, _ in topics),
            return_exceptions=True,
        )
        for (topic_filter, _), result in zip(topics, results, strict=True):
            if isinstance(result, Exception) and not isinstance(result, ValueError):  # ValueError: amqtt refuses it
                self.count("errors")
                log.warning("client %s: starting subscription %r in mqds failed: %s", clientid, topic_filter, result)

    async def _not_a_clean_session_that_ended(self, session: Session) -> None:
        """A persistent connect must not resume a clean session that ended (MQTT: its state is never reused).

        amqtt keeps a disconnected clean session until its session monitor
        drops it (each second); a connect with clean session off in between
        resumes it: session present, its subscriptions back, and the session
        still marked clean (so the plugin would treat it as one). A clean
        CONNECT never resumes anything, so a resumed session marked clean is
        such a leftover: it starts empty, as a new persistent session.
        """
        if session.clean_session is True and session.parent == 1:
            await self.broker._del_all_subscriptions(session)
            session.clear_queues()
            session.inflight_in.clear()
            session.inflight_out.clear()
            session.clean_session = False
            session.parent = 0
            self.count("ended_clean_sessions_not_resumed")

    async def _resume_session(self, session: Session) -> None:
        """Before amqtt sends CONNACK: session present when mqds holds the state of a persistent session.

        amqtt sets ``session.parent`` (CONNACK's session present) only for a
        session it has in memory; after a broker restart, or on another broker
        node, mqds still has the client's subscriptions, which the plugin
        restores at connect. Clean sessions keep 0. If mqds does not answer,
        amqtt's answer stands.
        """
        if session.clean_session is not False or session.parent != 0 or not session.client_id:
            return
        session.attributes[_NEW_IN_AMQTT] = True
        try:
            present = await self.hooks.session_present(session.client_id)
        except Exception as err:
            self.count("errors")
            log.warning("client %s: could not ask mqds for its session: %s", session.client_id, err)
            return
        if present:
            session.parent = 1
            self.count("sessions_resumed_from_mqds")

    async def _hand_on_left(self, session: Session, handler: BrokerProtocolHandler) -> None:
        """Route the messages left in ``session``'s queue after its message loop ended, oldest first."""
        queued = session.delivered_message_queue
        while not queued.empty():
            message = queued.get_nowait()
            if message is None:
                continue
            self.count("handed_on_after_disconnect")
            taken: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            taken.set_result(message)
            try:
                # False: amqtt refused the message (an invalid topic); the others are judged on their own.
                await self.broker._handle_message_delivery(session, handler, taken)
            except Exception as err:
                self.count("errors")
                log.warning("client %s: routing a message left at its disconnect failed: %s", session.client_id, err)

    async def handed_on(self, handler: BrokerProtocolHandler | None) -> None:
        """Wait (bounded) until the messages ``handler``'s session left queued were handed on; not from that loop."""
        entry = self._loops.get(handler) if handler is not None else None
        if entry is None or entry[0] is asyncio.current_task():
            return
        await asyncio.wait([entry[1]], timeout=self.config.timeout_s + 5)

    async def others_allow(self, session: Session, topic: str) -> bool:
        """Whether the broker's other topic plugins (ACLs) let ``session`` receive ``topic``."""
        manager = self.broker.plugins_manager
        if not manager.is_topic_filtering_enabled():
            return True
        others = [p for p in manager.plugins if isinstance(p, BaseTopicPlugin) and p is not self]
        for plugin in others:
            if not await plugin.topic_filtering(session=session, topic=topic, action=Action.RECEIVE):
                return False
        return True

    # -- what the rules say about a topic --------------------------------------------

    def served_from_mqds(self, topic: str) -> bool:
        """Whether persistent sessions get ``topic``'s messages from the plugin: some rule stores them."""
        return any(rule.kind == "store" for rule in self.hooks.config.rules_for("message.publish", topic))

    def keeps_retained(self, topic: str) -> bool:
        return any(rule.kind == "retain" for rule in self.hooks.config.rules_for("message.publish", topic))

    def stores(self, message: Message) -> bool:
        """Whether ``message_publish`` stores ``message`` (a ``store`` rule for a QoS 1/2 message)."""
        return message.qos > 0 and self.served_from_mqds(message.topic)

    # -- publishers' acknowledgements (see mqds.broker.amqtt_puback) --------------------

    def await_store(self, message: ApplicationMessage) -> asyncio.Future[bool] | None:
        """For an incoming QoS 1/2 publish amqtt is about to queue: a future set once it was stored, None if
        no rule stores or retains it in mqds. Its result: False if the store failed, else True."""
        topic = message.topic
        retain = bool(message.publish_packet is not None and message.publish_packet.retain_flag)
        try:
            needed = bool(topic) and (self.served_from_mqds(topic) or (retain and self.keeps_retained(topic)))
        except Exception:  # an invalid topic: amqtt refuses it
            needed = False
        if not needed:
            return None
        outcome: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._awaiting[id(message)] = (message, outcome)
        return outcome

    def _take_awaiting(self, message: ApplicationMessage) -> asyncio.Future[bool] | None:
        entry = self._awaiting.get(id(message))
        if entry is None or entry[0] is not message:
            return None
        del self._awaiting[id(message)]
        return entry[1]

    def _settle_store(self, message: ApplicationMessage, ok: bool) -> None:
        outcome = self._take_awaiting(message)
        if outcome is not None and not outcome.done():
            outcome.set_result(ok)

    def count(self, what: str, n: int = 1) -> None:
        self.stats[what] += n

    # -- amqtt's topic filter ---------------------------------------------------------

    async def topic_filtering(
        self, *, session: Session | None = None, topic: str | None = None, action: Action | None = None
    ) -> bool:
        """Refuse amqtt's own delivery of stored topics to persistent sessions: the plugin sends those."""
        if action == Action.RECEIVE and session is not None and topic is not None:
            return not (session.clean_session is False and self.served_from_mqds(topic))
        return True

    # -- broker life cycle ------------------------------------------------------------

    async def on_broker_pre_start(self) -> None:
        """Before the listeners open: learn the shard count and mark clients left online by a crash offline."""
        self._keep_acknowledged()
        try:
            cluster = await self.client.cluster_map()
            self._n_shards = cluster.n_shards or None
        except Exception as err:
            log.warning("mqds at %s does not answer yet (%s); storing will retry", self.config.endpoints, err)
            return
        if not self.hooks.config.rules_for("client.disconnected"):
            return
        try:
            stale = await self.client.clients_on_node(self.node)
            for clientid in stale:
                await self.hooks.client_disconnected(clientid)
            self.count("stale_clients_marked_offline", len(stale))
        except Exception as err:
            log.warning("could not mark the clients left online on node %s offline: %s", self.node, err)

    async def on_broker_pre_shutdown(self) -> None:
        """Finish every connection (acknowledgements, disconnect records) and the stores in progress."""
        for connection in list(self._connections.values()):
            connection.close(record=True)
        pending = [c.task for c in self._connections.values()] + list(self._publishing)
        if pending:
            await asyncio.wait(pending, timeout=self.config.timeout_s + 5)

    async def close(self) -> None:
        if self._publishing:
            await asyncio.wait(list(self._publishing), timeout=self.config.timeout_s + 5)
        if self._learning is not None:
            self._learning.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._learning
        await self.client.close()

    # -- clients ---------------------------------------------------------------------

    async def on_broker_client_connected(self, *, client_id: str, client_session: Session) -> None:
        client_session.attributes.pop(_SENT_DISCONNECT, None)
        handler = self.broker.sessions.get(client_id, (None, None))[1]
        previous = self._connections.get(client_id)
        if previous is not None:
            previous.close(record=False)  # this connection took over; it records itself as connected
        connection = _Connection(self, client_id, client_session, handler, previous)
        self._connections[client_id] = connection
        connection.put(_Connect())
        self.count("connections")
        connection.task.add_done_callback(lambda _: self._forget(client_id, connection))

    def _forget(self, clientid: str, connection: _Connection) -> None:
        if self._connections.get(clientid) is connection:
            del self._connections[clientid]

    async def on_mqtt_packet_received(
        self, *, packet: MQTTPacket[Any, Any, Any], session: Session | None = None
    ) -> None:
        """Note a client's DISCONNECT: a connection that closes without one gets its will message sent."""
        if session is not None and isinstance(packet, DisconnectPacket):
            session.attributes[_SENT_DISCONNECT] = True

    async def on_broker_client_disconnected(self, *, client_id: str, client_session: Session) -> None:
        connection = self._connections.get(client_id)
        handler = self.broker.sessions.get(client_id, (None, None))[1]
        # A late event of a connection a newer one replaced names a handler that is no longer the client's.
        if connection is not None and (connection.handler is handler or handler is None):
            connection.close(record=True)
        sent_disconnect = client_session.attributes.pop(_SENT_DISCONNECT, False)
        if client_session.will_flag and client_session.will_topic and not sent_disconnect:
            if connection is not None and connection.handler is handler:
                await self.handed_on(handler)  # the client's last messages are stored before its will
            # amqtt broadcast the will itself, without a message event: store it, and hand it to
            # persistent sessions (the topic filter kept it from them), like any publish.
            self.count("will_messages")
            will = Message(
                client_session.will_topic,
                bytes(client_session.will_message or b""),
                sender=client_id,
                qos=int(client_session.will_qos or 0),
                retain=bool(client_session.will_retain),
            )
            await self._route(will)

    async def on_broker_client_subscribed(self, *, client_id: str, topic: str, qos: int) -> None:
        connection = self._connections.get(client_id)
        if connection is not None and connection.open:
            # Live from now: what is stored before the subscription's read position starts (when the
            # _Subscribe item is handled) is sent live, and what is stored after comes in its fetch too.
            connection.active[topic] = qos
            connection.put(_Subscribe(topic, qos))

    async def on_broker_client_unsubscribed(self, *, client_id: str, topic: str) -> None:
        connection = self._connections.get(client_id)
        if connection is not None and connection.open:
            connection.active.pop(topic, None)
            connection.put(_Unsubscribe(topic))

    # -- messages ----------------------------------------------------------------------

    async def on_broker_retained_message(self, *, client_id: str | None, retained_message: ApplicationMessage) -> None:
        """amqtt retained a message: drop its in-memory copy when mqds keeps the topic's retained message."""
        topic = retained_message.topic
        if client_id is None and topic and self.keeps_retained(topic):
            retained = self.broker.retained_messages
            if retained.get(topic) is retained_message:
                del retained[topic]

    async def on_broker_message_broadcast(self, *, client_id: str | None, message: ApplicationMessage) -> None:
        """A message amqtt routes: store it in its shard's order, then send it to persistent subscribers.

        Once stored, the publisher's PUBACK/PUBREC waiting for it (``await_store``) may go.
        """
        outcome = self._take_awaiting(message)  # before any await: see _keep_acknowledged
        ok = True
        try:
            topic = message.topic
            if not topic or topic.startswith("$"):
                return
            packet = message.publish_packet
            sender = client_id or ""
            outgoing = Message(
                topic,
                bytes(message.data or b""),
                sender=sender,
                qos=int(message.qos or 0),
                retain=bool(packet is not None and packet.retain_flag),
            )
            ok = False
            ok = await self._route(outgoing)
        finally:
            if outcome is not None and not outcome.done():
                outcome.set_result(ok)

    async def _route(self, outgoing: Message) -> bool:
        """Store ``outgoing`` and hand it on; False if mqds should have kept it and did not (see _ShardWriter.add)."""
        # Queued before the first await, so in the order amqtt fired the events: its receive order.
        done = self._writer(outgoing.sender).add(outgoing)
        task = asyncio.current_task()
        if task is not None:
            self._publishing.add(task)
        try:
            return await done
        finally:
            if task is not None:
                self._publishing.discard(task)

    def _writer(self, sender: str) -> _ShardWriter:
        key = _ANY_SHARD
        if self._n_shards is not None and not (_ANY_SHARD in self._writers and self._writers[_ANY_SHARD].busy):
            key = shard_of(sender, self._n_shards)
        elif self._n_shards is None and (self._learning is None or self._learning.done()):
            # Shard count unknown (mqds did not answer at start): one writer for all, until it is learnt
            # and that writer has drained (its messages may share shards with the new ones).
            self._learning = asyncio.create_task(self._learn_shards())
        writer = self._writers.get(key)
        if writer is None:
            writer = self._writers[key] = _ShardWriter(self)
        return writer

    async def _learn_shards(self) -> None:
        while self._n_shards is None:
            try:
                self._n_shards = (await self.client.cluster_map()).n_shards or None
            except Exception:
                await asyncio.sleep(1.0)

    async def store(self, messages: list[Message]) -> list[Message | None] | None:
        """``message_publish_batch``: each message as stored (with its position), or None (not stored, or
        failed); None for the whole list when the call failed."""
        try:
            stored = await self.hooks.message_publish_batch(messages)
        except Exception as err:
            self.count("store_failed", len(messages))
            log.warning("storing %d messages failed: %s", len(messages), err)
            return None
        self.count("stored", sum(1 for s in stored if s is not None))
        self.count("store_calls")
        return stored

    def hand_on(self, message: Message, stored: bool) -> None:
        """Queue a routed message for the persistent sessions subscribed to it (amqtt left them to us)."""
        if not self.served_from_mqds(message.topic):
            return
        for connection in self._connections.values():
            if not connection.persistent or not connection.open:
                continue
            qos = connection.live_qos(message.topic)
            if qos is not None:
                connection.put(_Live(message, min(qos, message.qos), stored))

    # -- reporting ---------------------------------------------------------------------

    def summary(self) -> str:
        """One readable line of what the plugin did since it started."""
        s = self.stats
        parts = [
            f"{s['connections']} connections",
            f"{s['stored']} messages stored in {s['store_calls']} calls"
            + (f" ({s['store_failed']} failed)" if s["store_failed"] else ""),
            f"delivered from mqds: {s['delivered_offline']} offline, {s['delivered_retained']} retained, "
            f"{s['delivered_live']} live to persistent sessions",
            f"{s['acked']} acknowledged" + (f" ({s['ack_failed']} failed)" if s["ack_failed"] else ""),
        ]
        if s["handed_on_after_disconnect"]:
            parts.append(
                f"{s['handed_on_after_disconnect']} acknowledged publishes routed after their connection ended"
            )
        if s["puback_withheld"]:
            parts.append(f"{s['puback_withheld']} publishes not acknowledged (not stored; connection closed)")
        if s["delivery_failed"]:
            parts.append(f"{s['delivery_failed']} deliveries unacknowledged by clients")
        if s["errors"]:
            parts.append(f"{s['errors']} errors (see the log)")
        return ", ".join(parts)

    def connected_clients(self) -> Iterable[str]:
        return list(self._connections)
