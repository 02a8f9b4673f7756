"""Where vnode replicas live: the initial placement and the moves that keep it even.

A placement maps each shard to an ordered list of node ids: its replicas,
the first being the preferred leader. The rules:

- no two replicas of a vnode on one node;
- every vnode has ``min(replication_factor, active nodes)`` replicas;
- replica counts per node differ by at most one, and so do preferred-leader
  counts;
- only ACTIVE nodes receive replicas; a LEAVING (or removed) node's replicas
  move away.

All functions are pure and deterministic: every node computes the same
result from the same inputs.

>>> initial_placement(["n1", "n2", "n3"], 4, 2)
{0: ['n1', 'n2'], 1: ['n3', 'n1'], 2: ['n2', 'n3'], 3: ['n1', 'n2']}
>>> next_move({0: ["n1", "n2"], 1: ["n1", "n2"]}, ["n1", "n2", "n3"], 2)
Move(shard=0, source='n1', target='n3')
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Placement = dict[int, list[str]]


@dataclass(frozen=True)
class Move:
    """Move one replica of ``shard`` from ``source`` to ``target``.

    ``source`` is empty when a replica is only added (the vnode has fewer
    than its replication factor); ``target`` is empty when one is only
    removed (more than its replication factor).
    """

    shard: int
    source: str
    target: str

    def __str__(self) -> str:
        return f"shard {self.shard}: {self.source or '(new)'} -> {self.target or '(removed)'}"


def initial_placement(nodes: Sequence[str], n_shards: int, replication_factor: int) -> Placement:
    """Deal replicas round the sorted nodes, shard after shard, then spread the preferred leaders."""
    ordered = sorted(nodes)
    if not ordered:
        raise ValueError("no nodes to place replicas on")
    n = len(ordered)
    width = min(replication_factor, n)
    dealt = {s: [ordered[(s * width + k) % n] for k in range(width)] for s in range(n_shards)}
    return balance_leaders(dealt)


def replica_counts(placement: Mapping[int, Sequence[str]], nodes: Sequence[str]) -> Counter[str]:
    counts: Counter[str] = Counter({n: 0 for n in nodes})
    for replicas in placement.values():
        counts.update(replicas)
    return counts


def next_move(placement: Mapping[int, Sequence[str]], active: Sequence[str], replication_factor: int) -> Move | None:
    """The next replica move towards a valid, even placement, or None when there is nothing to do."""
    if not active:
        return None
    active_set = set(active)
    width = min(replication_factor, len(active_set))
    counts = replica_counts(placement, sorted(active_set))

    def least_loaded(exclude: Sequence[str]) -> str | None:
        candidates = sorted((counts[n], n) for n in active_set if n not in exclude)
        return candidates[0][1] if candidates else None

    # 1. Replicas on nodes that are leaving or gone.
    for shard in sorted(placement):
        replicas = list(placement[shard])
        for node in replicas:
            if node not in active_set:
                target = least_loaded(replicas) if len([r for r in replicas if r in active_set]) < width else ""
                return Move(shard, node, target or "")
    # 2. Vnodes with too few or too many replicas.
    for shard in sorted(placement):
        replicas = list(placement[shard])
        if len(replicas) < width:
            target = least_loaded(replicas)
            if target is not None:
                return Move(shard, "", target)
        if len(replicas) > width:
            source = max(replicas, key=lambda n: (counts[n], n))
            return Move(shard, source, "")
    # 3. Even out replica counts.
    while True:
        most = max(sorted(active_set), key=lambda n: counts[n])
        fewest = min(sorted(active_set), key=lambda n: counts[n])
        if counts[most] - counts[fewest] <= 1:
            return None
        for shard in sorted(placement):
            holders = placement[shard]
            if most in holders and fewest not in holders:
                return Move(shard, most, fewest)
        return None


def apply_move(placement: Mapping[int, Sequence[str]], move: Move) -> Placement:
    """The placement after ``move`` (the target takes the source's position)."""
    out = {s: list(r) for s, r in placement.items()}
    replicas = out[move.shard]
    if move.source and move.target:
        replicas[replicas.index(move.source)] = move.target
    elif move.source:
        replicas.remove(move.source)
    elif move.target:
        replicas.append(move.target)
    return out


def balance_leaders(placement: Mapping[int, Sequence[str]]) -> Placement:
    """Reorder replica lists so preferred leaders are spread evenly (no replica moves).

    >>> balance_leaders({0: ["a", "b"], 1: ["a", "b"]})
    {0: ['a', 'b'], 1: ['b', 'a']}
    """
    out = {s: list(r) for s, r in placement.items()}
    nodes = sorted({n for r in out.values() for n in r})
    # First pass: each vnode, in order, is led by its replica that leads the
    # fewest so far (keeping the current order on ties); then local swaps.
    counts: Counter[str] = Counter({n: 0 for n in nodes})
    for shard in sorted(out):
        replicas = out[shard]
        if replicas:
            best = min(range(len(replicas)), key=lambda i: (counts[replicas[i]], i))
            replicas.insert(0, replicas.pop(best))
            counts[replicas[0]] += 1
    leaders = Counter({n: 0 for n in nodes})
    leaders.update(r[0] for r in out.values() if r)
    while _shift_one_leadership(out, leaders):
        pass
    return out


def _shift_one_leadership(out: dict[int, list[str]], leaders: Counter[str]) -> bool:
    """Move one preferred leadership off a most-loaded node, along a chain if need be.

    From a node leading the most vnodes, search (breadth first) through the
    vnodes it leads to their other replicas, the vnodes those lead, and so on,
    for a node leading at least two fewer; hand each vnode on the way to the
    next node of the chain. A single swap is not enough: the least-loaded
    node may not share a vnode with the most-loaded one (5 vnodes on 6 nodes
    once left one node leading two and another none). When no such chain
    exists the largest load is as small as it can be.
    """
    if not leaders:
        return False
    top = max(leaders.values())
    led: dict[str, list[int]] = {}
    for shard in sorted(out):
        if out[shard]:
            led.setdefault(out[shard][0], []).append(shard)
    for start in sorted(n for n in leaders if leaders[n] == top):
        came_from: dict[str, tuple[str, int] | None] = {start: None}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            for shard in led.get(node, []):
                for other in out[shard][1:]:
                    if other in came_from:
                        continue
                    came_from[other] = (node, shard)
                    if leaders[other] <= top - 2:
                        _hand_over(out, came_from, other)
                        leaders[other] += 1
                        leaders[start] -= 1
                        return True
                    queue.append(other)
    return False


def _hand_over(out: dict[int, list[str]], came_from: Mapping[str, tuple[str, int] | None], last: str) -> None:
    """Each vnode on the chain ending at ``last`` gets the next node of the chain as preferred leader."""
    node = last
    step = came_from[node]
    while step is not None:
        previous, shard = step
        replicas = out[shard]
        i = replicas.index(node)
        replicas[0], replicas[i] = replicas[i], replicas[0]
        node = previous
        step = came_from[node]
