"""What broker persistence rules can name: the broker's hooks, and the mqds actions each may run.

The hook points are EMQX's (``client.connected``, ``message.publish``, ...),
which the amqtt plugin maps its own events to; the actions are those of
EMQX's Redis, Cassandra and DynamoDB persistence backends, and a few of
mqds's own. ``ACTIONS`` says for each what :class:`mqds.broker.actions.BrokerHooks`
does (its ``kind``) and on which hooks it may run; the rules of a
configuration file (:mod:`mqds.broker.hooks`) are checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["pubsub", "queue"]

# What an action does, as BrokerHooks dispatches it.
Kind = Literal[
    "client_connected",
    "client_disconnected",
    "subscription_lookup",
    "store",
    "retain",
    "retain_delete",
    "retain_lookup",
    "fetch",
    "ack",
    "forget_acks",
    "subscribe",
    "unsubscribe",
]

HOOKS: dict[str, str] = {
    "client.connected": "a client connected (after authentication)",
    "client.disconnected": "a client's connection closed",
    "session.created": "a new session was created for a client",
    "session.subscribed": "a subscription was added to a session (one call per topic filter)",
    "session.unsubscribed": "a subscription was removed from a session",
    "message.publish": "a message was published (before it is routed to subscribers)",
    "message.delivered": "the broker sent a message to a subscriber (before any PUBACK; QoS 0 too)",
    "message.acked": "a subscriber acknowledged a QoS 1/2 message (PUBACK, PUBCOMP)",
}
"""The hooks rules may name, with when the broker runs them."""

# Hooks whose topic is a message topic or a subscription filter; the others have none.
TOPIC_HOOKS = frozenset(
    {"session.subscribed", "session.unsubscribed", "message.publish", "message.delivered", "message.acked"}
)

# EMQX hook points that exist but have no persistence action, for a clearer error.
OTHER_BROKER_HOOKS = frozenset(
    {
        "client.connect",
        "client.connack",
        "client.authenticate",
        "client.authorize",
        "client.check_acl",
        "client.subscribe",
        "client.unsubscribe",
        "session.resumed",
        "session.discarded",
        "session.takenover",
        "session.takeovered",
        "session.terminated",
        "message.dropped",
    }
)


@dataclass(frozen=True)
class ActionSpec:
    """An action: the hooks it may run on, what it does, in which delivery mode."""

    hooks: frozenset[str]
    kind: Kind
    doc: str
    mode: Mode | None = None
    stores_qos0: bool = False


_LOOKUP_HOOKS = frozenset({"client.connected", "session.created"})

ACTIONS: dict[str, ActionSpec] = {
    "on_client_connected": ActionSpec(
        frozenset({"client.connected"}),
        "client_connected",
        "records the client online on the broker node, with the time (client_connected)",
    ),
    "on_client_disconnected": ActionSpec(
        frozenset({"client.disconnected"}),
        "client_disconnected",
        "records the client offline, with the time, unless it is recorded on another node by now "
        "(client_disconnected with node)",
    ),
    "on_subscribe_lookup": ActionSpec(
        _LOOKUP_HOOKS,
        "subscription_lookup",
        "reads the client's stored subscriptions and hands them to the broker to subscribe it to (proxy subscriptions)",
    ),
    "on_subscription_lookup": ActionSpec(
        _LOOKUP_HOOKS, "subscription_lookup", "the Cassandra backend's name for on_subscribe_lookup"
    ),
    "on_message_publish": ActionSpec(
        frozenset({"message.publish"}),
        "store",
        "stores the published message for offline delivery if its QoS is 1 or 2 (or any QoS with keep_qos0)",
    ),
    "on_message_store": ActionSpec(
        frozenset({"message.publish"}),
        "store",
        "stores every published message, QoS 0 included",
        stores_qos0=True,
    ),
    "on_message_retain": ActionSpec(
        frozenset({"message.publish"}),
        "retain",
        "keeps a message published with RETAIN as its topic's retained message; an empty payload deletes it",
    ),
    "on_retain_delete": ActionSpec(
        frozenset({"message.publish"}),
        "retain_delete",
        "deletes the topic's retained message when a message with RETAIN and an empty payload is published",
    ),
    "on_retain_lookup": ActionSpec(
        frozenset({"session.subscribed"}),
        "retain_lookup",
        "reads the retained messages matching the new subscription, for delivery after the offline ones",
    ),
    "on_message_fetch": ActionSpec(
        frozenset({"session.subscribed"}),
        "fetch",
        "reads the messages the subscription missed after its own read position, which starts at its "
        "first SUBSCRIBE (pubsub: every subscriber reads every message)",
        mode="pubsub",
    ),
    "on_message_fetch_for_pubsub": ActionSpec(
        frozenset({"session.subscribed"}), "fetch", "the same as on_message_fetch", mode="pubsub"
    ),
    "on_message_fetch_for_queue": ActionSpec(
        frozenset({"session.subscribed"}),
        "fetch",
        "reads the matching messages no subscriber has acknowledged yet (queue: each message is "
        "consumed once, by whoever acknowledges it first)",
        mode="queue",
    ),
    "on_message_acked": ActionSpec(
        frozenset({"message.acked"}),
        "ack",
        "advances the read position of each of the client's subscriptions matching the message (pubsub)",
        mode="pubsub",
    ),
    "on_message_acked_for_pubsub": ActionSpec(
        frozenset({"message.acked"}), "ack", "the same as on_message_acked", mode="pubsub"
    ),
    "on_message_acked_for_queue": ActionSpec(
        frozenset({"message.acked"}),
        "ack",
        "removes the acknowledged message from the queue, for every subscriber (queue)",
        mode="queue",
    ),
    "on_message_delivered": ActionSpec(
        frozenset({"message.delivered"}),
        "ack",
        "counts the delivery as the acknowledgement (at most once): the read position of each of the client's "
        "subscriptions matching the message moves past it, or a queue message is removed, when the broker sends "
        "it; how a QoS 0 subscription, which never sends PUBACK, moves (mqds addition: the Cassandra seed lists "
        "message.delivered for raw CQL only)",
    ),
    "on_acked_delete": ActionSpec(
        frozenset({"session.unsubscribed"}),
        "forget_acks",
        "deletes the read position of the (client, filter) the client unsubscribed from",
    ),
    # mqds's own: the seeds store and delete subscriptions with raw SQL/CQL/Redis commands.
    "on_subscription_store": ActionSpec(
        frozenset({"session.subscribed"}),
        "subscribe",
        "stores the subscription (filter and QoS), for on_subscribe_lookup at the next connect (mqds addition)",
    ),
    "on_subscription_delete": ActionSpec(
        frozenset({"session.unsubscribed"}),
        "unsubscribe",
        "deletes the stored subscription (mqds addition)",
    ),
}
"""Every action, by name."""
