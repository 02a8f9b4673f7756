"""The faults a chaos run injects, and the seeded schedule that picks them.

Each nemesis has ``inject`` (break something; say on whom, and which vnodes it
is expected to stop: those whose leader was hit, or that lost their majority)
and ``heal`` (put it back: restart, resume, reconnect). The runner holds each
fault for a while, heals it, waits until every vnode has a leader again, and
waits a quiet spell before the next one. Faults never overlap, so each write
outage belongs to one fault.

:class:`Schedule` derives everything random from the run's seed: the order of
the nemeses (a new shuffle of all selected ones per cycle, so every nemesis
runs once per cycle), how long each fault is held, the quiet spells, and a
random generator per fault for its choice of targets. The same seed gives the
same schedule; which node is hit also depends on who leads what at that
moment, which the log and the report record.

The idle-restart nemeses do what an operator does to a quiet cluster: they
pause the workload's writers (:class:`~mqds.chaos.workload.WorkloadPause`)
for longer than the nodes' Raft compaction interval, so every group compacts
its log while nothing is written, then restart one node (``idle-restart``)
or every node (``idle-restart-all``), and expect the restarted nodes to be
ready within :data:`IDLE_READY_TIMEOUT_S`. The runner resumes the workload
once the cluster is ready again. Every vnode is reported hit: nothing was
written during the idle spell by design, and the outage is measured from the
resumption (see the checker).
"""

from __future__ import annotations

import random
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc

from mqds.chaos.cluster import ChaosCluster
from mqds.chaos.history import History
from mqds.chaos.workload import WorkloadPause
from mqds.v1 import cluster_pb2 as clpb

# How long a restarted node may take to serve at all (it then catches up in the background).
START_TIMEOUT_S = 60.0
# Membership calls move replicas: bounded, but generously.
ADMIN_TIMEOUT_S = 240.0
# How long a node restarted after an idle spell may take to be ready (every replica it holds has a leader and
# is caught up), counted from its start.
IDLE_READY_TIMEOUT_S = 60.0
# The longest an idle-restart nemesis keeps its nodes down (the idle spell already makes it long).
IDLE_MAX_HOLD_S = 2.0


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
        return sorted(self.cluster.members(), key=_node_order)

    def leaders(self) -> dict[int, str]:
        return self.cluster.leaders()

    def start(self, node_id: str) -> None:
        """Start a stopped node; returns once it serves (catching up is left to the recovery wait)."""
        proc = self.cluster.nodes[node_id]
        if not proc.running:
            proc.start(START_TIMEOUT_S, service="")


def _node_order(node_id: str) -> tuple[int, str]:
    digits = "".join(c for c in node_id if c.isdigit())
    return (int(digits) if digits else 0, node_id)


@dataclass
class Injection:
    targets: list[str]
    detail: str
    affected_shards: list[int]


def led_by(leaders: Mapping[int, str], nodes: set[str]) -> list[int]:
    return sorted(s for s, n in leaders.items() if n in nodes)


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
        victims = sorted(rng.sample(members, count), key=_node_order)
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
        minority, majority = sorted(members[:count], key=_node_order), sorted(members[count:], key=_node_order)
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
        left, right = sorted(rest[:half], key=_node_order), sorted(rest[half:], key=_node_order)
        affected = self._apply(env, _cut_between(left, right))
        return Injection([bridge], f"{left} | {right}, bridged by {bridge}", affected)


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


class Membership(Nemesis):
    name = "membership"
    description = (
        "join a new node and rebalance onto it, then make it leave (replicas move off) and stop it, "
        "all through the admin API while the workload runs"
    )

    def __init__(self) -> None:
        self.joined = 0

    def inject(self, env: Env, rng: random.Random) -> Injection:
        cluster = env.cluster
        taken = {*cluster.nodes, *env.members()}
        number = max(_node_order(n)[0] for n in taken) + 1
        node_id = f"n{number}"
        proc = cluster.add_node(node_id, timeout_s=START_TIMEOUT_S)
        cluster.admin("JoinNode", clpb.JoinNodeRequest(node_id=node_id, address=proc.address), ADMIN_TIMEOUT_S)
        joined = cluster.admin("Rebalance", clpb.RebalanceRequest(), ADMIN_TIMEOUT_S)
        env.log(f"membership: {node_id} joined, {len(joined.moves)} replica moves onto it")
        left = cluster.admin("LeaveNode", clpb.LeaveNodeRequest(node_id=node_id), ADMIN_TIMEOUT_S)
        proc.stop(timeout_s=20)
        cluster.nodes.pop(node_id)
        self.joined += 1
        return Injection(
            [node_id],
            f"{node_id} joined ({len(joined.moves)} replicas moved onto it) and left ({len(left.moves)} moved off)",
            [],
        )


