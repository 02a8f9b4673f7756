"""The check of the persistent-session consumers: what each was delivered against the acknowledged writes.

:func:`check_consumers`: every acknowledged message must have been delivered
to each pubsub consumer (``consumer-lost``), and to at least one of the queue
consumers when it matches their filter; nothing never attempted may be
delivered (``consumer-unexpected``); a pubsub consumer's first deliveries of
each sender must come in sequence order (``consumer-order``); whatever was
delivered must be in the final read (``consumer-vanished``). Redeliveries are
counted, not violations.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from mqds.chaos.checker.reads import where_acked
from mqds.chaos.checker.result import CheckResult, ConsumerStats, Finding
from mqds.chaos.history import (
    QUEUE,
    TOPIC_FILTER,
    Ack,
    ConsumerLog,
    FaultRecord,
    History,
    MessageKey,
    ReadMessage,
    topic_of,
)
from mqds.protocol.topics import matches


def _expected(history: History, topic_filter: str) -> dict[MessageKey, Ack]:
    """The acknowledged messages whose topic ``topic_filter`` matches."""
    if topic_filter == TOPIC_FILTER:  # all of them: spare matching every topic of a long run
        return history.acked
    return {key: ack for key, ack in history.acked.items() if matches(topic_filter, topic_of(*key))}


def _first_deliveries(deliveries: Sequence[ReadMessage]) -> list[ReadMessage]:
    seen: set[MessageKey] = set()
    first = []
    for m in deliveries:
        if m.key not in seen:
            seen.add(m.key)
            first.append(m)
    return first


def check_consumers(history: History, result: CheckResult, stored: set[MessageKey] | None = None) -> None:
    """The persistent-session consumers' verdict, added to ``result`` (see :mod:`mqds.chaos.checker`).

    ``stored`` is what the final read found (None when nothing could be read
    back: then ``consumer-vanished`` is not checked).
    """
    findings = result.findings
    faults = sorted(history.faults, key=lambda f: f.started)
    classes: dict[str, int] = defaultdict(int)
    logs = list(history.consumers.values())
    delivered = {c.name: history.deliveries(c.name) for c in logs}
    queue = [c for c in logs if c.mode == QUEUE]
    # Queue: which queue consumers got each message (an acknowledgement from any of them removes it for all).
    queue_got: dict[MessageKey, set[str]] = defaultdict(set)
    for c in queue:
        for m in delivered[c.name]:
            queue_got[m.key].add(c.name)
    queue_expected: dict[MessageKey, Ack] = {}
    for topic_filter in sorted({c.topic_filter for c in queue}):
        queue_expected.update(_expected(history, topic_filter))
    if queue:
        names = ",".join(c.name for c in queue)
        missed = {k: a for k, a in queue_expected.items() if k not in queue_got}
        drained = all(c.drained for c in queue)
        _consumer_lost(f"queue consumers {names}", missed, drained, faults, findings, classes)
    stats = []
    for c in logs:
        mine = delivered[c.name]
        keys = {m.key for m in mine}
        expected = queue_expected if c.mode == QUEUE else _expected(history, c.topic_filter)
        if c.mode == QUEUE:
            missing = sum(1 for k in expected if k not in queue_got)
        else:
            missed = {k: a for k, a in expected.items() if k not in keys}
            missing = len(missed)
            _consumer_lost(f"consumer {c.name}", missed, c.drained, faults, findings, classes)
            _consumer_order(c, mine, findings)
        for key in sorted(k for k in keys if k not in history.attempted):
            findings.append(Finding("consumer-unexpected", f"delivered to {c.name}, never attempted", *key))
        if stored is not None:
            for key in sorted(k for k in keys if k in history.attempted and k not in stored):
                findings.append(Finding("consumer-vanished", f"delivered to {c.name}, not in the final read", *key))
        stats.append(
            ConsumerStats(
                name=c.name,
                mode=c.mode,
                topic_filter=c.topic_filter,
                delivered=len(mine),
                distinct=len(keys),
                redelivered=len(mine) - len(keys),
                also_to_others=sum(1 for k in keys if len(queue_got[k]) > 1) if c.mode == QUEUE else 0,
                expected=len(expected),
                missing=missing,
                fetches=c.fetches,
                acks=c.acks,
                errors=c.errors,
                drained=c.drained,
            )
        )
    result.consumers = stats
    result.consumer_loss_classes = dict(sorted(classes.items()))
    result.counts.update(
        {
            "consumer_delivered": sum(s.delivered for s in stats),
            "consumer_redelivered": sum(s.redelivered for s in stats),
            "consumer_missing": len(result.of_kind("consumer-lost")),
            "consumer_unexpected": len(result.of_kind("consumer-unexpected")),
            "consumer_out_of_order": len(result.of_kind("consumer-order")),
        }
    )


def _consumer_lost(
    who: str,
    missed: dict[MessageKey, Ack],
    drained: bool,
    faults: Sequence[FaultRecord],
    findings: list[Finding],
    classes: dict[str, int],
) -> None:
    """A ``consumer-lost`` finding per message, classified by shard and where its write was acknowledged."""
    why = "" if drained else "; the consumer did not finish draining"
    for key, ack in sorted(missed.items()):
        where = where_acked(ack, faults)
        classes[f"{who}: shard {ack.shard}, {where}"] += 1
        findings.append(
            Finding(
                "consumer-lost",
                f"acknowledged at {ack.at:.2f}s (shard {ack.shard}, ts {ack.timestamp_us}), never delivered to "
                f"{who}{why}",
                key[0],
                key[1],
                ack.shard,
                where,
            )
        )


def _consumer_order(consumer: ConsumerLog, deliveries: Sequence[ReadMessage], findings: list[Finding]) -> None:
    """Pubsub: each sender's messages, as first delivered, must come in sequence order (redeliveries aside)."""
    last_seq: dict[str, int] = {}
    for m in _first_deliveries(deliveries):
        previous = last_seq.get(m.sender)
        if previous is not None and m.seq < previous:
            findings.append(
                Finding(
                    "consumer-order",
                    f"first delivered to {consumer.name} after seq {previous}",
                    m.sender,
                    m.seq,
                    m.shard,
                )
            )
        last_seq[m.sender] = max(m.seq, previous if previous is not None else m.seq)
