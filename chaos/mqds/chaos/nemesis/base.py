"""What every nemesis is: :class:`Nemesis`, the :class:`Env` it works with, the :class:`Injection` it reports.

``inject`` breaks something and says on whom, and which vnodes it is expected
to stop (those whose leader was hit, or that lost their majority:
:func:`led_by`); ``heal`` puts it back (restart, resume, reconnect);
``min_hold_s`` and ``max_hold_s`` bound how long the runner holds the fault.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mqds.chaos.cluster import ChaosCluster
from mqds.chaos.history import History
from mqds.chaos.workload.pause import WorkloadPause

# How long a restarted node may take to serve at all (it then catches up in the background).
START_TIMEOUT_S = 60.0
# Membership calls move replicas: bounded, but generously.
ADMIN_TIMEOUT_S = 240.0


@dataclass
class Env:
    """What a nemesis works with."""

    cluster: ChaosCluster
    history: History
    log: Callable[[str], None]
    generation_interval_s: float
    base_args: dict[str, list[str]] = field(default_factory=dict)
    workload: WorkloadPause | None = None
    """Pauses the workload's writers (the idle-restart nemeses); the runner resumes it after recovery."""
    compaction_interval_s: float = 0.0
    """The nodes' raft_compaction_interval_s."""
    idle_s: float = 0.0
    """How long an idle spell lasts: longer than the compaction interval."""
    pause_timeout_s: float = 15.0
    """How long a pause waits for the calls in flight to finish."""

    def members(self) -> list[str]:
        return sorted(self.cluster.members(), key=node_order)

    def leaders(self) -> dict[int, str]:
        return self.cluster.leaders()

    def start(self, node_id: str) -> None:
        """Start a stopped node; returns once it serves (catching up is left to the recovery wait)."""
        proc = self.cluster.nodes[node_id]
        if not proc.running:
            proc.start(START_TIMEOUT_S, service="")


def node_order(node_id: str) -> tuple[int, str]:
    digits = "".join(c for c in node_id if c.isdigit())
    return (int(digits) if digits else 0, node_id)


@dataclass
class Injection:
    targets: list[str]
    detail: str
    affected_shards: list[int]


def led_by(leaders: Mapping[int, str], nodes: set[str]) -> list[int]:
    return sorted(s for s, n in leaders.items() if n in nodes)


class Nemesis:
    name = ""
    description = ""

    def inject(self, env: Env, rng: random.Random) -> Injection:
        raise NotImplementedError

    def heal(self, env: Env) -> list[str]:
        """Undo the fault; notes for the timeline."""
        return []

    def min_hold_s(self) -> float:
        return 0.0

    def max_hold_s(self) -> float:
        return float("inf")


class NotRecovered(RuntimeError):
    """A restarted node was not ready within its bound (a finding about the cluster, not a harness failure)."""
