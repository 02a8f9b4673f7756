"""The end-of-run report: text for people, JSON for programs."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from mqds.chaos.checker import EXAMPLES, CheckResult
from mqds.chaos.history import QUEUE, FaultRecord

DESCRIPTIONS = {
    "lost": "acknowledged, not read back",
    "unexpected": "read, never attempted (or topic and payload disagree)",
    "duplicate": "stored more than once",
    "out-of-order": "a sender's sequences not increasing in replay",
    "moved": "read at another position than acknowledged",
    "vanished": "seen by a reader during the run, gone at the end",
    "not-converged": "vnodes whose replicas differ after healing",
    "consumer-lost": "acknowledged, never delivered to a consumer that had to get it",
    "consumer-unexpected": "delivered to a consumer, never attempted (or topic and payload disagree)",
    "consumer-order": "a sender's sequences not increasing in a pubsub consumer's first deliveries",
    "consumer-vanished": "delivered to a consumer during the run, gone at the end",
    "consumer-error": "a consumer's fetch or ack failed with a non-retriable error",
    "consumer-crashed": "a consumer thread died",
    "follower-lost": "acknowledged, never sent to a push subscriber",
    "follower-duplicate": "sent to a push subscriber more than once",
    "follower-unexpected": "sent to a push subscriber, never attempted (or topic and payload disagree)",
    "follower-vanished": "sent to a push subscriber during the run, gone at the end",
    "follower-order": "a sender's sequences not increasing in what a push subscriber was sent",
    "follower-error": "a push subscription ended with a non-retriable error",
    "follower-crashed": "a follower thread died",
    "hostile-internal": "a hostile request got INTERNAL or UNKNOWN: the node failed instead of refusing it clearly",
    "hostile-accepted": (
        "a request that must be refused succeeded (an admin call without credentials, or naming nothing)"
    ),
    "hostile-crashed": "the hostile clients' thread died",
    "node-crashed": "a node process exited by itself",
    "not-recovered": "the cluster, or a restarted node, was not ready within the bound",
}


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def text_report(run: dict[str, Any], result: CheckResult, faults: list[FaultRecord]) -> str:
    c = result.counts
    lines = [
        f"mqds chaos run: seed {run['seed']}, {run['nodes']} nodes, {run['shards']} shards, "
        f"nemeses {','.join(run['nemeses'])}, {run['elapsed_s']:.0f}s (asked {run['duration_s']:.0f}s), "
        f"network {run['network']}, disk {run.get('disk', 'off')}",
    ]
    violations = result.violation_counts()
    if result.passed:
        delivered = ", every consumer got everything" if result.consumers else ""
        if result.followers:
            delivered += ", every follower was sent everything once"
        lines.append(
            f"RESULT: PASS (nothing lost, nothing unexpected, no duplicates, in order, replicas converged{delivered})"
        )
    else:
        lines.append("RESULT: FAIL (" + ", ".join(f"{k} {v}" for k, v in violations.items()) + ")")
    converged = sum(1 for v in result.convergence if v.converged)
    lines += [
        "",
        "workload",
        f"  messages attempted    {c.get('attempted', 0):>10,}   in {c.get('calls', 0):,} store calls "
        f"(ok {c.get('calls_ok', 0):,}, partial {c.get('calls_partial', 0):,}, "
        f"unknown {c.get('calls_unknown', 0):,}, failed {c.get('calls_failed', 0):,})",
        f"  acknowledged          {c.get('acked', 0):>10,}",
        f"  read back at the end  {c.get('read', 0):>10,}   (not acknowledged but stored "
        f"{c.get('unacked_but_stored', 0):,}; not acknowledged, not stored {c.get('unacked_not_stored', 0):,})",
        f"  lost                  {c.get('lost', 0):>10,}",
        f"  unexpected            {c.get('unexpected', 0):>10,}",
        f"  duplicates            {c.get('duplicates', 0):>10,}",
        f"  out of order          {c.get('out_of_order', 0):>10,}",
        f"  moved / vanished      {c.get('moved', 0):>10,} / {c.get('vanished', 0):,}",
        f"  read while running    {c.get('reads_observed', 0):>10,}   by {run['readers']} readers",
        f"  replicas              {converged:>10} of {len(result.convergence)} vnodes converged "
        "(same applied index and digest)",
        *_follower_table(result),
        *_consumer_table(result),
        *_hostile_table(result),
        "",
        "fault timeline (outage = longest time a vnode got no acknowledged write, from the fault until 10 s "
        "after recovery)",
        f"  {'#':>3} {'start':>7} {'nemesis':<16} {'targets':<12} {'healed':>7} {'ready':>7} "
        f"{'hit vnodes':<14} {'outage hit':>10} {'others':>8}  detail",
    ]
    outages = {o.fault: o for o in result.outages}
    for f in faults:
        o = outages.get(f.index)
        hit = ",".join(map(str, f.affected_shards)) or "-"
        held = None if f.healed is None else f.healed - f.started
        ready = None if f.recovered is None or f.healed is None else f.recovered - f.healed
        paused = (
            f" (workload paused {f.resumed_at - f.paused_at:.1f}s; outage counted from its resumption)"
            if f.paused_at is not None and f.resumed_at is not None
            else ""
        )
        detail = (
            f.detail
            + paused
            + (f" [{'; '.join(f.notes)}]" if f.notes else "")
            + (f" ERROR: {f.error}" if f.error else "")
        )
        lines.append(
            f"  {f.index:>3} {f.started:>6.1f}s {f.nemesis:<16} {','.join(f.targets):<12} {_s(held):>7} "
            f"{_s(ready):>7} {hit[:14]:<14} {_s(o.affected_max_s if o and o.affected else None):>10} "
            f"{_s(o.others_max_s if o else None):>8}  {detail}"
        )
    lines += [
        "",
        "availability per nemesis (outage of the vnodes each fault hit; 'others' = worst vnode not hit)",
        f"  {'nemesis':<16} {'faults':>6} {'vnodes hit':>10} {'max':>7} {'median':>7} {'others max':>10} "
        f"{'others median':>13}",
    ]
    for kind, row in result.availability_summary().items():
        lines.append(
            f"  {kind:<16} {row['faults']:>6.0f} {row['affected_vnodes']:>10.0f} {_s(row['affected_max_s']):>7} "
            f"{_s(row['affected_median_s']):>7} {_s(row['others_max_s']):>10} {_s(row['others_median_s']):>13}"
        )
    if result.loss_classes:
        lines += ["", "lost messages by where they fall"]
        lines += [f"  {count:>8,}  {where}" for where, count in result.loss_classes.items()]
    if result.follower_loss_classes:
        lines += ["", "messages followers were never sent, by where their write was acknowledged"]
        lines += [f"  {count:>8,}  {where}" for where, count in result.follower_loss_classes.items()]
    if result.consumer_loss_classes:
        lines += ["", "messages consumers never got, by where their write was acknowledged"]
        lines += [f"  {count:>8,}  {where}" for where, count in result.consumer_loss_classes.items()]
    if not result.passed:
        lines += ["", f"violations (first {EXAMPLES} of each kind)"]
        by_kind: dict[str, list[str]] = defaultdict(list)
        for finding in result.findings:
            what = f"{finding.sender}#{finding.seq} " if finding.sender else ""
            shard = f"shard {finding.shard}: " if finding.shard >= 0 else ""
            where = f" ({finding.where})" if finding.where else ""
            by_kind[finding.kind].append(f"{what}{shard}{finding.detail}{where}")
        for kind, items in by_kind.items():
            lines.append(f"  {kind} ({len(items)}): {DESCRIPTIONS.get(kind, '')}")
            lines += [f"    {item}" for item in items[:EXAMPLES]]
        for conv in result.convergence:
            if not conv.converged:
                states = ", ".join(f"{r.node}@{r.applied_index}:{r.sha256[:10]}" for r in conv.replicas)
                lines.append(f"  not-converged: shard {conv.shard}: {states} {conv.detail}")
    return "\n".join(lines) + "\n"


def _follower_table(result: CheckResult) -> list[str]:
    """One row per push subscriber (no lines when the run had none)."""
    if not result.followers:
        return []
    lines = [
        "",
        "push subscribers (Client.follow on chaos/#: every acknowledged message exactly once; restarts = shard",
        "parts moved to another replica after a fault)",
        f"  {'follower':<12} {'served by':<12} {'sent':>10} {'distinct':>9} {'duplicates':>10} {'missing':>8} "
        f"{'restarts':>8} {'errors':>6}  complete",
    ]
    for f in result.followers:
        served = "any replica" if f.any_replica else "leaders"
        lines.append(
            f"  {f.name:<12} {served:<12} {f.sent:>10,} {f.distinct:>9,} {f.duplicates:>10,} {f.missing:>8,} "
            f"{f.restarts:>8,} {f.errors:>6,}  {'yes' if f.complete else 'NO'}"
        )
    return lines


def _consumer_table(result: CheckResult) -> list[str]:
    """One row per persistent-session consumer (no lines when the run had none)."""
    if not result.consumers:
        return []
    lines = [
        "",
        "persistent-session consumers (at-least-once: redeliveries allowed, counted; missing = acknowledged, never",
        "delivered: for queue consumers, to neither of them; to both = queue messages the other one got too)",
        f"  {'consumer':<16} {'mode':<6} {'filter':<20} {'delivered':>10} {'distinct':>9} {'redelivered':>11} "
        f"{'to both':>8} {'missing':>8} {'acks':>8} {'errors':>6}  drained",
    ]
    for c in result.consumers:
        both = f"{c.also_to_others:,}" if c.mode == QUEUE else "-"
        lines.append(
            f"  {c.name:<16} {c.mode:<6} {c.topic_filter:<20} {c.delivered:>10,} {c.distinct:>9,} "
            f"{c.redelivered:>11,} {both:>8} {c.missing:>8,} {c.acks:>8,} {c.errors:>6,}  "
            f"{'yes' if c.drained else 'NO'}"
        )
    return lines


def _hostile_table(result: CheckResult) -> list[str]:
    """The hostile clients' answers per request kind and status (no lines when the run had none)."""
    hostile = result.hostile
    if not hostile:
        return []
    statuses = ", ".join(f"{code} {n:,}" for code, n in hostile["by_status"].items()) or "none"
    lines = [
        "",
        "hostile clients (raw gRPC beside the workload: none may get INTERNAL or UNKNOWN; those marked must be",
        "refused: admin calls without credentials, and with the secret but naming nothing)",
        f"  requests sent {hostile['sent']:,}: {statuses}",
        f"  {'request':<38} {'sent':>6}  answers",
    ]
    for kind, codes in hostile["by_kind"].items():
        answers = ", ".join(f"{code} {n:,}" for code, n in codes.items())
        refuse = " (must be refused)" if kind in hostile["must_refuse"] else ""
        lines.append(f"  {kind:<38} {sum(codes.values()):>6,}  {answers}{refuse}")
    return lines


def json_report(run: dict[str, Any], result: CheckResult, faults: list[FaultRecord]) -> dict[str, Any]:
    return {
        "run": run,
        **result.to_json(),
        "faults": [
            {
                "index": f.index,
                "nemesis": f.nemesis,
                "targets": f.targets,
                "detail": f.detail,
                "started_s": round(f.started, 3),
                "healed_s": None if f.healed is None else round(f.healed, 3),
                "recovered_s": None if f.recovered is None else round(f.recovered, 3),
                "affected_shards": f.affected_shards,
                "notes": f.notes,
                "error": f.error,
                "paused_s": None if f.paused_at is None else round(f.paused_at, 3),
                "resumed_s": None if f.resumed_at is None else round(f.resumed_at, 3),
            }
            for f in faults
        ],
    }
