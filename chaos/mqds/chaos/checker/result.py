"""What the checker finds: :class:`Finding` (one violation), the measurements, and the :class:`CheckResult`.

:class:`CheckResult` holds the findings, the replicas' :class:`Convergence`,
the write :class:`Outage` of each fault and what each persistent-session
consumer got (:class:`ConsumerStats`); it says whether the run passed, sums up
the availability per nemesis, and gives the JSON of the report.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

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
class FollowerStats:
    """What one push subscriber was sent, against what it had to be sent (every acknowledged message once)."""

    name: str
    any_replica: bool
    sent: int
    distinct: int
    duplicates: int
    expected: int
    missing: int
    restarts: int
    """Shard parts its subscription moved to another replica."""
    errors: int
    complete: bool

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
    followers: list[FollowerStats] = field(default_factory=list)
    follower_loss_classes: dict[str, int] = field(default_factory=dict)
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
            "followers": [f.to_json() for f in self.followers],
            "follower_loss_classes": self.follower_loss_classes,
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
