"""The checker: what a run's history and final read say about the cluster.

Given the :class:`~mqds.chaos.history.History` (what was attempted and
acknowledged, what readers saw while faults ran, the fault timeline), the
final read of everything stored (``final``, in replay order) and the replicas'
digests after healing, :func:`check` reports:

- **lost**: acknowledged but not in the final read (must be empty), each
  classified by shard and by where its acknowledgement fell relative to faults;
- **unexpected**: read but never attempted, or a topic and payload that do not
  agree (must be empty);
- **duplicates**: a message stored more than once (exactly-once writes: zero);
- **out of order**: a sender's sequences not increasing in replay;
- **moved**: a message read at another position than its acknowledgement gave;
- **vanished**: seen by a concurrent reader but not in the final read (a read
  of something that was not durable);
- **anomalies** the workload itself recorded (a reader saw a duplicate or a
  sender's messages out of order in one stream, the client misbehaved, a
  consumer got a non-retriable error);
- **persistent-session consumers** (:func:`check_consumers`): every
  acknowledged message must have been delivered to each pubsub consumer
  (``consumer-lost``, classified like losses), and to at least one of the
  queue consumers when it matches their filter; nothing never attempted may
  be delivered (``consumer-unexpected``); a pubsub consumer's first
  deliveries of each sender must come in sequence order
  (``consumer-order``); whatever was delivered must be in the final read
  (``consumer-vanished``). Redeliveries (a message delivered again to the
  same consumer, or to both queue consumers) are allowed by at-least-once
  delivery: they are counted per consumer, not violations;
- **hostile clients** (:func:`check_hostile`): no hostile request may get
  INTERNAL or UNKNOWN from any node (``hostile-internal``: a handler failed
  instead of refusing the request clearly), and no request that must be
  refused (an admin call without credentials, one with the secret whose
  arguments name nothing) may succeed (``hostile-accepted``); every answer is counted per
  request kind and per status code;
- **convergence**: every replica of every vnode at the same applied index with
  the same digest;
- **availability**: per fault, the longest time writes to its affected vnodes
  got no acknowledgement, and the same for the other vnodes. A fault that
  paused the workload (the idle-restart nemeses) is measured from when the
  workload resumed: the idle spell is the fault's, not an outage.

Only the first six kinds, anomalies, the consumer checks, the hostile clients'
checks and convergence are violations; availability and redeliveries are
measurements.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mqds.chaos.history import (
    QUEUE,
    TOPIC_FILTER,
    Ack,
    ConsumerLog,
    FaultRecord,
    History,
    HostileLog,
    MessageKey,
    ReadMessage,
    topic_of,
)
from mqds.protocol.topics import matches

# How long after a fault healed a write outage still counts as the fault's.
SETTLE_S = 10.0
# How many examples of each violation the report lists.
EXAMPLES = 10


@dataclass(frozen=True)
class Finding:
    """One violation: its kind, the message it concerns (if any) and what was wrong."""

    kind: str
    detail: str
    sender: str = ""
    seq: int = -1
    shard: int = -1
    where: str = ""


@dataclass(frozen=True)
class ReplicaState:
    node: str
    applied_index: int
    sha256: str
    keys: int


@dataclass
class Convergence:
    """The replicas of one vnode after healing."""

    shard: int
    converged: bool
    replicas: list[ReplicaState]
    detail: str = ""


@dataclass
class Outage:
    """How long writes stopped around one fault."""

    fault: int
    nemesis: str
    affected: dict[int, float]
    others_max_s: float
    others_shard: int

    @property
    def affected_max_s(self) -> float:
        return max(self.affected.values(), default=0.0)


@dataclass
class ConsumerStats:
    """What one persistent-session consumer got, against what it had to get."""

    name: str
    mode: str
    topic_filter: str
    delivered: int
    """Deliveries, redeliveries included."""
    distinct: int
    redelivered: int
    """Deliveries of a message this consumer had been delivered before."""
    also_to_others: int
    """Queue: distinct messages another queue consumer was delivered too (0 for pubsub)."""
    expected: int
    """Acknowledged messages matching its filter."""
    missing: int
    """Pubsub: expected, never delivered to it. Queue: expected, never delivered to any queue consumer."""
    fetches: int
    acks: int
    errors: int
    drained: bool

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class CheckResult:
    counts: dict[str, int]
    findings: list[Finding] = field(default_factory=list)
    convergence: list[Convergence] = field(default_factory=list)
    outages: list[Outage] = field(default_factory=list)
    loss_classes: dict[str, int] = field(default_factory=dict)
    consumers: list[ConsumerStats] = field(default_factory=list)
    consumer_loss_classes: dict[str, int] = field(default_factory=dict)
    hostile: dict[str, Any] | None = None
    """The hostile clients' answers (see :func:`check_hostile`); None when the run had none."""

    def of_kind(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]

    def violation_counts(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for finding in self.findings:
            counts[finding.kind] += 1
        counts["not-converged"] = sum(1 for c in self.convergence if not c.converged)
        return {k: v for k, v in sorted(counts.items()) if v}

    @property
    def passed(self) -> bool:
        return not self.violation_counts()

    def availability_summary(self) -> dict[str, dict[str, float]]:
        """Per nemesis: how many faults, and the max and median outage of affected and other vnodes."""
        by_kind: dict[str, list[Outage]] = defaultdict(list)
        for outage in self.outages:
            by_kind[outage.nemesis].append(outage)
        summary = {}
        for kind, outages in sorted(by_kind.items()):
            affected = [s for o in outages for s in o.affected.values()]
            others = [o.others_max_s for o in outages]
            summary[kind] = {
                "faults": len(outages),
                "affected_vnodes": len(affected),
                "affected_max_s": max(affected, default=0.0),
                "affected_median_s": statistics.median(affected) if affected else 0.0,
                "others_max_s": max(others, default=0.0),
                "others_median_s": statistics.median(others) if others else 0.0,
            }
        return summary

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "counts": self.counts,
            "violations": self.violation_counts(),
            "loss_classes": self.loss_classes,
            "consumers": [c.to_json() for c in self.consumers],
            "consumer_loss_classes": self.consumer_loss_classes,
            "hostile": self.hostile,
            "findings": [vars(f) for f in self.findings[: EXAMPLES * 20]],
            "convergence": [
                {
                    "shard": c.shard,
                    "converged": c.converged,
                    "detail": c.detail,
                    "replicas": [vars(r) for r in c.replicas],
                }
                for c in self.convergence
            ],
            "outages": [
                {
                    "fault": o.fault,
                    "nemesis": o.nemesis,
                    "affected_s": {str(k): round(v, 3) for k, v in o.affected.items()},
                    "affected_max_s": round(o.affected_max_s, 3),
                    "others_max_s": round(o.others_max_s, 3),
                    "others_shard": o.others_shard,
                }
                for o in self.outages
            ],
            "availability": {k: {m: round(v, 3) for m, v in d.items()} for k, d in self.availability_summary().items()},
        }


