"""A publisher's PUBACK (QoS 1) and PUBREC (QoS 2) once mqds stored the message, in the order MQTT requires.

amqtt 0.12 acknowledges an incoming QoS 1 publish as soon as it queued it in
the session (``ProtocolHandler._handle_qos1_message_flow``), and a QoS 2
publish as soon as it arrived (PUBREC, then the message is routed at PUBREL):
before any plugin saw it. A broker killed with ``kill -9`` then lost what it
had acknowledged but not yet stored (16.5% of a burst of 1,000 in a test).

:class:`PublishAcks` replaces those two methods on one connection's protocol
handler (for incoming messages only; the broker's own sends are amqtt's):

- **QoS 1**: the message is queued for routing as before; its PUBACK is sent
  once the plugin's store of it returned (``MqdsPlugin.await_store``: a
  future, kept in :class:`StoreWaits`, set when the message's wave was
  stored), for a topic some ``store`` rule covers (or a retained message a
  ``retain`` rule keeps); other messages are acknowledged at once, as amqtt
  does.
- **QoS 2**: for such a topic the message is routed (and stored) when it
  arrives, and PUBREC is sent once stored; the packet id is kept until PUBREL
  (MQTT 3.1.1 §4.3.3, "method B"), so a resend of the PUBLISH before PUBREL
  gets PUBREC again without being routed twice; PUBCOMP follows PUBREL. Other
  topics keep amqtt's flow (routed at PUBREL).
- **Order.** Every QoS 1/2 publish of the connection takes a turn when it
  arrives; its acknowledgement is sent only after the one before it (MQTT
  3.1.1 §4.6), so a message that needs no store does not overtake an earlier
  one still being stored. The plugin stores a publisher's messages in waves,
  in arrival order, so the turns rarely wait on each other for long, and the
  publishes in flight share a store call.
- **A failed store is not acknowledged.** When the store fails for good (mqds
  unreachable past the plugin's ``timeout_s``), the connection is closed
  without PUBACK/PUBREC for it or anything after it: MQTT 3.1.1 has no
  negative acknowledgement, and a client resends its unacknowledged publishes
  when it reconnects (at least once: what the plugin stored of them after the
  close, or what live subscribers got, may come again).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol

from amqtt.errors import AMQTTError
from amqtt.mqtt.puback import PubackPacket
from amqtt.mqtt.pubcomp import PubcompPacket
from amqtt.mqtt.pubrec import PubrecPacket
from amqtt.mqtt.pubrel import PubrelPacket
from amqtt.session import INCOMING, IncomingApplicationMessage

if TYPE_CHECKING:
    from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
    from amqtt.session import ApplicationMessage, Session

__all__ = ["PublishAcks", "StoreWaits"]

log = logging.getLogger("mqds.broker.amqtt")

# Session attribute: packet id -> (message, its store's outcome) of the QoS 2 publishes routed when
# they arrived, until their PUBREL; kept with the session, so a reconnect's resend is not routed again.
_QOS2_ROUTED = "mqds.qos2_routed"

_Routed = dict[int, tuple["ApplicationMessage", "asyncio.Future[bool]"]]


class _Plugin(Protocol):
    """What the acknowledgements need of the plugin (:class:`~mqds.broker.amqtt.plugin.MqdsPlugin`)."""

    def await_store(self, message: ApplicationMessage) -> asyncio.Future[bool] | None: ...

    def count(self, what: str, n: int = 1) -> None: ...


class StoreWaits:
    """Incoming publishes whose PUBACK/PUBREC waits for their store: id -> (the message, its outcome).

    ``MqdsPlugin.await_store`` adds one, its ``message_broadcast`` event
    takes it (before any await) and sets it once stored; a message amqtt did
    not broadcast is settled by the wrapped ``_handle_message_delivery``
    (:mod:`mqds.broker.amqtt.internals`).
    """

    def __init__(self) -> None:
        self._awaiting: dict[int, tuple[ApplicationMessage, asyncio.Future[bool]]] = {}

    def __bool__(self) -> bool:
        return bool(self._awaiting)

    def __contains__(self, message: object) -> bool:
        return id(message) in self._awaiting

    def add(self, message: ApplicationMessage) -> asyncio.Future[bool]:
        """A future for ``message``'s store: its result is False if the store failed, else True."""
        outcome: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._awaiting[id(message)] = (message, outcome)
        return outcome

    def take(self, message: ApplicationMessage) -> asyncio.Future[bool] | None:
        """``message``'s future, no longer awaiting (None if it has none)."""
        entry = self._awaiting.get(id(message))
        if entry is None or entry[0] is not message:
            return None
        del self._awaiting[id(message)]
        return entry[1]

    def settle(self, message: ApplicationMessage, ok: bool) -> None:
        outcome = self.take(message)
        if outcome is not None and not outcome.done():
            outcome.set_result(ok)


