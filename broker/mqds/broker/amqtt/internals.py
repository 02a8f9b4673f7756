"""Everything the plugin wraps or patches in amqtt's broker (0.12): its private methods, in one place.

:class:`AmqttInternals` wraps methods of one broker instance (not the class),
so that publishers are acknowledged once their messages are stored
(:mod:`mqds.broker.amqtt.puback`), what a connection left queued is still
routed, CONNACK's session present covers sessions mqds holds, and a persistent
session's new subscriptions start before SUBACK. See ``DESIGN.md`` next to
this package for why each is needed and what of amqtt it relies on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from mqds.broker.amqtt.puback import PublishAcks, StoreWaits
from mqds.broker.subscriptions import SHARED_PREFIXES

if TYPE_CHECKING:
    from amqtt.broker import Broker
    from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
    from amqtt.session import ApplicationMessage, Session

    from mqds.broker.actions import BrokerHooks
    from mqds.broker.amqtt.shared import SharedMembers

log = logging.getLogger("mqds.broker.amqtt")

# Session attribute: amqtt had no session for the client (its CONNACK may still say session present).
NEW_IN_AMQTT = "mqds.new_in_amqtt"


class _Connection(Protocol):
    """What the wrappers need of a client's connection (:class:`~mqds.broker.amqtt.delivery._Connection`):
    whether it is open, and the filters its session is subscribed to, with their QoS."""

    @property
    def open(self) -> bool: ...

    @property
    def active(self) -> dict[str, int]: ...


class _Options(Protocol):
    puback_after_store: bool
    timeout_s: float


class _Plugin(Protocol):
    """What the wrappers need of the plugin (:class:`~mqds.broker.amqtt.plugin.MqdsPlugin`)."""

    @property
    def broker(self) -> Broker: ...

    @property
    def config(self) -> _Options: ...

    @property
    def hooks(self) -> BrokerHooks: ...

    @property
    def connections(self) -> Mapping[str, _Connection]: ...

    @property
    def store_waits(self) -> StoreWaits: ...

    @property
    def shared(self) -> SharedMembers: ...

    def amqtt_subscriptions(self, clientid: str) -> dict[str, int]: ...

    def await_store(self, message: ApplicationMessage) -> asyncio.Future[bool] | None: ...

    def count(self, what: str, n: int = 1) -> None: ...


class AmqttInternals:
    """The plugin's wrappers of amqtt's broker methods, and what they keep track of."""

    def __init__(self, plugin: _Plugin) -> None:
        self.plugin = plugin
        # Per protocol handler: the task running its message loop, and a future set once the
        # messages amqtt left in its session's queue were handed on (see install).
        self._loops: dict[BrokerProtocolHandler, tuple[asyncio.Task[Any] | None, asyncio.Future[None]]] = {}

    def install(self) -> None:
        """Make amqtt acknowledge publishes once stored, and route what it left queued when a connection ended.

        Wraps methods of this broker instance (not the class): the
        connection's message loop, which then hands on what is left in the
        session's queue through amqtt's own delivery step, and
        ``_stop_handler``, which then waits for that (so the shutdown clears
        the queues only after); ``_handle_client_session``, which then sets
        session present for a session mqds holds (``_resume_session``) before
        CONNACK (and does not resume a clean session that ended);
        ``_handle_subscription``, which then starts a persistent session's new
        subscriptions in mqds before SUBACK (``_begin_subscriptions``). With
        ``puback_after_store``, ``_handle_client_session`` also gives each
        connection's protocol handler a :class:`PublishAcks` before its reader
        starts, and ``_handle_message_delivery`` releases the acknowledgement
        of a message amqtt did not pass on to be stored (refused by a topic
        filter, an invalid topic). Idempotent.
        """
        broker = self.plugin.broker
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
            if self.plugin.config.puback_after_store:
                PublishAcks(self.plugin, handler).install()
            await self._not_a_clean_session_that_ended(client_session)
            await self._resume_session(client_session)
            await session_handling(reader, writer, client_session, handler, server, listener_name)

        async def handle_message_delivery(
            client_session: Session, handler: BrokerProtocolHandler, wait_deliver: asyncio.Future[Any]
        ) -> bool:
            try:
                return await message_delivery(client_session, handler, wait_deliver)
            finally:
                waits = self.plugin.store_waits
                if waits and wait_deliver.done() and not wait_deliver.cancelled():
                    message = wait_deliver.result() if wait_deliver.exception() is None else None
                    if message is not None and message in waits:
                        # After the message_broadcast event's task (created before this returned) took it,
                        # if amqtt fired that event: call_soon runs in order.
                        asyncio.get_running_loop().call_soon(waits.settle, message, True)

        async def handle_subscription(
            client_session: Session, handler: BrokerProtocolHandler, subscribe_waiter: asyncio.Future[Any]
        ) -> None:
            await self._begin_shared(client_session, handler, subscribe_waiter)
            await self._begin_subscriptions(client_session, subscribe_waiter)
            await subscription_handling(client_session, handler, subscribe_waiter)
            if subscribe_waiter.exception() is None and client_session.client_id:
                # The shared subscriptions amqtt granted are served from now on; the refused ones leave.
                granted = set(self.plugin.amqtt_subscriptions(client_session.client_id))
                await self.plugin.shared.confirm(client_session.client_id, granted)

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
        if self.plugin.config.puback_after_store:
            broker._handle_message_delivery = handle_message_delivery  # type: ignore[method-assign]
        broker._mqds_keeps_acknowledged = True  # type: ignore[attr-defined]

    async def _begin_shared(
        self, session: Session, handler: BrokerProtocolHandler, subscribe_waiter: asyncio.Future[Any]
    ) -> None:
        """Before amqtt sends SUBACK to any session: each new shared subscription's member joins its share group,
        so what is published after SUBACK is the group's (``SharedMembers.begin``; started after SUBACK)."""
        if not session.client_id or subscribe_waiter.exception() is not None:
            return
        topics = getattr(subscribe_waiter.result(), "topics", [])
        shared = [(f, q) for f, q in topics if isinstance(f, str) and f.startswith(SHARED_PREFIXES)]
        if shared:
            await self.plugin.shared.begin(session, handler, shared)

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
        topics = [
            (f, q)
            for f, q in getattr(subscribe_waiter.result(), "topics", [])
            if isinstance(f, str) and f and not f.startswith(SHARED_PREFIXES)  # shared: _begin_shared
        ]
        connection = self.plugin.connections.get(clientid)
        if connection is not None and connection.open:
            for topic_filter, qos in topics:
                if isinstance(qos, int) and 0 <= qos <= 2:
                    connection.active[topic_filter] = qos
        results = await asyncio.gather(
            *(self.plugin.hooks.begin_subscription(clientid, topic_filter) for topic_filter, _ in topics),
            return_exceptions=True,
        )
        for (topic_filter, _), result in zip(topics, results, strict=True):
            if isinstance(result, Exception) and not isinstance(result, ValueError):  # ValueError: amqtt refuses it
                self.plugin.count("errors")
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
            await self.plugin.broker._del_all_subscriptions(session)
            session.clear_queues()
            session.inflight_in.clear()
            session.inflight_out.clear()
            session.clean_session = False
            session.parent = 0
            self.plugin.count("ended_clean_sessions_not_resumed")

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
        session.attributes[NEW_IN_AMQTT] = True
        try:
            present = await self.plugin.hooks.session_present(session.client_id)
        except Exception as err:
            self.plugin.count("errors")
            log.warning("client %s: could not ask mqds for its session: %s", session.client_id, err)
            return
        if present:
            session.parent = 1
            self.plugin.count("sessions_resumed_from_mqds")

    async def _hand_on_left(self, session: Session, handler: BrokerProtocolHandler) -> None:
        """Route the messages left in ``session``'s queue after its message loop ended, oldest first."""
        queued = session.delivered_message_queue
        while not queued.empty():
            message = queued.get_nowait()
            if message is None:
                continue
            self.plugin.count("handed_on_after_disconnect")
            taken: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            taken.set_result(message)
            try:
                # False: amqtt refused the message (an invalid topic); the others are judged on their own.
                await self.plugin.broker._handle_message_delivery(session, handler, taken)
            except Exception as err:
                self.plugin.count("errors")
                log.warning("client %s: routing a message left at its disconnect failed: %s", session.client_id, err)

    async def handed_on(self, handler: BrokerProtocolHandler | None) -> None:
        """Wait (bounded) until the messages ``handler``'s session left queued were handed on; not from that loop."""
        entry = self._loops.get(handler) if handler is not None else None
        if entry is None or entry[0] is asyncio.current_task():
            return
        await asyncio.wait([entry[1]], timeout=self.plugin.config.timeout_s + 5)