def _where(ack: Ack, faults: Sequence[FaultRecord]) -> str:
    """Where an acknowledgement fell relative to the faults: during one, after one, or before any."""
    for fault in faults:
        if fault.started - 1.0 <= ack.at <= fault.end + 1.0:
            return f"during fault #{fault.index} {fault.nemesis}"
    before = [f for f in faults if f.end < ack.at]
    if before:
        last = before[-1]
        return f"{ack.at - last.end:.1f}s after fault #{last.index} {last.nemesis}"
    return "before any fault"


def check_reads(history: History, final: Sequence[ReadMessage], unparsable: int = 0) -> CheckResult:
    """Lost, unexpected, duplicates, order, moved and vanished messages, plus the workload's anomalies."""
    result = CheckResult(counts=history.counts())
    findings = result.findings
    read: dict[MessageKey, ReadMessage] = {}
    last_seq: dict[str, int] = {}
    duplicates = 0
    for message in final:
        key = message.key
        if key in read:
            duplicates += 1
            first = read[key]
            findings.append(
                Finding(
                    "duplicate",
                    f"stored twice: at ts {first.timestamp_us} and ts {message.timestamp_us}",
                    message.sender,
                    message.seq,
                    message.shard,
                )
            )
            continue
        read[key] = message
        if key not in history.attempted:
            findings.append(
                Finding("unexpected", "read but never attempted", message.sender, message.seq, message.shard)
            )
        previous = last_seq.get(message.sender)
        if previous is not None and message.seq < previous:
            findings.append(
                Finding(
                    "out-of-order",
                    f"seq {message.seq} replayed after seq {previous}",
                    message.sender,
                    message.seq,
                    message.shard,
                )
            )
        last_seq[message.sender] = max(message.seq, previous if previous is not None else message.seq)
    for _ in range(unparsable):
        findings.append(Finding("unexpected", "a stored message whose topic and payload do not name one message"))
    faults = sorted(history.faults, key=lambda f: f.started)
    classes: dict[str, int] = defaultdict(int)
    moved = 0
    for key, ack in history.acked.items():
        got = read.get(key)
        if got is None:
            where = _where(ack, faults)
            classes[f"shard {ack.shard}, {where}"] += 1
            findings.append(
                Finding(
                    "lost",
                    f"acknowledged at {ack.at:.2f}s (shard {ack.shard}, ts {ack.timestamp_us}), not read back",
                    key[0],
                    key[1],
                    ack.shard,
                    where,
                )
            )
        elif (got.shard, got.timestamp_us) != (ack.shard, ack.timestamp_us):
            moved += 1
            findings.append(
                Finding(
                    "moved",
                    f"acknowledged at shard {ack.shard} ts {ack.timestamp_us}, read at shard {got.shard} "
                    f"ts {got.timestamp_us}",
                    key[0],
                    key[1],
                    got.shard,
                )
            )
    for key, (shard, ts) in history.seen.items():
        if key not in read:
            findings.append(
                Finding("vanished", f"seen by a reader during the run (ts {ts}), not in the final read", *key, shard)
            )
    for anomaly in history.anomalies:
        findings.append(Finding(anomaly.kind, f"at {anomaly.at:.2f}s: {anomaly.detail}"))
    result.loss_classes = dict(sorted(classes.items()))
    result.counts.update(
        {
            "read": len(read),
            "read_total": len(final),
            "lost": sum(classes.values()),
            "unexpected": len(result.of_kind("unexpected")),
            "duplicates": duplicates,
            "out_of_order": len(result.of_kind("out-of-order")),
            "moved": moved,
            "vanished": len(result.of_kind("vanished")),
            "unacked_but_stored": sum(1 for k in read if k in history.attempted and k not in history.acked),
            "unacked_not_stored": sum(1 for k in history.attempted if k not in history.acked and k not in read),
        }
    )
    return result


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
    """The persistent-session consumers' verdict, added to ``result`` (see the module's docstring).

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
        where = _where(ack, faults)
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


def ack_times_by_shard(history: History) -> dict[int, list[float]]:
    times: dict[int, list[float]] = defaultdict(list)
    for ack in history.acked.values():
        times[ack.shard].append(ack.at)
    for values in times.values():
        values.sort()
    return times


def longest_gap(
    times: Sequence[float], start: float, until: float, end_of_workload: float, cut_at: float | None = None
) -> float:
    """The longest stretch without an acknowledgement that begins in ``[start, until]``.

    The stretches begin at ``start`` or at an acknowledgement and end at the
    next acknowledgement (or at the end of the workload when none came), but
    no later than ``cut_at`` (when the next fault began: what follows is its).
    """
    stop = end_of_workload if cut_at is None else min(cut_at, end_of_workload)
    i = bisect.bisect_right(times, start)
    previous = start
    worst = 0.0
    while previous <= until and previous < stop:
        following = min(times[i] if i < len(times) else end_of_workload, stop)
        worst = max(worst, following - previous)
        if i >= len(times):
            break
        previous = times[i]
        i += 1
    return worst


def write_outages(
    history: History, n_shards: int, shards_of: Iterable[int] | None = None, settle_s: float = SETTLE_S
) -> list[Outage]:
    """For each fault, the longest write outage of each affected vnode, and the worst of the others.

    A fault's window runs from its start to ``settle_s`` after the cluster was
    whole again, and never into the next fault.
    """
    times = ack_times_by_shard(history)
    end = history.workload_ended if history.workload_ended is not None else history.clock()
    all_shards = sorted(set(shards_of) if shards_of is not None else range(n_shards))
    faults = sorted(history.faults, key=lambda f: f.started)
    outages = []
    for i, fault in enumerate(faults):
        cut_at = faults[i + 1].started if i + 1 < len(faults) else None
        until = fault.end + settle_s if cut_at is None else min(fault.end + settle_s, cut_at)

        # A fault that paused the workload: nothing was written until it resumed, by design.
        begin = fault.resumed_at if fault.resumed_at is not None else fault.started

        def gap(shard: int, b: float = begin, u: float = until, c: float | None = cut_at) -> float:
            return longest_gap(times.get(shard, []), b, u, end, c)

        affected = {s: gap(s) for s in fault.affected_shards}
        others = {s: gap(s) for s in all_shards if s not in fault.affected_shards}
        worst = max(others.items(), key=lambda item: item[1], default=(-1, 0.0))
        outages.append(Outage(fault.index, fault.nemesis, affected, worst[1], worst[0]))
    return outages


INTERNAL_CODES = ("INTERNAL", "UNKNOWN")
"""Status codes no hostile request may get: a handler that failed instead of refusing the request clearly."""


def check_hostile(log: HostileLog, result: CheckResult) -> None:
    """The hostile clients' verdict, added to ``result``: findings, and the counts per kind and per status."""
    for answer in log.answers:
        if answer.code in INTERNAL_CODES:
            result.findings.append(
                Finding(
                    "hostile-internal",
                    f"{answer.kind} to {answer.node} at {answer.at:.2f}s: {answer.code}: {answer.detail}",
                )
            )
        elif answer.code == "OK" and answer.kind in log.must_refuse:
            result.findings.append(
                Finding(
                    "hostile-accepted",
                    f"{answer.kind} to {answer.node} at {answer.at:.2f}s: succeeded: it must be refused",
                )
            )
    if log.dropped:
        result.findings.append(Finding("hostile-internal", f"{log.dropped} more such answers (not kept)"))
    by_status = log.by_status()
    result.hostile = {
        "sent": log.sent,
        "by_status": by_status,
        "by_kind": {kind: dict(sorted(codes.items())) for kind, codes in sorted(log.counts.items())},
        "must_refuse": sorted(log.must_refuse),
        "examples": [
            {"kind": a.kind, "node": a.node, "code": a.code, "detail": a.detail, "at_s": round(a.at, 3)}
            for (_, _), a in sorted(log.examples.items())
            if a.code != "OK"
        ],
    }
    result.counts.update(
        {
            "hostile_sent": log.sent,
            "hostile_internal": sum(by_status.get(code, 0) for code in INTERNAL_CODES),
            "hostile_accepted": len(result.of_kind("hostile-accepted")),
        }
    )


def check(
    history: History,
    final: Sequence[ReadMessage] | None,
    convergence: Sequence[Convergence],
    n_shards: int,
    unparsable: int = 0,
) -> CheckResult:
    """The whole verdict of a run (see the module's docstring)."""
    # Nothing could be read back: only the counts (the runner records why).
    result = CheckResult(counts=history.counts()) if final is None else check_reads(history, final, unparsable)
    check_consumers(history, result, None if final is None else {m.key for m in final})
    if history.hostile is not None:
        check_hostile(history.hostile, result)
    result.convergence = list(convergence)
    result.outages = write_outages(history, n_shards)
    return result
