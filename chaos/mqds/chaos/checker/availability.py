"""Availability: per fault, the longest time writes to its affected vnodes, and to the others, got no acknowledgement.

A measurement, not a violation. A fault that paused the workload (the
idle-restart nemeses) is measured from when the workload resumed.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Sequence

from mqds.chaos.checker.result import Outage
from mqds.chaos.history import History

# How long after a fault healed a write outage still counts as the fault's.
SETTLE_S = 10.0


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
