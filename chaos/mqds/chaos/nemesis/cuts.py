"""The network faults: a partition of a minority from the majority, and two halves joined by one bridge node.

The cuts go through the cluster's network (namespaces and tc, or the Raft
fault hook); :func:`cut_off` says which vnodes they leave without a majority.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from mqds.chaos.nemesis.base import Env, Injection, Nemesis, node_order


def cut_off(
    blocked: Mapping[str, set[str]], leaders: Mapping[int, str], placement: Mapping[int, list[str]]
) -> list[int]:
    """Vnodes whose leader cannot reach a majority of its replicas (itself included) across the cuts."""
    out = []
    for shard, leader in leaders.items():
        replicas = placement.get(shard, [])
        reachable = [r for r in replicas if r == leader or r not in blocked.get(leader, set())]
        if len(reachable) <= len(replicas) // 2:
            out.append(shard)
    return sorted(out)


class _Cut(Nemesis):
    def __init__(self) -> None:
        self.active = False

    def _apply(self, env: Env, blocked: dict[str, set[str]]) -> list[int]:
        leaders = env.leaders()
        placement = env.cluster.placement()
        env.cluster.network.apply(blocked, env.cluster.live())
        self.active = True
        return cut_off(blocked, leaders, placement)

    def heal(self, env: Env) -> list[str]:
        if self.active:
            env.cluster.network.heal(env.cluster.live())
            self.active = False
        return []


def _cut_between(a: list[str], b: list[str]) -> dict[str, set[str]]:
    blocked: dict[str, set[str]] = {}
    for x in a:
        blocked.setdefault(x, set()).update(b)
    for y in b:
        blocked.setdefault(y, set()).update(a)
    return blocked


class Partition(_Cut):
    name = "partition"
    description = "cut a random minority of the nodes off from the majority; reconnect on heal"

    def inject(self, env: Env, rng: random.Random) -> Injection:
        members = env.members()
        rng.shuffle(members)
        count = max(1, (len(members) - 1) // 2)
        minority, majority = sorted(members[:count], key=node_order), sorted(members[count:], key=node_order)
        affected = self._apply(env, _cut_between(minority, majority))
        return Injection(minority, f"{minority} | {majority}", affected)


class Bridge(_Cut):
    name = "bridge"
    description = "split the nodes in two halves that cannot talk, except through one bridge node that sees both"

    def inject(self, env: Env, rng: random.Random) -> Injection:
        members = env.members()
        rng.shuffle(members)
        bridge, rest = members[0], members[1:]
        half = len(rest) // 2
        left, right = sorted(rest[:half], key=node_order), sorted(rest[half:], key=node_order)
        affected = self._apply(env, _cut_between(left, right))
        return Injection([bridge], f"{left} | {right}, bridged by {bridge}", affected)
