"""The faults on node processes: kill -9, SIGSTOP, a wiped data directory, a clock shifted by a restart.

kill -9 the leader of a vnode, a random node, or a minority at once; SIGSTOP
a leader; kill a node and delete its data; restart a leader with its clock
shifted. Each heals by restarting or resuming what it hit.
"""

from __future__ import annotations

import random

from mqds.chaos.nemesis.base import START_TIMEOUT_S, Env, Injection, Nemesis, led_by, node_order


def _leader_of_random_shard(env: Env, rng: random.Random) -> tuple[int, str]:
    shard = rng.randrange(env.cluster.n_shards)
    return shard, env.cluster.wait_for_leader(shard, timeout_s=30)


class KillLeader(Nemesis):
    name = "kill-leader"
    description = "kill -9 the leader of a random vnode; restart it on heal"

    def __init__(self) -> None:
        self.victim: str | None = None

    def inject(self, env: Env, rng: random.Random) -> Injection:
        shard, victim = _leader_of_random_shard(env, rng)
        leaders = env.leaders()
        env.cluster.kill(victim)
        self.victim = victim
        return Injection([victim], f"leader of shard {shard}", led_by(leaders, {victim}))

    def heal(self, env: Env) -> list[str]:
        if self.victim:
            env.start(self.victim)
        return []


class KillNode(KillLeader):
    name = "kill-node"
    description = "kill -9 a random node; restart it on heal"

    def inject(self, env: Env, rng: random.Random) -> Injection:
        victim = rng.choice(env.members())
        leaders = env.leaders()
        env.cluster.kill(victim)
        self.victim = victim
        return Injection([victim], "random node", led_by(leaders, {victim}))


class PauseLeader(Nemesis):
    name = "pause-leader"
    description = "SIGSTOP the leader of a random vnode; SIGCONT on heal"

    def __init__(self) -> None:
        self.victim: str | None = None

    def inject(self, env: Env, rng: random.Random) -> Injection:
        shard, victim = _leader_of_random_shard(env, rng)
        leaders = env.leaders()
        env.cluster.pause(victim)
        self.victim = victim
        return Injection([victim], f"leader of shard {shard}", led_by(leaders, {victim}))

    def heal(self, env: Env) -> list[str]:
        if self.victim:
            env.cluster.resume(self.victim)
        return []


class KillMinority(Nemesis):
    name = "kill-minority"
    description = "kill -9 a random minority of the nodes at once; restart them on heal"

    def __init__(self) -> None:
        self.victims: list[str] = []

    def inject(self, env: Env, rng: random.Random) -> Injection:
        members = env.members()
        count = max(1, (len(members) - 1) // 2)
        victims = sorted(rng.sample(members, count), key=node_order)
        leaders = env.leaders()
        placement = env.cluster.placement()
        for victim in victims:
            env.cluster.kill(victim)
        self.victims = victims
        dead = set(victims)
        lost_majority = [s for s, r in placement.items() if sum(1 for n in r if n in dead) > len(r) // 2]
        affected = sorted(set(led_by(leaders, dead)) | set(lost_majority))
        detail = f"{count} of {len(members)} nodes"
        if lost_majority:
            detail += f"; shards {lost_majority} lost their majority until the restart"
        return Injection(victims, detail, affected)

    def heal(self, env: Env) -> list[str]:
        for victim in self.victims:
            env.start(victim)
        return []


class WipeNode(Nemesis):
    name = "wipe-node"
    description = "kill -9 a random node and delete its data directory; restart it empty on heal (snapshot catch-up)"

    def __init__(self) -> None:
        self.victim: str | None = None

    def inject(self, env: Env, rng: random.Random) -> Injection:
        victim = rng.choice(env.members())
        leaders = env.leaders()
        env.cluster.wipe(victim)
        self.victim = victim
        return Injection([victim], "data directory deleted", led_by(leaders, {victim}))

    def heal(self, env: Env) -> list[str]:
        if self.victim:
            env.start(self.victim)
        return []


class ClockSkew(Nemesis):
    name = "clock-skew"
    description = (
        "restart the leader of a random vnode (SIGTERM) with its clock shifted by up to two generation intervals "
        "(fault_clock_offset_s: timestamps and the generation timer); restart it with the real clock on heal"
    )

    def __init__(self) -> None:
        self.victim: str | None = None

    def min_hold_s(self) -> float:
        # Long enough for leadership to come back to it (leader balancing) and a generation to turn.
        return 8.0

    def _restart(self, env: Env, node_id: str, extra: list[str]) -> None:
        proc = env.cluster.nodes[node_id]
        base = env.base_args.setdefault(node_id, list(proc.args))
        proc.stop(timeout_s=20)
        proc.args = [*base, *extra]
        proc.start(START_TIMEOUT_S, service="")

    def inject(self, env: Env, rng: random.Random) -> Injection:
        shard, victim = _leader_of_random_shard(env, rng)
        leaders = env.leaders()
        interval = env.generation_interval_s or 30.0
        offset = round(rng.choice((-1, 1)) * rng.uniform(0.5, 2.0) * interval, 3)
        self.victim = victim
        self._restart(env, victim, [f"--fault-clock-offset-s={offset}"])
        return Injection([victim], f"leader of shard {shard}, clock {offset:+.1f}s", led_by(leaders, {victim}))

    def heal(self, env: Env) -> list[str]:
        if self.victim:
            self._restart(env, self.victim, [])
        return []