class _IdleRestart(Nemesis):
    """Pause the workload for an idle spell, then restart nodes; heal waits until they are ready."""

    def __init__(self) -> None:
        self.victims: list[str] = []
        self.started_at = 0.0

    def max_hold_s(self) -> float:
        return IDLE_MAX_HOLD_S

    def _idle(self, env: Env) -> str:
        """Pause the workload's writers and wait out the idle spell; what happened, for the detail."""
        if env.workload is None:
            raise RuntimeError("the runner gave no workload to pause")
        busy = env.workload.pause(env.pause_timeout_s)
        still = f"; still in flight after {env.pause_timeout_s:g}s: {', '.join(busy)}" if busy else ""
        # Every vnode changes leader once, so the last entry of each log is an
        # election's no-op when the groups compact during the idle spell: the
        # state in which restarts used to ask for snapshots no replica could serve.
        moved = sum(env.cluster.hand_over_leadership(shard, leader) for shard, leader in sorted(env.leaders().items()))
        env.log(
            f"workload paused{still}; leadership of {moved} vnode(s) handed over; idle for {env.idle_s:g}s "
            f"(compaction interval {env.compaction_interval_s:g}s)"
        )
        time.sleep(env.idle_s)
        return f"{moved} leader(s) moved, idle {env.idle_s:g}s (compaction every {env.compaction_interval_s:g}s){still}"

    @staticmethod
    def _running_members(env: Env) -> list[str]:
        return [n for n in env.members() if n in env.cluster.nodes and env.cluster.nodes[n].running]

    def _wait_ready(self, env: Env, nodes: list[str]) -> list[str]:
        """Until each of ``nodes`` says it is ready, IDLE_READY_TIMEOUT_S from their start at most."""
        deadline = self.started_at + IDLE_READY_TIMEOUT_S
        pending = set(nodes)
        took: dict[str, float] = {}
        while pending:
            for node_id in sorted(pending):
                try:
                    ready = env.cluster.status(node_id, timeout_s=2).ready
                except grpc.RpcError:
                    ready = False
                if ready:
                    pending.discard(node_id)
                    took[node_id] = time.monotonic() - self.started_at
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        if pending:
            tails = "; ".join(
                f"{n} log: ...{env.cluster.nodes[n].output()[-1200:]!r}" for n in sorted(pending, key=_node_order)
            )
            raise NotRecovered(
                f"{', '.join(sorted(pending, key=_node_order))} not ready {IDLE_READY_TIMEOUT_S:g}s after the "
                f"restart after an idle spell; {tails}"
            )
        return [f"{n} ready {took[n]:.1f}s after its start" for n in sorted(took, key=_node_order)]

    def _start(self, env: Env) -> None:
        """Start every victim at once, then wait until each serves."""
        self.started_at = time.monotonic()
        procs = [env.cluster.nodes[n] for n in self.victims if not env.cluster.nodes[n].running]
        for proc in procs:
            proc.launch()
        for proc in procs:
            proc.wait(START_TIMEOUT_S, service="")

    def heal(self, env: Env) -> list[str]:
        if not self.victims:
            return []
        self._start(env)
        return self._wait_ready(env, self.victims)


class IdleRestart(_IdleRestart):
    name = "idle-restart"
    description = (
        "pause the workload's writers past the Raft compaction interval, then kill -9 a random node; "
        "restart it on heal: it must be ready within 60 s"
    )

    def inject(self, env: Env, rng: random.Random) -> Injection:
        idle = self._idle(env)
        victim = rng.choice(self._running_members(env))
        env.cluster.kill(victim)
        self.victims = [victim]
        return Injection([victim], f"{idle}, then kill -9", list(range(env.cluster.n_shards)))


class IdleRestartAll(_IdleRestart):
    name = "idle-restart-all"
    description = (
        "pause the workload's writers past the Raft compaction interval, then stop every node (SIGTERM or "
        "kill -9, at random); start them all on heal: each must be ready within 60 s"
    )

    def inject(self, env: Env, rng: random.Random) -> Injection:
        idle = self._idle(env)
        victims = self._running_members(env)
        # SIGTERM is an operator's stop (shutdown code runs, leaders hand over), kill -9 a power cut (nothing
        # runs): both must come back, so the fault's seeded rng picks one each time.
        graceful = rng.random() < 0.5
        self.victims = victims
        notes = []
        if graceful:
            procs = [env.cluster.nodes[n] for n in victims]
            for proc in procs:
                proc.terminate()
            for node_id, proc in zip(victims, procs, strict=True):
                try:
                    proc.stop(timeout_s=20)
                except subprocess.TimeoutExpired:
                    notes.append(f"{node_id} still ran 20 s after SIGTERM: killed")
        else:
            for node_id in victims:
                env.cluster.kill(node_id)
        how = "SIGTERM to all" if graceful else "kill -9 all"
        detail = f"{idle}, then {how}" + (f" ({'; '.join(notes)})" if notes else "")
        return Injection(victims, detail, list(range(env.cluster.n_shards)))


NEMESES: dict[str, type[Nemesis]] = {
    cls.name: cls
    for cls in (
        KillLeader,
        KillNode,
        PauseLeader,
        KillMinority,
        WipeNode,
        Partition,
        Bridge,
        ClockSkew,
        Membership,
        IdleRestart,
        IdleRestartAll,
    )
}


@dataclass
class Planned:
    """One fault of the schedule."""

    index: int
    nemesis: str
    hold_s: float
    quiet_s: float
    rng: random.Random


class Schedule:
    """The seeded sequence of faults: every selected nemesis once per cycle, in a shuffled order."""

    def __init__(
        self,
        names: list[str],
        seed: int,
        hold_s: tuple[float, float] = (3.0, 8.0),
        quiet_s: tuple[float, float] = (2.0, 5.0),
    ) -> None:
        self.names = list(names)
        self.seed = seed
        self.hold_s = hold_s
        self.quiet_s = quiet_s
        self._rng = random.Random(seed)
        self._cycle: list[str] = []
        self._index = 0

    def __iter__(self) -> Schedule:
        return self

    def __next__(self) -> Planned:
        if not self._cycle:
            self._cycle = list(self.names)
            self._rng.shuffle(self._cycle)
        name = self._cycle.pop(0)
        self._index += 1
        hold = self._rng.uniform(*self.hold_s)
        quiet = self._rng.uniform(*self.quiet_s)
        fault_rng = random.Random(self._rng.getrandbits(64))
        return Planned(self._index, name, round(hold, 2), round(quiet, 2), fault_rng)
