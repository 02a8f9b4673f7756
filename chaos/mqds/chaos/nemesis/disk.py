"""The disk faults, on nodes whose data directory is a fault filesystem (``--disk``; :mod:`mqds.chaos.faultfs`).

- ``power-loss-node``, ``power-loss-minority``, ``power-loss-all``: kill -9
  the nodes, then their disks lose everything not fsynced (a coin toss per
  node, from the fault's seeded rng, also tears each file's last unsynced
  write); heal starts them. Everything acknowledged must survive: each write
  was fsynced on a majority before its acknowledgement, even when every node
  loses power at once.
- ``disk-full``: one node's disk fails writes that need space with ENOSPC;
  the node must stay up, serve reads, let its vnodes' writes fail with a
  retriable status or move to another leader, and go on by itself once the
  space returns (heal). A node that exits is a finding.
- ``disk-error``: EIO on one node's writes and fsyncs (every file, its Raft
  log, or its RocksDB files); a failed fsync's data is gone for good, as on
  Linux. The node may stop, or fence what it could not sync; it must never
  acknowledge a write it could not sync. Heal lifts the errors, then kills
  the node and loses its power: it must come back from what is durable.
- ``disk-slow``: every fsync of one node's disk waits 0.2-1 s; heal lifts it.
"""

from __future__ import annotations

import random
from typing import Any

from mqds.chaos.faultfs import FaultFs
from mqds.chaos.nemesis.base import START_TIMEOUT_S, Env, Injection, Nemesis, led_by, node_order


def disk_of(env: Env, node_id: str) -> FaultFs:
    disk = env.cluster.disks.get(node_id)
    if disk is None:
        raise RuntimeError(f"{node_id} has no fault filesystem: the disk nemeses need --disk posix or journal")
    return disk


def _summary(report: dict[str, Any]) -> str:
    torn = len(report["torn"])
    return (
        f"{report['files_reverted']} file(s) cut back ({report['bytes_reverted']:,} bytes), "
        f"{report['entries_removed']} name(s) undone, {report['entries_restored']} back"
        + (f", {torn} torn" if torn else "")
    )


def lose_power(env: Env, victims: list[str], rng: random.Random) -> str:
    """kill -9 every victim, then lose their disks' unsynced state; what each lost."""
    for node_id in victims:
        env.cluster.kill(node_id)
    notes = []
    for node_id in victims:
        torn = rng.random() < 0.5
        report = disk_of(env, node_id).power_loss(torn=torn, seed=rng.getrandbits(32))
        notes.append(f"{node_id}: {_summary(report)}")
    return "; ".join(notes)


def start_all(env: Env, victims: list[str]) -> None:
    """Start the victims at once; return when each serves (catching up is the recovery wait's)."""
    procs = [env.cluster.nodes[n] for n in victims if not env.cluster.nodes[n].running]
    for proc in procs:
        proc.launch()
    for proc in procs:
        proc.wait(START_TIMEOUT_S, service="")


class _PowerLoss(Nemesis):
    def __init__(self) -> None:
        self.victims: list[str] = []

    def heal(self, env: Env) -> list[str]:
        start_all(env, self.victims)
        return []


class PowerLossNode(_PowerLoss):
    name = "power-loss-node"
    description = "kill -9 a random node and lose its disk's unsynced writes (torn, at random); start it on heal"

    def inject(self, env: Env, rng: random.Random) -> Injection:
        victim = rng.choice(env.members())
        leaders = env.leaders()
        self.victims = [victim]
        return Injection([victim], lose_power(env, self.victims, rng), led_by(leaders, {victim}))


