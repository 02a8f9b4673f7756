"""The check of the push subscribers: every acknowledged message sent to each exactly once.

A follower's subscription covers ``chaos/#`` from the start, so it must have
been sent every acknowledged message (``follower-lost``, classified like
losses), each once (``follower-duplicate``: unlike a persistent-session
consumer's at-least-once, a subscription resumed from its position repeats
nothing), nothing never attempted (``follower-unexpected``) and nothing that
is not in the final read (``follower-vanished``). Order within a sender is
checked as the messages come (the ``follower-order`` anomaly).
"""

from __future__ import annotations

from collections import defaultdict

from mqds.chaos.checker.reads import where_acked
from mqds.chaos.checker.result import CheckResult, Finding, FollowerStats
from mqds.chaos.history import History, MessageKey


def check_followers(history: History, result: CheckResult, final_keys: set[MessageKey] | None) -> None:
    """Add the followers' findings and statistics to ``result``."""
    faults = sorted(history.faults, key=lambda f: f.started)
    classes: dict[str, int] = defaultdict(int)
    for name in sorted(history.followers):
        log = history.followers[name]
        counts = dict(log.counts)
        sent = sum(counts.values())
        duplicates = [(key, n) for key, n in counts.items() if n > 1]
        for (sender, seq), n in duplicates:
            result.findings.append(Finding("follower-duplicate", f"{name}: sent {n} times", sender, seq))
        for key in counts:
            if key not in history.attempted:
                result.findings.append(Finding("follower-unexpected", f"{name}: never attempted", *key))
            elif final_keys is not None and key not in final_keys:
                result.findings.append(Finding("follower-vanished", f"{name}: sent, not in the final read", *key))
        missing = 0
        for key, ack in history.acked.items():
            if key not in counts:
                missing += 1
                where = where_acked(ack, faults)
                classes[f"{name}: shard {ack.shard}, {where}"] += 1
                result.findings.append(
                    Finding(
                        "follower-lost",
                        f"{name}: acknowledged at {ack.at:.2f}s (ts {ack.timestamp_us}), never sent",
                        key[0],
                        key[1],
                        ack.shard,
                        where,
                    )
                )
        result.followers.append(
            FollowerStats(
                name=name,
                any_replica=log.any_replica,
                sent=sent,
                distinct=len(counts),
                duplicates=len(duplicates),
                expected=len(history.acked),
                missing=missing,
                restarts=log.restarts,
                errors=log.errors,
                complete=log.complete,
            )
        )
    result.follower_loss_classes = dict(sorted(classes.items()))
