"""Deterministic simulation of the Raft layer: many groups on several nodes, one thread, clock and network from a seed.

The FoundationDB / etcd ``rafttest`` way: the real ``RaftGroup`` (pysyncobj
and every override of ours), the real ``NodeLog`` of each node (files in a
temporary directory) and the real codec, stepped by hand on a simulated
clock over a simulated network, so a run is a function of its seed. A
failing seed replays the same schedule exactly.

What is simulated:

- **The clock.** :class:`SimClock` is installed for the process with
  ``raft.clock.use`` (pysyncobj's ``monotonicTime``, mqds's ``raft_clock``
  and every scheduler read it). Time moves only when the loop advances it:
  to the next message delivery or group timer, plus :data:`PASS_S` for each
  step that ran cycles.
- **Randomness.** The seed drives a ``random.Random`` of the network, and
  seeds the global ``random`` that pysyncobj draws election timeouts from
  (restored when the simulation closes). No other thread runs meanwhile:
  every node's ``RaftScheduler`` is created but never started, and the
  log's reaper thread is never needed (segments far larger than a run writes).
- **The network.** :class:`SimNetwork` is every group's ``Outbox``
  (``raft/outbox.py``, as ``tests/raft_harness.py``'s loopback): each
  message is parsed back from its bytes with the real codec, delayed by a
  seeded latency, dropped with a seeded probability, kept in order per link
  unless reordering is asked for, and dropped if the link is cut
  (``partition``) or either node is down. Links going up and down reach the
  groups through ``peer_connected``, as the router reports them.

The loop (:meth:`Simulation.step`): advance the clock to the earliest due
event; deliver every message due (``group.deliver(..., wake=True)``, which
notifies the node's scheduler); then, node by node in a fixed order, take
every group with work (``RaftScheduler.take_ready``) and run it as the
scheduler's workers would: one ``cycles.run_pass`` for the ordinary groups
(one log write for all of them), and one pass of its own on the long lane
for each group whose ``long_step_due()`` (the metadata-like group, a
snapshot transfer, a log due for compaction).

Every send, delivery, drop and pass is an event of the **trace**; its
SHA-256 (with every replica's final log and applied history) is what two
runs of one seed must share (``Simulation.fingerprint``). Raft's safety
properties are checked as it runs: at most one leader per group and term
(every role change is seen), and every replica applying the same command at
each index (:class:`Witness`); ``check_logs`` compares the committed
prefixes of every replica's journal.

Replaying a seed: ``MQDS_SIM_SEED=<seed> pytest tests/server/raft/test_raft_sim.py``
runs every scenario (and the property test) with that seed only;
``MQDS_SIM_SEEDS=<n>`` runs the property test over ``n`` seeds.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import os
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from raft_harness import RecordingMachine

from mqds.protocol.errors import MqdsError, Reason
from mqds.server.raft import clock as raft_clock_module
from mqds.server.raft import codec, cycles
from mqds.server.raft import group as group_module
from mqds.server.raft.futures import Proposal
from mqds.server.raft.group import META_GROUP, ROLE_LEADER, Outgoing, RaftGroup, RaftTiming
from mqds.server.raft.journal import NodeLog
from mqds.server.raft.scheduler import RaftScheduler
from mqds.server.raft.v1 import raft_pb2 as rpb

SIM_TIMING = RaftTiming(heartbeat_s=0.05, election_timeout_min_s=0.3, election_timeout_max_s=0.6)
"""The harness's timers (heartbeat 50 ms, elections 0.3-0.6 s), in simulated seconds."""

START_S = 1000.0
"""The simulated clock's reading when a simulation starts."""
PASS_S = 0.0002
"""Simulated time a step that ran cycles takes (so a group that keeps waking itself cannot stop the clock)."""
SEGMENT_BYTES = 1 << 30
"""Log segments larger than any run writes: no roll-over, so the log's reaper thread never starts."""


def replay_hint(seed: int) -> str:
    """The command that replays ``seed`` in the test running now (pytest names it), with its reordering if any."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "tests/server/raft/test_raft_sim.py").split(" ")[0]
    reorder = os.environ.get("MQDS_SIM_REORDER")
    prefix = f"MQDS_SIM_REORDER={reorder} " if reorder else ""
    return f"replay: {prefix}MQDS_SIM_SEED={seed} pytest '{test}'"


class SimClock:
    """Simulated seconds; only the simulation's loop moves them."""

    def __init__(self, start: float = START_S) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class SimFailure(AssertionError):
    """A property or a bounded wait failed; the message names the seed and how to replay it."""


