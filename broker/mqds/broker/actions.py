"""The dispatcher every broker integration shares: broker hook calls in, mqds client calls out.

An integration (the EMQX ExHook provider in :mod:`mqds.broker.exhook`, the
amqtt plugin) calls one :class:`BrokerHooks` method per broker event; the
rules of its :class:`~mqds.broker.hooks.HookConfig` decide which actions run,
and the actions are calls of the asyncio mqds client. Everything they write
is replicated state of the cluster, so any number of broker nodes may share
one cluster, and a broker (or this process) that restarts loses nothing but
the small cache described next.

**Subscriptions known per client.** A ``message.acked`` event names the
client and the message, not the subscription it came through, yet read
positions belong to (client, filter) pairs. So the dispatcher remembers, per
client, the filters it subscribed with (from ``session_subscribed`` and from
the stored subscriptions a lookup returned) until the client disconnects; an
acknowledgement is recorded for every remembered filter of the client that
matches the message's topic. When it knows nothing of a client (this process
started after the client connected, or forgot it), it first reads the
client's stored subscriptions from mqds (``on_subscription_store`` keeps them
there), on an acknowledgement or, when acknowledgements are recorded, on a
new subscription. A filter subscribed to without being stored is known only
to the process that saw the subscription. The cache holds at most
``max_clients`` clients, least recently used first out.

**Delivery modes.** A subscription's mode is that of the first fetch rule
(in file order) that applies to its filter: ``pubsub`` (every subscriber has
its own read position) or ``queue`` (a message acknowledged by one reader is
gone for all). Acknowledgements use the same mode, so fetch and ack agree; a
filter no fetch rule applies to is acknowledged in the mode of the ack rule.

**Where offline delivery starts.** MQTT gives a new subscription what is
published after it (and the retained messages), and a clean session no
state from before. So a pubsub fetch starts the (client, filter) read
position when the pair has none, at its first SUBSCRIBE: a persistent
session then gets, at each reconnect, exactly what was stored while it was
away, from that SUBSCRIBE on. A clean session (``clean_start``) discards
what mqds kept of the client's previous session when it connects and keeps
nothing of its own: no stored subscriptions, no read positions, no offline
messages. Queue mode is a work queue: a new reader gets the backlog.

**Shared subscriptions.** ``$share/<group>/<filter>`` and ``$queue/<filter>``
subscriptions are matched, fetched and acknowledged by their real filter
(read positions are per client either way); they get no retained messages,
as MQTT 5 says; ``on_subscription_store`` stores them as given, prefix and
all, so the lookup restores the same shared subscription.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from collections.abc import Awaitable, Iterable
from typing import Any

from mqds.broker.catalogue import HOOKS, Mode
from mqds.broker.hooks import HookConfig, Rule
from mqds.broker.offline import DEFAULT_WINDOW_S, OfflineFetches
from mqds.broker.subscriptions import Delivery, check_clientid, check_qos, real_filter
from mqds.client import aio
from mqds.client.core.offline import OfflineFetch
from mqds.client.model import Message
from mqds.protocol.delivery import Policy
from mqds.protocol.errors import PartialBatchError
from mqds.protocol.topics import matches, validate_filter, validate_topic

__all__ = ["BrokerHooks", "Delivery", "real_filter"]

log = logging.getLogger(__name__)

DEFAULT_MAX_CLIENTS = 1_000_000


class BrokerHooks:
    """Runs the configured actions for each broker event (see the module's documentation).

    ``client`` is an open :class:`mqds.client.aio.Client` (the caller closes
    it). ``node`` names the broker node recorded with online clients; without
    it, the configuration's ``node``, then the node the event names (ExHook
    passes EMQX's), then this host's name. ``stats`` counts what was done, by
    name (``stored``, ``retained``, ``fetched_offline``, ``acked``, ...).
    Offline fetches of concurrent events go out together (``offline``, an
    :class:`~mqds.broker.offline.OfflineFetches`: those within
    ``offline_window_s`` of each other, or arriving while one is in flight).
    """

    def __init__(
        self,
        client: aio.Client,
        config: HookConfig,
        node: str | None = None,
        *,
        max_clients: int = DEFAULT_MAX_CLIENTS,
        offline_window_s: float = DEFAULT_WINDOW_S,
        redelivery: Policy | None = None,
    ) -> None:
        if max_clients < 1:
            raise ValueError("max_clients must be at least 1")
        self.client = client
        self.offline = OfflineFetches(client, window_s=offline_window_s)
        self.config = config
        self.node = node or config.node
        self.max_clients = max_clients
        self.redelivery = redelivery
        """Queue subscriptions' redelivery policy: with one, their offline messages come from ``Client.deliver``
        (counted deliveries, an ack wait, a dead-letter topic; see ``message_nacked``); None: plain queue fetches."""
        self.stats: collections.Counter[str] = collections.Counter()
        self._records_acks = any(rule.kind == "ack" for rule in config.rules)
        # clientid -> real filter -> QoS, least recently used first.
        self._filters: collections.OrderedDict[str, dict[str, int]] = collections.OrderedDict()

    # -- what the broker must call -------------------------------------------------

    def needed_hooks(self) -> dict[str, list[str]]:
        """The hooks an integration must deliver, each with its topic filters ([] = every topic).

        The hooks of the rules, plus, when acknowledgements are recorded, the
        ones that keep the subscription cache (subscribe, unsubscribe,
        disconnect). Topics are only given for message hooks (the broker
        filters those itself, e.g. EMQX by ``HookSpec.topics``).
        """
        hooks = set(self.config.hooks)
        if hooks & {"message.acked", "message.delivered"}:
            hooks |= {"session.subscribed", "session.unsubscribed", "client.disconnected"}
        return {
            hook: self.config.topics_for(hook) if hook.startswith("message.") else [] for hook in HOOKS if hook in hooks
        }

    # -- the subscription cache -------------------------------------------------------

    def known_filters(self, clientid: str) -> dict[str, int]:
        """The filters remembered for ``clientid`` (real filters -> QoS); {} when none."""
        return dict(self._filters.get(clientid, {}))

    def _remember(self, clientid: str, filters: dict[str, int]) -> None:
        known = self._filters.setdefault(clientid, {})
        known.update(filters)
        self._filters.move_to_end(clientid)
        while len(self._filters) > self.max_clients:
            self._filters.popitem(last=False)

    async def _filters_of(self, clientid: str) -> dict[str, int]:
        known = self._filters.get(clientid)
        if known is not None:
            self._filters.move_to_end(clientid)
            return known
        stored = await self.client.subscriptions(clientid)
        self.stats["subscription_cache_misses"] += 1
        self._remember(clientid, {real_filter(f): q for f, q in stored.items()})
        return self._filters[clientid]

    def _node(self, node: str | None) -> str:
        return self.node or node or socket.gethostname()

    # -- connections ---------------------------------------------------------------

    async def client_connected(
        self,
        clientid: str,
        *,
        node: str | None = None,
        clean_start: bool = False,
        session_expiry_s: int | None = None,
    ) -> dict[str, int]:
        """Run the ``client.connected`` rules; return the proxy subscriptions to apply ({} without a lookup rule).

        ``node``: the broker node the client connected to, when the broker
        says (used when neither the constructor nor the configuration names one).

        ``clean_start``: the client asked for a clean session (MQTT 3.1.1's
        CleanSession, MQTT 5's Clean Start): what mqds keeps of its previous
        session, stored subscriptions and read positions, is deleted (when the
        rules keep any), whatever the rules of the hook, and no proxy
        subscriptions are returned, as a clean session starts with none.

        ``session_expiry_s``: the Session Expiry Interval the client connected
        with (MQTT 5); None for an MQTT 3.1.1 client, which gets the node's
        ``session_expiry_default_s``. mqds removes the session's state,
        subscriptions and read positions that long after it disconnects.
        """
        return await self._connected("client.connected", clientid, node, clean_start, session_expiry_s)

    async def session_created(
        self,
        clientid: str,
        *,
        node: str | None = None,
        clean_start: bool = False,
        session_expiry_s: int | None = None,
    ) -> dict[str, int]:
        """Run the ``session.created`` rules; return the proxy subscriptions to apply, as ``client_connected``.

        With ``clean_start`` it returns none; the previous session is discarded by ``client_connected``.
        """
        return await self._connected("session.created", clientid, node, clean_start, session_expiry_s)

    @property
    def keeps_sessions(self) -> bool:
        """Whether the rules keep session state in mqds: stored subscriptions or read positions."""
        return any(rule.kind in ("subscribe", "fetch", "ack") for rule in self.config.rules)

    async def _connected(
        self, hook: str, clientid: str, node: str | None, clean_start: bool, session_expiry_s: int | None
    ) -> dict[str, int]:
        check_clientid(clientid)
        rules = self.config.rules_for(hook)
        jobs: list[Awaitable[Any]] = []
        lookup = not clean_start and any(rule.kind == "subscription_lookup" for rule in rules)
        record = any(rule.kind == "client_connected" for rule in rules)
        # The connect itself discards the previous session, once: session.created only skips the lookup.
        discard = clean_start and hook == "client.connected" and self.keeps_sessions
        if record:
            jobs.append(self.client.client_connected(clientid, self._node(node), session_expiry_s=session_expiry_s))
        if discard:
            self._filters.pop(clientid, None)
            jobs.append(self.client.forget_session(clientid))
        if lookup:
            jobs.append(self.client.subscriptions(clientid))
        results = await asyncio.gather(*jobs)
        if record:
            self.stats["clients_connected"] += 1
        if discard:
            self.stats["sessions_discarded"] += 1
        if not lookup:
            return {}
        subscriptions: dict[str, int] = results[-1]
        self.stats["subscription_lookups"] += 1
        self._remember(clientid, {real_filter(f): q for f, q in subscriptions.items()})
        return dict(subscriptions)

    async def session_present(self, clientid: str) -> bool:
        """Whether mqds holds session state that a connect of ``clientid`` resumes (MQTT's session present).

        True when a ``client.connected`` or ``session.created`` rule looks up
        the client's subscriptions and mqds has some stored: a persistent
        session connecting again gets them back, so its session is present
        even where the broker itself has nothing (it restarted). Asks nothing
        without a lookup rule.
        """
        check_clientid(clientid)
        lookup = any(
            rule.kind == "subscription_lookup"
            for hook in ("client.connected", "session.created")
            for rule in self.config.rules_for(hook)
        )
        if not lookup:
            return False
        return bool(await self.client.subscriptions(clientid))

    async def client_disconnected(self, clientid: str, *, node: str | None = None) -> None:
        """Run the ``client.disconnected`` rules and forget the client's subscriptions.

        The client is marked offline only if mqds still records it on this
        broker node: a late disconnect from a node the client already left
        does not mark the reconnected client offline (and leaves its
        remembered subscriptions alone).
        """
        check_clientid(clientid)
        if not any(rule.kind == "client_disconnected" for rule in self.config.rules_for("client.disconnected")):
            self._filters.pop(clientid, None)
            return
        state = await self.client.client_disconnected(clientid, node=self._node(node))
        if state is None:
            # Late: the client is connected elsewhere now; its subscriptions still count.
            self.stats["late_disconnects_ignored"] += 1
            return
        self._filters.pop(clientid, None)
        self.stats["clients_disconnected"] += 1

    # -- subscriptions -------------------------------------------------------------

    async def session_subscribed(
        self, clientid: str, topic_filter: str, qos: int, *, send_retained: bool = True, clean_start: bool = False
    ) -> Delivery:
        """Run the ``session.subscribed`` rules for a new subscription; return what it should receive.

        Stores the subscription (``on_subscription_store``), fetches offline
        messages in the mode of the first fetch rule that applies, and looks up
        retained messages (``on_retain_lookup``; not for shared subscriptions,
        nor with ``send_retained=False``, MQTT 5's Retain Handling 2).

        Offline messages, as MQTT has it: in pubsub mode a subscription reads
        what was stored from its first SUBSCRIBE on (the first fetch of a
        (client, filter) pair starts its read position, see
        ``Client.start_read_position``), and after that what it has not
        acknowledged; in queue mode, every message no reader acknowledged
        (a work queue's backlog). ``clean_start``: the subscription belongs
        to a clean session, which ends with its connection: it is neither
        stored nor given offline messages (the broker delivers it live), only
        the retained ones.
        """
        check_clientid(clientid)
        validate_filter(topic_filter)
        check_qos(qos)
        real = real_filter(topic_filter)
        validate_filter(real)
        shared = real != topic_filter
        if self._records_acks and clientid not in self._filters:
            # Unknown (this process started after the client connected): load
            # its stored subscriptions first, or acks through them would be missed.
            await self._filters_of(clientid)
        self._remember(clientid, {real: qos})
        rules = self.config.rules_for("session.subscribed", real)
        jobs: list[Awaitable[Any]] = []
        store = not clean_start and any(rule.kind == "subscribe" for rule in rules)
        if store:
            jobs.append(self.client.subscribe(clientid, topic_filter, qos))
        fetch = None if clean_start else next((rule for rule in rules if rule.kind == "fetch"), None)
        offline_job = self._fetch(clientid, real, fetch) if fetch is not None else _nothing()
        lookup = send_retained and not shared and any(rule.kind == "retain_lookup" for rule in rules)
        retained_job = self.client.retained(real) if lookup else _nothing()
        offline, retained, *_ = await asyncio.gather(offline_job, retained_job, *jobs)
        self.stats["subscriptions_stored"] += store
        self.stats["fetched_offline"] += len(offline)
        self.stats["fetched_retained"] += len(retained)
        modes: dict[str, Mode] = {real: fetch.mode} if fetch is not None and fetch.mode else {}
        more = fetch is not None and _full_page(offline, fetch)
        return Delivery(
            messages=[*offline, *retained],
            offline=offline,
            retained=retained,
            modes=modes,
            looked_up=lookup,
            more=more,
        )

    async def begin_subscription(self, clientid: str, topic_filter: str) -> bool:
        """Fix where a persistent session's new subscription starts, before the broker sends SUBACK.

        When a pubsub fetch rule applies to the filter and the (client, filter)
        pair has no read position, it is started now, so what is published
        after SUBACK is the subscription's, to be fetched at a later reconnect
        even if the client leaves at once. ``session_subscribed`` starts it
        too (at its fetch), a little later: a broker that can act before
        SUBACK calls this first. Whether a position was started.
        """
        check_clientid(clientid)
        validate_filter(topic_filter)
        real = real_filter(topic_filter)
        fetch = self.config.fetch_rule(real)
        if fetch is None or fetch.mode != "pubsub":
            return False
        if not (await self.client.start_read_position(clientid, real)).started:
            return False
        self.stats["read_positions_started"] += 1
        return True

    async def next_offline_page(self, clientid: str, topic_filter: str) -> tuple[list[Message], bool]:
        """The offline messages of a subscription after what was acknowledged: (page, more may follow).

        For a backlog larger than ``max_returned_count``: a read position moves
        only when messages are acknowledged, so the broker acknowledges one
        page before it asks for the next. Without a fetch rule for the filter,
        ([], False).
        """
        check_clientid(clientid)
        real = real_filter(topic_filter)
        fetch = next((rule for rule in self.config.rules_for("session.subscribed", real) if rule.kind == "fetch"), None)
        if fetch is None:
            return [], False
        page = await self._fetch(clientid, real, fetch)
        self.stats["fetched_offline"] += len(page)
        return page, _full_page(page, fetch)

    async def _fetch(self, clientid: str, topic_filter: str, rule: Rule) -> list[Message]:
        opts = rule.offline_opts
        assert opts is not None and rule.mode is not None  # every fetch rule has both
        include_qos0 = self.config.stores_qos0 if opts.include_qos0 is None else opts.include_qos0
        if rule.mode == "queue" and self.redelivery is not None:
            # The cluster counts each delivery to this reader and redelivers what it does not acknowledge
            # (time_range_s does not apply: a queue reader gets the whole backlog).
            done = await self.client.deliver(
                clientid, topic_filter, self.redelivery, opts.page, queue=True, include_qos0=include_qos0
            )
            self.stats["redelivered"] += sum(1 for count in done.deliveries if count > 1)
            self.stats["dead_lettered"] += done.dead_lettered
            return done.messages
        request = OfflineFetch(clientid, topic_filter, rule.mode, opts.page, opts.time_range_s, include_qos0, "now")
        return await self.offline.fetch(request)

    async def message_nacked(self, clientid: str, message: Message, *, sent: bool = True) -> None:
        """The broker could not deliver ``message`` to the client: its connection closed before the PUBACK
        (``sent``) or before the message was sent.

        With a redelivery policy, each of the client's queue filters that
        matches the topic gives the delivery back (``Client.nack``): due again
        at once, so the client's next connection gets it without waiting for
        the ack wait; a message never sent does not count as delivered.
        Otherwise nothing to do: an unacknowledged queue message comes again
        anyway.
        """
        check_clientid(clientid)
        if self.redelivery is None or message.shard is None or message.timestamp_us is None:
            return
        queued = [
            f
            for f in await self._filters_of(clientid)
            if matches(f, message.topic) and (rule := self.config.fetch_rule(f)) is not None and rule.mode == "queue"
        ]
        await asyncio.gather(*(self.client.nack(clientid, f, message, received=sent) for f in queued))
        self.stats["nacked"] += len(queued)

    async def session_unsubscribed(self, clientid: str, topic_filter: str) -> None:
        """Run the ``session.unsubscribed`` rules: forget the read position, delete the stored subscription."""
        check_clientid(clientid)
        validate_filter(topic_filter)
        real = real_filter(topic_filter)
        known = self._filters.get(clientid)
        if known is not None:
            known.pop(real, None)
        rules = self.config.rules_for("session.unsubscribed", real)
        forget = any(rule.kind == "forget_acks" for rule in rules)
        delete = any(rule.kind == "unsubscribe" for rule in rules)
        await asyncio.gather(
            self.client.forget_acks(clientid, real) if forget else _none(),
            self.client.unsubscribe(clientid, topic_filter) if delete else _none(),
        )
        self.stats["read_positions_deleted"] += forget
        self.stats["subscriptions_deleted"] += delete

    # -- messages ------------------------------------------------------------------

    async def message_publish(self, message: Message) -> Message | None:
        """Run the ``message.publish`` rules; return the message as stored for offline delivery, or None.

        Stores it (``on_message_publish``: QoS 1 and 2, QoS 0 too with
        ``keep_qos0``; ``on_message_store``: any QoS) and keeps or deletes its
        topic's retained message (``on_message_retain``, ``on_retain_delete``;
        only for messages published with RETAIN). The returned message carries
        its position (``shard``, ``timestamp_us``) for ``message_acked``; a
        message only retained returns None, as a retained message is no
        offline position.
        """
        validate_topic(message.topic)  # a bad message alone: raised, not counted as a failed store
        check_qos(message.qos)
        (stored,) = await self.message_publish_batch([message])
        return stored

    async def message_publish_batch(self, messages: list[Message]) -> list[Message | None]:
        """``message_publish`` for several messages at once: each one as stored, or None.

        The messages to store go to the client's pipeline in one call
        (``publish``): it coalesces them with whatever else this broker is
        storing (concurrent publishes, other calls of this method) into one
        batch per shard on a long-lived stream, in order, so each publisher's
        messages keep their order; retained messages are kept in order too.
        A message that breaks a rule (a bad topic, too many user properties, a
        payload over the node's limit) fails alone: it is None (counted as
        ``store_failed``, logged) and the others are stored. When the call
        stores only some shards' parts, the others are None too; any other
        failure is raised.
        """
        to_store: list[int] = []
        to_retain: list[Message] = []
        for index, message in enumerate(messages):
            try:
                validate_topic(message.topic)
                check_qos(message.qos)
            except ValueError as err:
                self._refused(message, err)
                self.stats["store_failed"] += 1
                continue
            rules = self.config.rules_for("message.publish", message.topic)
            if any(
                rule.kind == "store" and (message.qos > 0 or self.config.keep_qos0 or rule.spec.stores_qos0)
                for rule in rules
            ):
                to_store.append(index)
            kinds = {rule.kind for rule in rules}
            if message.retain and ("retain" in kinds or ("retain_delete" in kinds and not message.payload)):
                to_retain.append(message)
        for message in to_retain:  # one after another: the last one of a topic must win
            await self.client.retain(message)
            self.stats["retained" if message.payload else "retained_deleted"] += 1
        out: list[Message | None] = [None] * len(messages)
        if not to_store:
            return out
        try:
            stored = await self.client.publish([messages[i] for i in to_store])
        except PartialBatchError as err:
            # Stored messages come back in request order; equal messages
            # share a shard (their sender's) and the rules' verdict, so they
            # are all stored or all not.
            pending = collections.deque(err.stored)
            for index in to_store:
                if pending and _content(pending[0]) == _content(messages[index]):
                    out[index] = pending.popleft()
            for message, failure in err.failed:
                if not failure.retriable:
                    self._refused(message, failure)
            self.stats["stored"] += len(err.stored)
            self.stats["store_failed"] += len(err.failed)
            return out
        for index, message in zip(to_store, stored, strict=True):
            out[index] = message
        self.stats["stored"] += len(stored)
        return out

    def _refused(self, message: Message, err: Exception) -> None:
        """A message no node stores (the publisher's fault, not mqds'): logged and counted; the others go on."""
        self.stats["store_refused"] += 1
        log.warning("not storing a message from %r on %r: %s", message.sender[:200], message.topic[:200], err)

    async def message_acked(self, clientid: str, message: Message) -> None:
        """Run the ``message.acked`` rules: acknowledge ``message`` for each of the client's matching filters.

        ``message`` must carry its stored position (``shard`` and
        ``timestamp_us``, as ``message_publish`` or a :class:`Delivery`
        returned it). Each remembered filter of the client that matches the
        topic is acknowledged in its fetch rule's mode (see the module's
        documentation); a queue message is removed once, whichever filters
        match.
        """
        await self._acknowledge("message.acked", clientid, message, "acked")

    async def message_delivered(self, clientid: str, message: Message) -> None:
        """Run the ``message.delivered`` rules: the broker sent ``message`` to the client (QoS 0 too).

        ``on_message_delivered`` counts the delivery as the acknowledgement,
        as ``message_acked`` records one (at most once: what the client then
        loses is not sent again); a QoS 0 subscription, which sends no
        PUBACK, moves its read position this way. ``message`` must carry its
        stored position, as for ``message_acked``.
        """
        await self._acknowledge("message.delivered", clientid, message, "acked_on_delivery")

    async def _acknowledge(self, hook: str, clientid: str, message: Message, counted: str) -> None:
        check_clientid(clientid)
        if message.shard is None or message.timestamp_us is None:
            raise ValueError(
                f"{hook} needs the message's stored position (shard and timestamp_us), "
                "as message_publish or session_subscribed returned it"
            )
        rules = [rule for rule in self.config.rules_for(hook, message.topic) if rule.kind == "ack"]
        if not rules:
            return
        filters = [f for f in await self._filters_of(clientid) if matches(f, message.topic)]
        if not filters:
            self.stats["acks_without_subscription"] += 1
            return
        acks = list(_acks(filters, self.config, rules[0]))
        await asyncio.gather(*(self.client.ack(clientid, f, message, mode=mode) for f, mode in acks))
        self.stats[counted] += len(acks)

    @property
    def records_acks(self) -> bool:
        """Whether some rule records acknowledgements (``message.acked``, or deliveries as acknowledgements)."""
        return self._records_acks


def _full_page(page: list[Message], fetch: Rule) -> bool:
    assert fetch.offline_opts is not None  # every fetch rule has them
    return len(page) >= fetch.offline_opts.page


def _acks(filters: Iterable[str], config: HookConfig, ack_rule: Rule) -> Iterable[tuple[str, Mode]]:
    """(filter, mode) of each acknowledgement to record: every pubsub filter, one queue removal."""
    queued = False
    for topic_filter in filters:
        fetch = config.fetch_rule(topic_filter)
        mode = fetch.mode if fetch is not None and fetch.mode else ack_rule.mode or "pubsub"
        if mode == "queue":
            if queued:
                continue
            queued = True
        yield topic_filter, mode


async def _nothing() -> list[Message]:
    return []


async def _none() -> None:
    return None


def _content(message: Message) -> tuple[object, ...]:
    """What a message published holds (not where it was stored)."""
    m = message
    return m.topic, m.payload, m.sender, m.qos, m.retain, m.properties, m.message_expiry_s