class PublishAcks:
    """The acknowledgements of one connection's QoS 1/2 publishes: after their store, in arrival order."""

    def __init__(self, plugin: _Plugin, handler: BrokerProtocolHandler) -> None:
        self.plugin = plugin
        self.handler = handler
        self._amqtt_qos1 = handler._handle_qos1_message_flow
        self._amqtt_qos2 = handler._handle_qos2_message_flow
        # The latest publish's turn: set to whether its acknowledgement was sent.
        self._last: asyncio.Future[bool] | None = None
        self._closing: asyncio.Task[Any] | None = None

    def install(self) -> None:
        """Take over the handler's incoming QoS 1/2 flows (before its reader starts)."""
        self.handler._handle_qos1_message_flow = self._qos1_flow  # type: ignore[method-assign]
        self.handler._handle_qos2_message_flow = self._qos2_flow  # type: ignore[method-assign]

    # -- turns -------------------------------------------------------------------------

    def _turn(self) -> tuple[asyncio.Future[bool] | None, asyncio.Future[bool]]:
        """Take the next turn (synchronously, so in the order the publishes arrived): (the one before, this one)."""
        previous, mine = self._last, asyncio.get_running_loop().create_future()
        self._last = mine
        return previous, mine

    async def _may_acknowledge(
        self, message: ApplicationMessage, stored: asyncio.Future[bool] | None, previous: asyncio.Future[bool] | None
    ) -> bool:
        """Wait for the earlier acknowledgement and for ``message``'s store; whether to acknowledge it now."""
        if previous is not None:
            if not previous.done():
                await asyncio.shield(previous)
            if not previous.result():
                return False  # not acknowledged, and the connection is closing: nothing later either
        if stored is not None:
            if not stored.done():
                await asyncio.shield(stored)
            if not stored.result():
                self.plugin.count("puback_withheld")
                session = self.handler.session
                log.warning(
                    "client %s: %s not stored in mqds: not acknowledged; closing the connection (the client "
                    "resends it when it reconnects)",
                    session.client_id if session is not None else "?",
                    message.topic,
                )
                return False
        return True

    def _settle(self, mine: asyncio.Future[bool], sent: bool) -> None:
        if not mine.done():
            mine.set_result(sent)
        if not sent and self._closing is None:
            # MQTT 3.1.1 has no negative PUBACK: end the connection; amqtt stops the handler.
            self._closing = asyncio.ensure_future(self.handler.handle_connection_closed())

    # -- QoS 1 ---------------------------------------------------------------------------

    async def _qos1_flow(self, app_message: Any) -> None:
        session = self.handler.session
        if app_message.direction != INCOMING or session is None:
            await self._amqtt_qos1(app_message)
            return
        if app_message.packet_id is None:
            raise ValueError("Packet ID is not set")
        if app_message.puback_packet:
            raise AMQTTError(f"Message '{app_message.packet_id}' has already been acknowledged")
        stored = self.plugin.await_store(app_message)
        previous, mine = self._turn()
        sent = False
        try:
            await session.delivered_message_queue.put(app_message)
            if await self._may_acknowledge(app_message, stored, previous):
                puback = PubackPacket.build(app_message.packet_id)
                await self.handler._send_packet(puback)
                app_message.puback_packet = puback
                sent = True
        finally:
            self._settle(mine, sent)

    # -- QoS 2 ---------------------------------------------------------------------------

    async def _qos2_flow(self, app_message: Any) -> None:
        session = self.handler.session
        if (
            app_message.direction != INCOMING
            or session is None
            or not isinstance(app_message, IncomingApplicationMessage)
        ):
            await self._amqtt_qos2(app_message)
            return
        packet_id = app_message.packet_id
        if packet_id is None:
            raise ValueError("Packet ID is not set")
        routed: _Routed = session.attributes.setdefault(_QOS2_ROUTED, {})
        earlier = routed.get(packet_id)
        route_now = False
        if earlier is not None:
            # A resend before PUBREL (or amqtt's retry at reconnect) of a publish routed already: not again.
            stored: asyncio.Future[bool] | None = earlier[1]
        else:
            stored = self.plugin.await_store(app_message)
            if stored is not None:
                route_now = True
                routed[packet_id] = (app_message, stored)
                stored.add_done_callback(lambda done: _forget_failed(session, packet_id, app_message, done))
        previous, mine = self._turn()
        sent = False
        try:
            if route_now:
                session.inflight_in[packet_id] = app_message
                await session.delivered_message_queue.put(app_message)
            elif earlier is None:
                session.inflight_in[packet_id] = app_message  # amqtt's flow: routed at PUBREL
            if await self._may_acknowledge(app_message, stored, previous):
                pubrec = PubrecPacket.build(packet_id)
                await self.handler._send_packet(pubrec)
                app_message.pubrec_packet = pubrec
                sent = True
        finally:
            self._settle(mine, sent)
        await self._complete_qos2(session, app_message, routed_at_receipt=earlier is not None or route_now)

    async def _complete_qos2(self, session: Session, app_message: Any, *, routed_at_receipt: bool) -> None:
        """Wait for PUBREL (as amqtt does: a newer PUBLISH of the same id replaces the wait), then PUBCOMP."""
        packet_id = app_message.packet_id
        waiters = self.handler._pubrel_waiters
        if packet_id in waiters and not waiters[packet_id].done():
            log.debug("a PUBREL waiter exists for message id %s: replacing it", packet_id)
            waiters[packet_id].cancel()
        try:
            waiter: asyncio.Future[PubrelPacket] = asyncio.Future()
            waiters[packet_id] = waiter
            await waiter
            waiters.pop(packet_id, None)
            app_message.pubrel_packet = waiter.result()
            if not routed_at_receipt:
                await session.delivered_message_queue.put(app_message)
            session.inflight_in.pop(packet_id, None)
            routed: _Routed = session.attributes.get(_QOS2_ROUTED, {})
            routed.pop(packet_id, None)
            pubcomp = PubcompPacket.build(packet_id)
            await self.handler._send_packet(pubcomp)
            app_message.pubcomp_packet = pubcomp
        except asyncio.CancelledError:
            log.debug("QoS 2 flow of message id %s cancelled", packet_id)


def _forget_failed(session: Session, packet_id: int, message: ApplicationMessage, done: asyncio.Future[bool]) -> None:
    """A QoS 2 publish whose store failed: forget its packet id, so the client's resend is routed (stored) again."""
    if not done.cancelled() and done.result():
        return
    routed: _Routed = session.attributes.get(_QOS2_ROUTED, {})
    if packet_id in routed and routed[packet_id][0] is message:
        del routed[packet_id]
    if session.inflight_in.get(packet_id) is message:
        del session.inflight_in[packet_id]
