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

The rules (:mod:`mqds.broker.hooks`) decide what is stored; the plugin
decides how amqtt's events reach them and how stored messages reach clients.
This module has the plugin and its event handlers; the parts it uses are in
this package (``writer``, ``delivery``, ``internals``, ``puback``,
``protocol``), and ``DESIGN.md`` next to it has the design notes.
"""

from __future__ import annotations

import asyncio
import collections
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

from mqds.broker.actions import BrokerHooks
from mqds.broker.amqtt import protocol
from mqds.broker.amqtt.delivery import (
    SLOW_ITEM_S,
    _Connect,
    _Connection,
    _Live,
    _Subscribe,
    _Unsubscribe,
)
from mqds.broker.amqtt.internals import AmqttInternals
from mqds.broker.amqtt.puback import StoreWaits
from mqds.broker.amqtt.shared import SharedMembers, shared_filter
from mqds.broker.amqtt.writer import _Writers
from mqds.broker.hooks import load_config, parse_config
from mqds.broker.subscriptions import SHARED_PREFIXES
from mqds.client import aio
from mqds.client.connection import ConnectionSettings
from mqds.client.model import Message
from mqds.protocol.delivery import Policy
from mqds.protocol.errors import MqdsError
from mqds.protocol.share_groups import MAX_LEASE_S

if TYPE_CHECKING:
    from amqtt.broker import Broker
    from amqtt.mqtt.packet import MQTTPacket
    from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
    from amqtt.session import ApplicationMessage, Session

__all__ = ["DEFAULT_RULES", "MqdsPlugin", "settings_from"]

log = logging.getLogger("mqds.broker.amqtt")

# amqtt speaks MQTT 3.1.1 only: other protocol levels get CONNACK 0x01 instead of a hang.
protocol.install()

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


def redelivery_policy(config: Any) -> Policy | None:
    """The queue redelivery policy of a plugin configuration (``MqdsPlugin.Config``); None when it is off.

    Checked here, so a bad setting stops the broker at start with what is wrong (ValueError).
    """
    if not config.queue_redelivery:
        return None
    try:
        backoff = [int(part) for part in str(config.queue_backoff_ms).split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"queue_backoff_ms {config.queue_backoff_ms!r}: comma-separated milliseconds") from None
    try:
        return Policy.of(
            int(config.queue_ack_wait_ms),
            int(config.queue_max_deliveries),
            backoff,
            int(config.queue_max_unacked),
            str(config.queue_dead_letter_topic),
        )
    except MqdsError as err:
        raise ValueError(f"queue redelivery: {err.message}") from None


def check_shared_settings(config: Any) -> None:
    """Refuse (ValueError, saying what is wrong) shared-subscription settings out of bounds, at start."""
    if int(config.shared_poll_ms) < 1:
        raise ValueError(f"shared_poll_ms {config.shared_poll_ms}: at least 1 (milliseconds)")
    if not 1 <= int(config.shared_lease_s) <= MAX_LEASE_S:
        raise ValueError(f"shared_lease_s {config.shared_lease_s}: a member's lease is 1 to {MAX_LEASE_S} seconds")


class MqdsPlugin(BaseTopicPlugin):
    """amqtt broker plugin: stores, replays and acknowledges through mqds (see ``mqds/broker/DESIGN.md``)."""

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
        stored it (see :mod:`mqds.broker.amqtt.puback`); False: amqtt's own, as soon as the message is
        queued, before it is stored (a broker killed then loses what it acknowledged and had not stored)."""
        queue_redelivery: bool = True
        """Queue subscriptions (``on_message_fetch_for_queue``) take their offline messages with the cluster's
        redelivery (``Client.deliver``): each delivery counted, an unacknowledged one delivered again after the
        ack wait (at once when its connection closed before the PUBACK), dead-lettered after the last.
        False: plain queue fetches, as before redelivery existed."""
        queue_ack_wait_ms: int = 30_000
        """How long a queue delivery waits for the client's PUBACK before it is due again."""
        queue_max_deliveries: int = 1_000
        """The most times a queue message is delivered to one reader (1 to 1,000)."""
        queue_backoff_ms: str = ""
        """Comma-separated waits after the 1st, 2nd, ... delivery (the last for later ones), instead of the ack
        wait; empty: none."""
        queue_max_unacked: int = 1_000
        """The most queue messages of one reader delivered and not acknowledged, per shard."""
        queue_dead_letter_topic: str = ""
        """Where a queue message goes after its last delivery (a topic); empty: it is just not delivered again."""
        shared_poll_ms: int = 500
        """How often a shared subscription's member fetches when nothing woke it (a publish this broker stored
        wakes it at once): the latency of messages stored through other brokers and of redeliveries due."""
        shared_lease_s: int = 30
        """A shared subscription member's lease in its share group (renewed every half of it): a broker that
        stops without leaving loses its members' shards to the others this long after."""

    def __init__(self, context: BaseContext) -> None:
        super().__init__(context)
        if not isinstance(context, BrokerContext) or not isinstance(context.config, MqdsPlugin.Config):
            raise TypeError(f"{type(self).__name__} is an amqtt broker plugin: list it in the broker's plugins")
        self.broker_context: BrokerContext = context
        self.config: MqdsPlugin.Config = context.config
        rules = load_config(self.config.hooks) if self.config.hooks else DEFAULT_RULES
        self.client: aio.Client = aio.Client(self.config.endpoints, settings=settings_from(self.config))
        self.node: str = self.config.node or rules.node or socket.gethostname()
        self.redelivery: Policy | None = redelivery_policy(self.config)
        check_shared_settings(self.config)
        self.hooks: BrokerHooks = BrokerHooks(self.client, rules, self.node, redelivery=self.redelivery)
        self.stats: collections.Counter[str] = collections.Counter()
        self.started_at: float = time.monotonic()
        # The clients' current connections (persistent sessions get their stored messages through them).
        self.connections: dict[str, _Connection] = {}
        self._writers: _Writers = _Writers(self)
        self._publishing: set[asyncio.Task[Any]] = set()
        # Incoming publishes whose PUBACK/PUBREC waits for their store (see mqds.broker.amqtt.puback).
        self.store_waits: StoreWaits = StoreWaits()
        self._internals: AmqttInternals = AmqttInternals(self)
        # Shared subscriptions ($share/<group>/<filter>, $queue/<filter>): members of the cluster's share groups.
        self.shared: SharedMembers = SharedMembers(self)

    # -- amqtt's broker ----------------------------------------------------------------

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

    async def handed_on(self, handler: BrokerProtocolHandler | None) -> None:
        """Wait (bounded) until the messages ``handler``'s session left queued were handed on; not from that loop."""
        await self._internals.handed_on(handler)

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

    # -- publishers' acknowledgements (see mqds.broker.amqtt.puback) --------------------

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
        return self.store_waits.add(message)

    def count(self, what: str, n: int = 1) -> None:
        self.stats[what] += n

    # -- amqtt's topic filter ---------------------------------------------------------

    async def topic_filtering(
        self, *, session: Session | None = None, topic: str | None = None, action: Action | None = None
    ) -> bool:
        """Refuse amqtt's own delivery of stored topics to persistent sessions (the plugin sends those), and
        malformed shared subscriptions (SUBACK 0x80); the plugin serves the others (``shared.py``)."""
        if action == Action.RECEIVE and session is not None and topic is not None:
            return not (session.clean_session is False and self.served_from_mqds(topic))
        if action == Action.SUBSCRIBE and topic is not None and topic.startswith(SHARED_PREFIXES):
            try:
                shared_filter(topic)
            except ValueError as err:
                self.count("shared_refused")
                log.warning(
                    "client %s: shared subscription refused (SUBACK 0x80): %s",
                    session.client_id if session is not None else "?",
                    err,
                )
                return False
        return True

    # -- broker life cycle ------------------------------------------------------------

    async def on_broker_pre_start(self) -> None:
        """Before the listeners open: learn the shard count and mark clients left online by a crash offline."""
        self._internals.install()
        try:
            cluster = await self.client.cluster_map()
            self._writers.n_shards = cluster.n_shards or None
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
        await self.shared.close()  # shared members give back what they sent unacknowledged and leave
        for connection in list(self.connections.values()):
            connection.close(record=True)
        pending = [c.task for c in self.connections.values()] + list(self._publishing)
        if pending:
            await asyncio.wait(pending, timeout=self.config.timeout_s + 5)

    async def close(self) -> None:
        if self._publishing:
            await asyncio.wait(list(self._publishing), timeout=self.config.timeout_s + 5)
        await self._writers.close()
        await self.client.close()

    # -- clients ---------------------------------------------------------------------

    async def on_broker_client_connected(self, *, client_id: str, client_session: Session) -> None:
        client_session.attributes.pop(_SENT_DISCONNECT, None)
        handler = self.broker.sessions.get(client_id, (None, None))[1]
        previous = self.connections.get(client_id)
        if previous is not None:
            previous.close(record=False)  # this connection took over; it records itself as connected
        connection = _Connection(self, client_id, client_session, handler, previous)
        self.connections[client_id] = connection
        connection.put(_Connect())
        self.count("connections")
        connection.task.add_done_callback(lambda _: self._forget(client_id, connection))
        if handler is not None:  # a persistent session's shared subscriptions amqtt kept: members again
            await self.shared.resume(client_session, handler, self.amqtt_subscriptions(client_id))

    def _forget(self, clientid: str, connection: _Connection) -> None:
        if self.connections.get(clientid) is connection:
            del self.connections[clientid]

    async def on_mqtt_packet_received(
        self, *, packet: MQTTPacket[Any, Any, Any], session: Session | None = None
    ) -> None:
        """Note a client's DISCONNECT: a connection that closes without one gets its will message sent."""
        if session is not None and isinstance(packet, DisconnectPacket):
            session.attributes[_SENT_DISCONNECT] = True

    async def on_broker_client_disconnected(self, *, client_id: str, client_session: Session) -> None:
        connection = self.connections.get(client_id)
        handler = self.broker.sessions.get(client_id, (None, None))[1]
        # A late event of a connection a newer one replaced names a handler that is no longer the client's.
        if connection is not None and (connection.handler is handler or handler is None):
            connection.close(record=True)
            await self.shared.disconnected(client_id)
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
        if topic.startswith(SHARED_PREFIXES):
            return  # a member of its share group (begin_shared), not a subscription of the session's
        connection = self.connections.get(client_id)
        if connection is not None and connection.open:
            # Live from now: what is stored before the subscription's read position starts (when the
            # _Subscribe item is handled) is sent live, and what is stored after comes in its fetch too.
            connection.active[topic] = qos
            connection.put(_Subscribe(topic, qos))

    async def on_broker_client_unsubscribed(self, *, client_id: str, topic: str) -> None:
        if topic.startswith(SHARED_PREFIXES):
            await self.shared.unsubscribed(client_id, topic)  # gives back what it sent unacknowledged, leaves
            return
        connection = self.connections.get(client_id)
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
        outcome = self.store_waits.take(message)  # before any await: see AmqttInternals.install
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
            if outgoing.retain:  # only a retained publish can meet its own retained copy in a lookup
                for connection in self.connections.values():  # before any await: in amqtt's routing order
                    if connection.open and connection.live_qos(topic) is not None:
                        connection.routed(outgoing)
            ok = False
            ok = await self._route(outgoing)
        finally:
            if outcome is not None and not outcome.done():
                outcome.set_result(ok)

    async def _route(self, outgoing: Message) -> bool:
        """Store ``outgoing`` and hand it on; False if mqds should have kept it and did not (see _ShardWriter.add)."""
        # Queued before the first await, so in the order amqtt fired the events: its receive order.
        done = self._writers.of(outgoing.sender).add(outgoing)
        task = asyncio.current_task()
        if task is not None:
            self._publishing.add(task)
        try:
            return await done
        finally:
            if task is not None:
                self._publishing.discard(task)

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
        """Queue a routed message for the persistent sessions subscribed to it (amqtt left them to us), and wake
        the shared subscriptions' members it is for."""
        if stored:
            self.shared.wake(message.topic)
        if not self.served_from_mqds(message.topic):
            return
        for connection in self.connections.values():
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
        offline = self.hooks.offline
        if offline.fetches:
            parts.append(f"{offline.fetches} offline fetches in {offline.calls} shared calls")
        if s["handed_on_after_disconnect"]:
            parts.append(
                f"{s['handed_on_after_disconnect']} acknowledged publishes routed after their connection ended"
            )
        if s["puback_withheld"]:
            parts.append(f"{s['puback_withheld']} publishes not acknowledged (not stored; connection closed)")
        if s["delivery_failed"]:
            parts.append(f"{s['delivery_failed']} deliveries unacknowledged by clients")
        redelivery = self.hooks.stats
        if redelivery["redelivered"] or redelivery["dead_lettered"] or redelivery["nacked"]:
            parts.append(
                f"queue redelivery: {redelivery['redelivered']} redelivered, {redelivery['nacked']} given back, "
                f"{redelivery['dead_lettered']} dead-lettered"
            )
        if s["shared_members"] or s["shared_refused"]:
            parts.append(
                f"shared subscriptions: {s['shared_members']} members, {s['delivered_shared']} delivered, "
                f"{s['shared_given_back']} given back unacknowledged, {s['shared_refused']} malformed refused"
            )
        if s["errors"]:
            parts.append(f"{s['errors']} errors (see the log)")
        if s["slow_items"]:
            parts.append(f"{s['slow_items']} client steps slower than {SLOW_ITEM_S:.0f} s (see the log)")
        return ", ".join(parts)

    def connected_clients(self) -> Iterable[str]:
        return list(self.connections)
