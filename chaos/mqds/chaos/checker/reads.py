"""The check of the acknowledged writes against the final read and what the readers saw during the run.

:func:`check_reads` reports lost, unexpected, duplicated, out-of-order, moved
and vanished messages, and the anomalies the workload recorded; a loss is
classified by shard and by where its acknowledgement fell relative to the
faults (:func:`where_acked`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from mqds.chaos.checker.result import CheckResult, Finding
from mqds.chaos.history import Ack, FaultRecord, History, MessageKey, ReadMessage


def where_acked(ack: Ack, faults: Sequence[FaultRecord]) -> str:
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
            where = where_acked(ack, faults)
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
