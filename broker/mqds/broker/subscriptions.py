"""What a subscription is to the dispatcher: its real filter, and what a new one receives.

:func:`real_filter` strips the shared-subscription prefixes (``$share/<group>/``,
``$queue/``) that matching, fetching and acknowledging ignore; :class:`Delivery`
is what :meth:`mqds.broker.actions.BrokerHooks.session_subscribed` hands the
broker for a new subscription.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mqds.broker.catalogue import Mode
from mqds.client.model import Message

__all__ = ["SHARED_PREFIXES", "Delivery", "check_clientid", "check_qos", "real_filter"]

SHARED_PREFIXES = ("$share/", "$queue/")
"""The prefixes of shared subscriptions' filters (``$share/<group>/<filter>``, EMQX's ``$queue/<filter>``)."""


@dataclass(frozen=True)
class Delivery:
    """What a new subscription should receive: ``messages`` = ``offline`` (oldest first), then ``retained``.

    ``offline`` are stored messages the subscription missed, each with its
    position (``shard``, ``timestamp_us``), which ``message_acked`` needs back;
    ``retained`` are the retained messages matching the filter, by topic.
    ``modes`` maps the filter offline messages were fetched for to the mode
    used (``pubsub`` or ``queue``); empty when no fetch rule applied. A
    retained message that was also stored offline comes in both lists (with
    ``retain`` set in ``offline`` too): a broker that sends ``retained`` should
    not send the stored copies of retained publishes (``looked_up`` says
    whether retained messages were looked up), or a subscriber gets a retained
    message twice, and a deleted one with its empty delete marker.
    """

    messages: list[Message] = field(default_factory=list)
    offline: list[Message] = field(default_factory=list)
    retained: list[Message] = field(default_factory=list)
    modes: dict[str, Mode] = field(default_factory=dict)
    looked_up: bool = False
    """The retained messages were looked up (``retained`` is what mqds retains for the filter)."""
    more: bool = False
    """``offline`` is a full page (``max_returned_count``): more may be stored. Once these are
    acknowledged, :meth:`BrokerHooks.next_offline_page` returns the next page."""


def real_filter(topic_filter: str) -> str:
    """The filter a shared subscription matches: without ``$share/<group>/`` or ``$queue/``.

    >>> real_filter("$share/workers/jobs/#"), real_filter("$queue/jobs/+"), real_filter("a/b")
    ('jobs/#', 'jobs/+', 'a/b')
    """
    if topic_filter.startswith("$share/"):
        parts = topic_filter.split("/", 2)
        if len(parts) == 3 and parts[1] and parts[2]:
            return parts[2]
        raise ValueError(f"invalid shared subscription {topic_filter!r}: expected $share/<group>/<filter>")
    if topic_filter.startswith("$queue/"):
        rest = topic_filter[len("$queue/") :]
        if rest:
            return rest
        raise ValueError(f"invalid shared subscription {topic_filter!r}: expected $queue/<filter>")
    return topic_filter


def check_clientid(clientid: object) -> str:
    if not isinstance(clientid, str) or not clientid:
        raise ValueError(f"clientid must be a non-empty string, not {clientid!r}")
    return clientid


def check_qos(qos: object) -> int:
    if isinstance(qos, bool) or not isinstance(qos, int) or not 0 <= qos <= 2:
        raise ValueError(f"qos must be 0, 1 or 2, not {qos!r}")
    return qos