class Witness:
    """The safety properties, checked as the simulation runs, across every replica of every group."""

    def __init__(self) -> None:
        self.leaders: dict[tuple[int, int], str] = {}
        """``(group, term)``: the replica that became leader in it."""
        self.applied: dict[tuple[int, int], bytes] = {}
        """``(group, index)``: what the first replica to apply it applied."""
        self.violations: list[str] = []

    def became_leader(self, group: int, term: int, node_id: str) -> None:
        other = self.leaders.setdefault((group, term), node_id)
        if other != node_id:
            self.violations.append(f"group {group}: two leaders in term {term}: {other} and {node_id}")

    def applied_at(self, group: int, index: int, command: bytes, node_id: str) -> None:
        first = self.applied.setdefault((group, index), command)
        if first != command:
            self.violations.append(f"group {group}: {node_id} applied {command!r} at {index}, another {first!r}")


class SimMachine(RecordingMachine):
    """A ``RecordingMachine`` that reports each apply to the :class:`Witness`; ``batches``: like a vnode's."""

    def __init__(self, witness: Witness, group: int, node_id: str) -> None:
        super().__init__()
        self._witness = witness
        self._group = group
        self._node_id = node_id

    def apply(self, command: bytes, index: int) -> Any:
        if index > self._applied_index:
            self._witness.applied_at(self._group, index, bytes(command), self._node_id)
        return super().apply(command, index)


class SimBatchingMachine(SimMachine):
    """Takes group-committed batches (``apply_batch``), so its group's cycles run in passes, as a vnode's do."""

    def apply_batch(self, bodies: list[bytes], index: int) -> list[Any]:
        if index > self._applied_index:
            self._witness.applied_at(self._group, index, b"\x00".join(bytes(b) for b in bodies), self._node_id)
            with self._lock:
                self._entries.extend((index, bytes(body)) for body in bodies)
                self._applied_index = index
        return [index for _ in bodies]


def _kind(message: rpb.RaftMessage) -> str:
    return message.WhichOneof("kind") or "?"


class SimNetwork:
    """Every node's ``Outbox``: seeded latency, drops and reordering; partitions; nodes up and down."""

    def __init__(
        self,
        sim: Simulation,
        rng: random.Random,
        latency: tuple[float, float],
        drop: float,
        reorder: float,
    ) -> None:
        self._sim = sim
        self._rng = rng
        self.latency = latency
        self.drop = drop
        """The chance that a message is lost."""
        self.reorder = reorder
        """The chance that a message may overtake those sent before it on its link (else links are FIFO)."""
        self._queue: list[tuple[float, int, str, str, int, bytes]] = []
        self._seq = itertools.count()
        self._link_due: dict[tuple[str, str], float] = {}
        self.cut: set[frozenset[str]] = set()
        self.sent: Counter[str] = Counter()
        """Messages delivered, by kind."""
        self.dropped: Counter[str] = Counter()
        """Messages lost (by chance, a cut link, a node down, no such group there), by kind."""

    def linked(self, a: str, b: str) -> bool:
        nodes = self._sim.nodes
        return a != b and nodes[a].up and nodes[b].up and frozenset((a, b)) not in self.cut

    def next_due(self) -> float | None:
        return self._queue[0][0] if self._queue else None

    def send(self, sender: str, group_id: int, messages: list[Outgoing]) -> None:
        now = self._sim.clock.now
        # By target, each target's in the order sent: what is drawn for a message does not depend on
        # the order pysyncobj iterates its set of peers in.
        for target, raw, _lazy in sorted(messages, key=lambda m: m[0]):
            kind = _kind(rpb.RaftMessage.FromString(raw))
            self._sim.record("send", sender, target, group_id, kind, hashlib.sha256(raw).hexdigest()[:16])
            if not self.linked(sender, target):
                self.dropped[kind] += 1
                continue
            if self.drop and self._rng.random() < self.drop:
                self.dropped[kind] += 1
                self._sim.record("lost", sender, target, group_id, kind)
                continue
            due = now + self._rng.uniform(*self.latency)
            link = (sender, target)
            if not (self.reorder and self._rng.random() < self.reorder):
                due = max(due, self._link_due.get(link, 0.0))
                self._link_due[link] = due
            heapq.heappush(self._queue, (due, next(self._seq), sender, target, group_id, raw))

    def deliver_due(self, now: float) -> None:
        queue = self._queue
        while queue and queue[0][0] <= now:
            _, _, sender, target, group_id, raw = heapq.heappop(queue)
            parsed = rpb.RaftMessage.FromString(raw)
            kind = _kind(parsed)
            group = self._sim.nodes[target].groups.get(group_id) if self.linked(sender, target) else None
            if group is None:
                self.dropped[kind] += 1
                continue
            message = codec.decode_message(parsed)  # a message the decoder refuses is a bug: let it raise
            self.sent[kind] += 1
            self._sim.record("recv", sender, target, group_id, kind, message.get("term"))
            group.deliver(sender, message, parsed.echo, wake=True, sequence=parsed.sequence)

    def outbox(self, node_id: str) -> SimOutbox:
        return SimOutbox(self, node_id)