class PowerLossMinority(_PowerLoss):
    name = "power-loss-minority"
    description = "power loss (kill -9, unsynced writes lost) of a random minority of the nodes at once"

    def inject(self, env: Env, rng: random.Random) -> Injection:
        members = env.members()
        victims = sorted(rng.sample(members, max(1, (len(members) - 1) // 2)), key=node_order)
        leaders = env.leaders()
        placement = env.cluster.placement()
        self.victims = victims
        dead = set(victims)
        lost_majority = [s for s, r in placement.items() if sum(1 for n in r if n in dead) > len(r) // 2]
        detail = lose_power(env, victims, rng)
        return Injection(victims, detail, sorted(set(led_by(leaders, dead)) | set(lost_majority)))


class PowerLossAll(_PowerLoss):
    name = "power-loss-all"
    description = "power loss of every node at once: kill -9 all, every disk loses its unsynced writes; start all"

    def inject(self, env: Env, rng: random.Random) -> Injection:
        victims = [n for n in env.members() if n in env.cluster.nodes]
        self.victims = victims
        return Injection(victims, lose_power(env, victims, rng), list(range(env.cluster.n_shards)))


class _OneDisk(Nemesis):
    def __init__(self) -> None:
        self.victim: str | None = None
        self.rng = random.Random(0)
        self._counts: dict[str, int] = {}

    def _pick(self, env: Env, rng: random.Random) -> tuple[str, FaultFs, list[int]]:
        victim = rng.choice(env.members())
        self.victim, self.rng = victim, rng
        disk = disk_of(env, victim)
        self._counts = dict(disk.status()["faults"]["counts"])
        return victim, disk, led_by(env.leaders(), {victim})

    def _lift(self, env: Env) -> dict[str, int]:
        """Lift the disk's faults; what they did since the injection."""
        assert self.victim is not None
        counts = disk_of(env, self.victim).heal()["counts"]
        return {key: value - self._counts.get(key, 0) for key, value in counts.items()}


class DiskFull(_OneDisk):
    name = "disk-full"
    description = (
        "one node's disk fails writes that need space with ENOSPC (0-512 KiB left); the node must stay up and "
        "recover by itself when space returns on heal"
    )

    def inject(self, env: Env, rng: random.Random) -> Injection:
        victim, disk, affected = self._pick(env, rng)
        free = rng.randrange(0, 512 * 1024)
        limit = disk.disk_full(free_bytes=free)
        return Injection([victim], f"disk full: {limit['limit_bytes']:,} bytes, {free:,} left", affected)

    def heal(self, env: Env) -> list[str]:
        if self.victim is None:
            return []
        return [f"{self.victim}: {self._lift(env).get('enospc', 0)} writes or creates answered ENOSPC"]


class DiskError(_OneDisk):
    name = "disk-error"
    description = (
        "EIO on one node's writes and fsyncs (all files, its Raft log or its RocksDB files); on heal the errors "
        "stop, the node is killed and loses power, and must come back from what is durable"
    )

    def inject(self, env: Env, rng: random.Random) -> Injection:
        victim, disk, affected = self._pick(env, rng)
        pattern = rng.choice(("*", "raft/*", "shards/*"))
        disk.fail(pattern, ops=("write", "fsync"))
        return Injection([victim], f"EIO on write and fsync of {pattern}", affected)

    def heal(self, env: Env) -> list[str]:
        if self.victim is None:
            return []
        counts = self._lift(env)
        notes = [f"{counts.get('eio_write', 0)} writes and {counts.get('eio_fsync', 0)} fsyncs failed"]
        if not env.cluster.nodes[self.victim].running:
            notes.append(f"{self.victim} had stopped on the errors")
        notes.append(f"then power loss: {lose_power(env, [self.victim], self.rng)}")
        start_all(env, [self.victim])
        return notes


class DiskSlow(_OneDisk):
    name = "disk-slow"
    description = "every fsync and fdatasync of one node's disk waits 0.2-1 s; lifted on heal"

    def inject(self, env: Env, rng: random.Random) -> Injection:
        victim, disk, affected = self._pick(env, rng)
        delay = round(rng.uniform(0.2, 1.0), 2)
        disk.slow(delay)
        return Injection([victim], f"fsync {delay:g}s late", affected)

    def heal(self, env: Env) -> list[str]:
        if self.victim is None:
            return []
        return [f"{self._lift(env).get('delayed_syncs', 0)} syncs delayed"]
