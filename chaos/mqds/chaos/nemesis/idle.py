"""The idle-restart nemeses: restart nodes of a cluster that was idle past its Raft compaction interval.

They do what an operator does to a quiet cluster: they pause the workload's
writers (:class:`~mqds.chaos.workload.WorkloadPause`) for longer than the
nodes' Raft compaction interval, so every group compacts its log while
nothing is written, then restart one node (``idle-restart``) or every node
(``idle-restart-all``), and expect the restarted nodes to be ready within
:data:`IDLE_READY_TIMEOUT_S`. The runner resumes the workload once the
cluster is ready again. Every vnode is reported hit: nothing was written
during the idle spell by design, and the outage is measured from the
resumption (see the checker).
"""

from __future__ import annotations

import random
import subprocess
import time

import grpc

from mqds.chaos.nemesis.base import START_TIMEOUT_S, Env, Injection, Nemesis, NotRecovered, node_order

# How long a node restarted after an idle spell may take to be ready (every replica it holds has a leader and
# is caught up), counted from its start.
IDLE_READY_TIMEOUT_S = 60.0
# The longest an idle-restart nemesis keeps its nodes down (the idle spell already makes it long).
IDLE_MAX_HOLD_S = 2.0


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
                f"{n} log: ...{env.cluster.nodes[n].output()[-1200:]!r}" for n in sorted(pending, key=node_order)
            )
            raise NotRecovered(
                f"{', '.join(sorted(pending, key=node_order))} not ready {IDLE_READY_TIMEOUT_S:g}s after the "
                f"restart after an idle spell; {tails}"
            )
        return [f"{n} ready {took[n]:.1f}s after its start" for n in sorted(took, key=node_order)]

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