class SimOutbox:
    """One node's ``Outbox`` (what ``PeerRouter`` is on a real node)."""

    def __init__(self, network: SimNetwork, node_id: str) -> None:
        self.network = network
        self.node_id = node_id

    def send(self, sends: list[tuple[int, list[Outgoing]]]) -> None:
        for group, messages in sends:
            self.network.send(self.node_id, group, messages)

    def is_connected(self, node_id: str) -> bool:
        return self.network.linked(self.node_id, node_id)

    def address_of(self, node_id: str) -> str | None:
        return f"sim:{node_id}"


class SimNode:
    """A node: its log, its scheduler (never started), its groups; machines outlive restarts."""

    def __init__(self, node_id: str, directory: Path) -> None:
        self.node_id = node_id
        self.directory = directory
        self.up = False
        self.node_log: NodeLog | None = None
        self.scheduler: RaftScheduler | None = None
        self.groups: dict[int, RaftGroup] = {}
        self.machines: dict[int, SimMachine] = {}
        self.members: dict[int, list[str]] = {}
        """The members each group of this node was created with."""


class Simulation:
    """``nodes`` nodes hosting ``groups`` vnode-like groups (plus a metadata-like one), stepped from ``seed``.

    Group ``g`` (1..``groups``) has ``replicas`` members, placed round-robin
    over the nodes; ``META_GROUP`` (without batches, so on the long lane) is
    on the first ``replicas`` nodes when ``meta`` is true. Use it as a
    context manager: the clock and the global ``random`` are the
    simulation's until it closes.
    """

    def __init__(
        self,
        directory: Path,
        seed: int,
        nodes: int = 3,
        groups: int = 8,
        replicas: int = 3,
        meta: bool = True,
        timing: RaftTiming = SIM_TIMING,
        latency: tuple[float, float] = (0.0005, 0.005),
        drop: float = 0.0,
        reorder: float = 0.0,
    ) -> None:
        self.seed = seed
        self.directory = directory
        self.timing = timing
        self.rng = random.Random(seed)
        self.clock = SimClock()
        self.witness = Witness()
        self._hash = hashlib.sha256()
        self.trace: list[tuple[Any, ...]] = []
        """Every event (kept for a failing run's message; the fingerprint covers them all)."""
        self.events = 0
        self.steps = 0
        self.passes = 0
        self.long_steps = 0
        self.ids = [f"n{i}" for i in range(1, nodes + 1)]
        self.nodes = {node_id: SimNode(node_id, directory / node_id) for node_id in self.ids}
        self.network = SimNetwork(self, self.rng, latency, drop, reorder)
        self._threads = set(threading.enumerate())
        self._clock_ctx = raft_clock_module.use(self.clock)
        self._clock_ctx.__enter__()
        self._random_state = random.getstate()
        random.seed(self.rng.getrandbits(64))  # pysyncobj's election timeouts
        self._closed = False
        self.group_ids = list(range(1, groups + 1)) + ([META_GROUP] if meta else [])
        for i, gid in enumerate(self.group_ids):
            members = [self.ids[(i + k) % nodes] for k in range(replicas)] if gid != META_GROUP else self.ids[:replicas]
            for node_id in members:
                self.nodes[node_id].members[gid] = sorted(members)
        try:
            for node_id in self.ids:
                self.start_node(node_id)
        except BaseException:
            self.close()  # the process's clock and random are given back
            raise

    # -- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> Simulation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            for node_id in self.ids:
                if self.nodes[node_id].up:
                    self.stop_node(node_id)
        finally:
            random.setstate(self._random_state)
            self._clock_ctx.__exit__(None, None, None)

    def _new_group(self, node: SimNode, gid: int, members: list[str], joining: bool) -> RaftGroup:
        assert node.node_log is not None and node.scheduler is not None
        machine = node.machines.get(gid)
        if machine is None:
            kind = SimMachine if gid == META_GROUP else SimBatchingMachine
            machine = node.machines[gid] = kind(self.witness, gid, node.node_id)

        def role_changed(group: RaftGroup, old: int, new: int) -> None:
            self.record("role", group.node_id, group.group, new, group.raft.term)
            if new == ROLE_LEADER:
                self.witness.became_leader(group.group, group.raft.term, group.node_id)

        group = RaftGroup(
            gid,
            node.node_id,
            members,
            machine,
            str(node.directory / f"g{gid}"),
            node.node_log.journal(gid),
            self.network.outbox(node.node_id),
            self.timing,
            on_role_change=role_changed,
            joining=joining,
            scheduler=node.scheduler,
        )
        node.groups[gid] = group
        return group

    def start_node(self, node_id: str) -> None:
        """Start (or start again) a node: open its log, build its groups, bring its links up, attach them."""
        node = self.nodes[node_id]
        assert not node.up, f"{node_id} is up"
        node.node_log = NodeLog(str(node.directory / "wal"), segment_bytes=SEGMENT_BYTES)
        node.scheduler = RaftScheduler(clock=self.clock)
        for gid in sorted(node.members):
            self._new_group(node, gid, node.members[gid], joining=False)
        self._links_change(lambda: setattr(node, "up", True))
        for gid in sorted(node.groups):
            node.scheduler.attach(node.groups[gid])
        self.record("start", node_id)

    def stop_node(self, node_id: str) -> None:
        """Take a node down: its links go down, its groups stop, its log is closed (machines keep what they applied)."""
        node = self.nodes[node_id]
        assert node.up and node.node_log is not None, f"{node_id} is down"
        self._links_change(lambda: setattr(node, "up", False))
        for gid in sorted(node.groups):
            node.groups[gid].stop()
        node.node_log.close()
        node.groups = {}
        node.node_log = node.scheduler = None
        self.record("stop", node_id)

    def add_replica(self, node_id: str, gid: int, members: list[str]) -> RaftGroup:
        """A new (joining) replica of ``gid`` on ``node_id``, knowing ``members``; the leader adds it next."""
        node = self.nodes[node_id]
        node.members[gid] = sorted(members)
        group = self._new_group(node, gid, sorted(members), joining=True)
        for other in self.ids:
            if other != node_id and self.network.linked(node_id, other):
                group.peer_connected(other, True)
                peer = self.nodes[other].groups.get(gid)
                if peer is not None:
                    peer.peer_connected(node_id, True)
        assert node.scheduler is not None
        node.scheduler.attach(group)
        self.record("add_replica", node_id, gid)
        return group

    # -- the network -------------------------------------------------------------------

    def _links(self) -> set[frozenset[str]]:
        return {frozenset((a, b)) for a in self.ids for b in self.ids if a < b and self.network.linked(a, b)}

    def _links_change(self, change: Callable[[], None]) -> None:
        """Apply ``change``; each end of every link that went up or down hears of it (as the router tells groups)."""
        before = self._links()
        change()
        after = self._links()
        for pair in sorted(before ^ after, key=sorted):
            up = pair in after
            a, b = sorted(pair)
            for here, there in ((a, b), (b, a)):
                for gid in sorted(self.nodes[here].groups):
                    self.nodes[here].groups[gid].peer_connected(there, up)

    def partition(self, *side: str) -> None:
        """Cut every link between ``side`` and the other nodes (replacing any earlier partition)."""
        cut = {frozenset((a, b)) for a in side for b in self.ids if b not in side}
        self._links_change(lambda: setattr(self.network, "cut", cut))
        self.record("partition", *sorted(side))

    def heal(self) -> None:
        self._links_change(lambda: setattr(self.network, "cut", set()))
        self.record("heal")

    # -- the loop ----------------------------------------------------------------------

    def record(self, *event: Any) -> None:
        entry = (round(self.clock.now - START_S, 7), *event)
        self._hash.update(repr(entry).encode())
        self.events += 1
        self.trace.append(entry)

    def next_due(self) -> float | None:
        dues = [self.network.next_due()]
        for node_id in self.ids:
            node = self.nodes[node_id]
            if node.up and node.scheduler is not None:
                dues.append(node.scheduler.next_due())
        known = [d for d in dues if d is not None]
        return min(known) if known else None

    def step(self, until: float | None = None) -> None:
        """Advance to the next event (not past ``until``), deliver what is due, run every node's ready groups."""
        due = self.next_due()
        target = self.clock.now if due is None else max(due, self.clock.now)
        if until is not None and target > until:
            self.clock.now = until
            return
        self.clock.now = target
        self.steps += 1
        self.network.deliver_due(self.clock.now)
        ran = False
        for node_id in self.ids:
            node = self.nodes[node_id]
            if not node.up or node.scheduler is None:
                continue
            ready = node.scheduler.take_ready()
            if not ready:
                continue
            ran = True
            passing = [g for g in ready if not g.long_step_due()]
            if passing:
                self.record("pass", node_id, tuple(g.group for g in passing))
                self.passes += 1
                cycles.run_pass(passing, False)
            for group in ready:
                if group not in passing:
                    self.record("long", node_id, group.group)
                    self.long_steps += 1
                    cycles.run_pass([group], True)
        if self.witness.violations:
            raise self.failure("Raft safety violated: " + "; ".join(self.witness.violations))
        if ran:
            self.clock.now += PASS_S

    @property
    def elapsed(self) -> float:
        """Simulated seconds since the start."""
        return self.clock.now - START_S

    def run_for(self, seconds: float) -> None:
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.step(until=end)

    def run_until(self, predicate: Callable[[], Any], within: float, what: str) -> Any:
        """Step until ``predicate()`` is true (returned); a :class:`SimFailure` after ``within`` simulated seconds."""
        end = self.clock.now + within
        while True:
            value = predicate()
            if value:
                return value
            if self.clock.now >= end:
                raise self.failure(f"not within {within:g} simulated s: {what}")
            self.step(until=end)

    def failure(self, what: str) -> SimFailure:
        recent = "\n".join(repr(e) for e in self.trace[-25:])
        return SimFailure(
            f"seed {self.seed}, at {self.elapsed:.4f} simulated s: {what}\n"
            f"{replay_hint(self.seed)}\n{self.describe()}\nlast events:\n{recent}"
        )

    # -- reading the replicas ----------------------------------------------------------

    def group(self, node_id: str, gid: int) -> RaftGroup:
        return self.nodes[node_id].groups[gid]

    def replicas(self, gid: int) -> list[str]:
        """The nodes running a replica of ``gid``."""
        return [n for n in self.ids if gid in self.nodes[n].groups]

    def leader(self, gid: int, among: Iterable[str] | None = None) -> str | None:
        """The replica of ``gid`` (among ``among``) that leads and that a majority of its members follow."""
        nodes = [n for n in (self.ids if among is None else among) if gid in self.nodes[n].groups]
        leaders = [n for n in nodes if self.group(n, gid).is_leader]
        if not leaders:
            return None
        best = max(leaders, key=lambda n: self.group(n, gid).raft.term)
        lead = self.group(best, gid)
        followers = [
            n for n in nodes if self.group(n, gid).leader_id == best and self.group(n, gid).raft.term == lead.raft.term
        ]
        return best if len(followers) > len(lead.members) // 2 else None

    def all_led(self, gids: Iterable[int] | None = None, among: Iterable[str] | None = None) -> bool:
        return all(self.leader(gid, among) is not None for gid in (self.group_ids if gids is None else gids))

    def describe(self) -> str:
        lines = []
        for gid in self.group_ids:
            parts = []
            for node_id in self.ids:
                node = self.nodes[node_id]
                group = node.groups.get(gid)
                if group is None:
                    if gid in node.members:
                        parts.append(f"{node_id}: down (applied {node.machines[gid].applied_index})")
                    continue
                s = group.status()
                parts.append(
                    f"{node_id}: r{s['role']} t{s['term']} L={s['leader'] or '-'} "
                    f"c{s['commit_index']} a{s['applied_index']} last{s['last_log_index']}"
                )
            lines.append(f"group {gid}: " + ", ".join(parts))
        lines.append(f"delivered {dict(self.network.sent)}, dropped {dict(self.network.dropped)}")
        return "\n".join(lines)

    def log_entries(self, node_id: str, gid: int) -> list[tuple[int, int, bytes]]:
        return [(index, term, bytes(command)) for command, index, term in self.group(node_id, gid).journal[:]]

    def wait_applied(self, gid: int, index: int, nodes: Iterable[str], within: float = 5.0) -> None:
        """Step until every replica of ``gid`` on ``nodes`` applied up to ``index``."""
        machines = [self.nodes[n].machines[gid] for n in nodes]
        self.run_until(
            lambda: all(m.applied_index >= index for m in machines), within, f"group {gid}: {nodes} to apply {index}"
        )

    def wait_compacted(self, node_id: str, gid: int, beyond: int, within: float = 5.0) -> None:
        """Step until ``node_id``'s log of ``gid`` no longer holds entry ``beyond`` (compacted past it)."""
        self.run_until(
            lambda: self.log_entries(node_id, gid)[0][0] > beyond, within, f"{node_id} to compact {gid} past {beyond}"
        )

    def check_logs(self, gids: Iterable[int] | None = None) -> None:
        """Log matching on committed entries: replicas hold the same entry at every index both have committed."""
        for gid in self.group_ids if gids is None else gids:
            seen: dict[int, tuple[int, bytes, str]] = {}
            for node_id in self.replicas(gid):
                commit = self.group(node_id, gid).raft.commit_index
                for index, term, command in self.log_entries(node_id, gid):
                    if index > commit:
                        break
                    other = seen.setdefault(index, (term, command, node_id))
                    if other[:2] != (term, command):
                        raise self.failure(
                            f"group {gid}: committed entry {index} differs: {node_id} has term {term}, "
                            f"{other[2]} term {other[0]}"
                        )

    def check_histories(self, gids: Iterable[int] | None = None, nodes: Iterable[str] | None = None) -> None:
        """Every replica's applied history (of ``nodes``) is a prefix of the longest one."""
        for gid in self.group_ids if gids is None else gids:
            holders = [n for n in (self.ids if nodes is None else nodes) if gid in self.nodes[n].machines]
            histories = {n: self.nodes[n].machines[gid].entries for n in holders}
            longest = max(histories.values(), key=len)
            for node_id, history in histories.items():
                if history != longest[: len(history)]:
                    raise self.failure(f"group {gid}: {node_id} applied a history that is not a prefix of another's")

    def fingerprint(self) -> str:
        """The SHA-256 of the whole trace and of every replica's final log, commit and applied history."""
        digest = self._hash.copy()
        for node_id in self.ids:
            node = self.nodes[node_id]
            for gid in sorted(node.machines):
                digest.update(repr((node_id, gid, node.machines[gid].entries)).encode())
                if gid in node.groups:
                    group = node.groups[gid]
                    state = (group.raft.term, group.raft.commit_index, self.log_entries(node_id, gid))
                    digest.update(repr(state).encode())
        return digest.hexdigest()

    def threads_started(self) -> list[str]:
        """Threads that started during the simulation (there must be none)."""
        return sorted(t.name for t in threading.enumerate() if t not in self._threads)

    # -- writing -----------------------------------------------------------------------

    def propose(self, gid: int, body: bytes, among: Iterable[str] | None = None) -> Proposal | None:
        """Propose ``body`` on ``gid``'s leader now (None: no leader, or it refused)."""
        leader = self.leader(gid, among)
        if leader is None:
            return None
        try:
            return self.group(leader, gid).propose(body)
        except MqdsError as err:
            if err.reason in (Reason.NO_LEADER, Reason.NOT_LEADER):
                return None
            raise

    def commit(self, gid: int, body: bytes, within: float = 5.0, among: Iterable[str] | None = None) -> int:
        """Propose until applied on the leader (retrying only when certainly not applied): the entry's index."""
        end = self.clock.now + within
        while True:
            proposal = self.run_until(
                lambda: self.propose(gid, body, among), end - self.clock.now, f"group {gid}: a leader to take {body!r}"
            )
            done = proposal.done
            self.run_until(done.is_set, end - self.clock.now, f"group {gid}: {body!r} applied")
            failed = proposal.failed()
            if failed is None:
                return int(proposal.result)
            if failed.reason not in (Reason.NO_LEADER, Reason.NOT_LEADER):
                raise failed
            self.step()

    def transfer(self, gid: int, node_id: str, target: str | None) -> list[int]:
        """Ask ``node_id``'s replica of ``gid`` to hand leadership over, without blocking: the result lands in the list.

        ``RaftGroup.transfer_leadership`` waits on its caller's thread for the
        group's cycle to answer, which a single-threaded simulation cannot do;
        this queues the same request through the group's inbox, and the
        pysyncobj ``FAIL_REASON`` arrives once a cycle decides it.
        """
        group = self.group(node_id, gid)
        answers: list[int] = []
        group._inbox.append((group_module._TRANSFER, target or "", lambda _, fail: answers.append(fail)))
        group.wake()
        self.record("transfer", node_id, gid, target)
        return answers
