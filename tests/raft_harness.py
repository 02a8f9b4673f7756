"""An in-process Raft cluster: N ``RaftGroup`` replicas of one group, wired together in memory.

Like hashicorp/raft's ``testing.go`` (``MakeCluster``): scripted scenarios
(elections, partitions, leadership transfer, snapshot install) run in seconds,
in one process, against the real ``RaftGroup`` (pysyncobj and every override
of ours, the real ``NodeLog`` journal in a temporary directory, the real
protobuf codec), with only the network replaced.

The seam is the ``Outbox`` protocol (``raft/outbox.py``) that a group is
given in place of the router: ``send(sends)``, ``is_connected``,
``address_of``. On a real node it is ``PeerRouter`` (``raft/transport.py``),
which frames the encoded messages, ships them over gRPC, and on the peer's
side decodes them with ``codec.decode_message`` and calls
``group.deliver(sender, message, echo)``; it reports links going up and down
with ``group.peer_connected`` (``node/hosting.py``). :class:`LoopbackNetwork`
does the same in memory: every encoded message is parsed back from its bytes
(``RaftMessage``, ``codec.decode_message``, so whatever would not survive the
wire does not survive here either) and handed to the target group's inbox on
the sender's thread, in order. Lazy messages (heartbeats that may wait for
company) are delivered at once. No production code is changed or patched.

What it offers:

- :class:`Cluster` (``make_cluster(tmp_path, 3)``): N replicas ``n1..nN`` of
  group 0, each with its own ``NodeLog`` and group directory under the given
  directory, and a :class:`RecordingMachine`. Short timers by default
  (:data:`FAST_TIMING`: heartbeat 50 ms, election timeout 0.3-0.6 s), so a
  brand new cluster elects its first leader in about 1.5 s (new replicas stay
  quiet for two election timeouts, as in production).
- ``partition(*nodes)`` cuts every link between ``nodes`` and the rest (both
  sides are told the link is down, as the router tells them, and messages
  between them are dropped); ``heal()`` restores every link.
- ``stop(node)`` stops a replica and closes its journal (a node going down;
  its machine, like RocksDB, keeps what it applied); ``restart(node)`` opens
  the journal again and starts a new ``RaftGroup`` on it.
- Bounded waits, each raising ``TimeoutError`` with every replica's Raft
  status: ``wait_leader(timeout, among=...)``, ``wait_applied(index,
  timeout, nodes=...)``, ``wait_for(predicate, timeout, what)``.
- ``commit(command, timeout)``: propose on the current leader and wait for
  the result, retrying only while there is no leader or the command was
  certainly not applied (``NO_LEADER``/``NOT_LEADER``); returns the entry's
  log index (what :class:`RecordingMachine` answers).
- ``log_entries(node)``: the ``(index, term, command)`` entries its
  journal holds, to compare logs and not only applied commands.
- ``network.sent`` counts the messages that crossed each way by kind
  (``install_snapshot`` for a snapshot transfer); ``network.dropped`` those a
  partition swallowed.

:class:`RecordingMachine` implements the ``StateMachine`` protocol
(``raft/machine.py``) in memory: it records every applied ``(index,
command)``, skips entries at or below its applied index (so a journal replay
after a restart is idempotent, like a vnode), and its snapshot payload is its
whole history, which ``install`` adopts: a follower brought back by a
snapshot ends with the same history as one that applied every entry.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mqds.protocol.errors import MqdsError, Reason
from mqds.server.raft import codec
from mqds.server.raft.group import Outgoing, RaftGroup, RaftTiming
from mqds.server.raft.journal import NodeLog
from mqds.server.raft.scheduler import RaftScheduler
from mqds.server.raft.v1 import raft_pb2 as rpb

log = logging.getLogger(__name__)

GROUP = 0
"""The group id every replica of a :class:`Cluster` belongs to."""

FAST_TIMING = RaftTiming(heartbeat_s=0.05, election_timeout_min_s=0.3, election_timeout_max_s=0.6)
"""Timers short enough for scenarios of seconds, long enough for a loaded 2-core machine."""

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class RecordingMachine:
    """A ``StateMachine`` in memory that records the commands it applied, with their indexes.

    Thread-safe: the group's thread writes, the test's thread reads copies.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[tuple[int, bytes]] = []
        self._applied_index = 0
        self.installs: list[tuple[int, str]] = []
        """``(index, source)`` of every snapshot installed here."""
        self.snapshots = 0
        """How many times the group asked for a snapshot (its log was compacted)."""

    # -- the StateMachine protocol ---------------------------------------------------

    @property
    def applied_index(self) -> int:
        return self._applied_index

    def apply(self, command: bytes, index: int) -> Any:
        with self._lock:
            if index <= self._applied_index:
                return index  # replayed after a restart: already in effect
            self._entries.append((index, command))
            self._applied_index = index
        return index

    def skip(self, index: int) -> None:
        with self._lock:
            self._applied_index = max(self._applied_index, index)

    def snapshot(self) -> bytes:
        with self._lock:
            self.snapshots += 1
            parts = [_U64.pack(self._applied_index), _U32.pack(len(self._entries))]
            for index, command in self._entries:
                parts += [_U64.pack(index), _U32.pack(len(command)), command]
        return b"".join(parts)

    def install(self, payload: bytes, index: int, source: str, members: list[str]) -> None:
        applied, entries = _decode_history(payload)
        if applied < index:
            raise AssertionError(f"a snapshot at {index} from {source} holds history only up to {applied}")
        with self._lock:
            self._entries = entries
            self._applied_index = applied
            self.installs.append((index, source))

    # -- what tests read -----------------------------------------------------------

    @property
    def entries(self) -> list[tuple[int, bytes]]:
        """Every ``(index, command)`` applied, in order (a copy)."""
        with self._lock:
            return list(self._entries)

    @property
    def commands(self) -> list[bytes]:
        return [command for _, command in self.entries]


def _decode_history(payload: bytes) -> tuple[int, list[tuple[int, bytes]]]:
    (applied,) = _U64.unpack_from(payload, 0)
    (count,) = _U32.unpack_from(payload, 8)
    pos = 12
    entries = []
    for _ in range(count):
        (index,) = _U64.unpack_from(payload, pos)
        (size,) = _U32.unpack_from(payload, pos + 8)
        pos += 12
        entries.append((index, bytes(payload[pos : pos + size])))
        pos += size
    return applied, entries


def _kind(message: rpb.RaftMessage) -> str:
    return message.WhichOneof("kind") or "?"


class LoopbackNetwork:
    """Links between replicas in one process: delivers, drops (partitions), and tells groups of links."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._groups: dict[str, RaftGroup] = {}
        self._cut: set[frozenset[str]] = set()
        self.sent: Counter[str] = Counter()
        """Messages delivered, by kind (``append_entries``, ``install_snapshot``, ``request_vote``, ...)."""
        self.dropped: Counter[str] = Counter()
        """Messages a partition or a stopped replica swallowed, by kind."""

    def outbox(self, node_id: str) -> LoopbackOutbox:
        return LoopbackOutbox(self, node_id)

    def linked(self, a: str, b: str) -> bool:
        with self._lock:
            return a in self._groups and b in self._groups and frozenset((a, b)) not in self._cut

    def attach(self, node_id: str, group: RaftGroup) -> None:
        """A replica comes up: its links to the others go up (unless cut)."""
        with self._lock:
            before = self._links()
            self._groups[node_id] = group
            self._tell(before)

    def detach(self, node_id: str) -> None:
        """A replica goes down: its links go down."""
        with self._lock:
            before = self._links()
            self._groups.pop(node_id, None)
            self._tell(before)

    def cut(self, pairs: Iterable[frozenset[str]]) -> None:
        with self._lock:
            before = self._links()
            self._cut = set(pairs)
            self._tell(before)

    def _links(self) -> set[frozenset[str]]:
        ids = list(self._groups)
        return {frozenset((a, b)) for a in ids for b in ids if a < b and frozenset((a, b)) not in self._cut}

    def _tell(self, before: set[frozenset[str]]) -> None:
        """As ``PeerRouter.link_changed`` does: each end of a link that went up or down hears of it."""
        after = self._links()
        for pair in before ^ after:
            up = pair in after
            a, b = sorted(pair)
            for here, there in ((a, b), (b, a)):
                group = self._groups.get(here)
                if group is not None:
                    group.peer_connected(there, up)

    def send(self, sender: str, group_id: int, messages: list[Outgoing]) -> None:
        """The sender's cycle hands over its messages (its journal synced): parse each back and deliver it."""
        with self._lock:
            for node_id, raw, _lazy in messages:
                parsed = rpb.RaftMessage.FromString(raw)
                kind = _kind(parsed)
                target = self._groups.get(node_id)
                if target is None or sender not in self._groups or frozenset((sender, node_id)) in self._cut:
                    self.dropped[kind] += 1
                    continue
                assert target.group == group_id
                try:
                    message = codec.decode_message(parsed)
                except codec.MalformedMessage:
                    self.dropped[kind] += 1
                    log.exception("%s sent %s a message its decoder refuses", sender, node_id)
                    continue
                self.sent[kind] += 1
                target.deliver(sender, message, parsed.echo, sequence=parsed.sequence)


@dataclass
class LoopbackOutbox:
    """One replica's ``Outbox`` (what ``PeerRouter`` is on a real node)."""

    network: LoopbackNetwork
    node_id: str

    def send(self, sends: list[tuple[int, list[Outgoing]]]) -> None:
        for group, messages in sends:
            self.network.send(self.node_id, group, messages)

    def is_connected(self, node_id: str) -> bool:
        return self.network.linked(self.node_id, node_id)

    def address_of(self, node_id: str) -> str | None:
        return f"loopback:{node_id}"


@dataclass
class Replica:
    """One member: its directories, its machine (which outlives restarts), and its group while running."""

    node_id: str
    directory: Path
    machine: RecordingMachine = field(default_factory=RecordingMachine)
    node_log: NodeLog | None = None
    group: RaftGroup | None = None
    scheduler: RaftScheduler | None = None

    @property
    def running(self) -> bool:
        return self.group is not None


class Cluster:
    """N replicas of one Raft group over a :class:`LoopbackNetwork`; see the module's docstring."""

    def __init__(
        self,
        directory: Path,
        size: int = 3,
        timing: RaftTiming = FAST_TIMING,
        segment_bytes: int | None = None,
    ) -> None:
        self.timing = timing
        self.segment_bytes = segment_bytes
        self.network = LoopbackNetwork()
        self.ids = [f"n{i}" for i in range(1, size + 1)]
        self.replicas = {node_id: Replica(node_id, directory / node_id) for node_id in self.ids}
        for node_id in self.ids:
            self.restart(node_id)

    # -- lifecycle -----------------------------------------------------------------

    def restart(self, node_id: str) -> RaftGroup:
        """Start (or start again) a replica: open its journal, build its group, bring its links up."""
        replica = self.replicas[node_id]
        assert replica.group is None, f"{node_id} is running"
        kwargs = {} if self.segment_bytes is None else {"segment_bytes": self.segment_bytes}
        replica.node_log = NodeLog(str(replica.directory / "wal"), **kwargs)
        replica.scheduler = RaftScheduler()
        group = RaftGroup(
            GROUP,
            node_id,
            self.ids,
            replica.machine,
            str(replica.directory / "group"),
            replica.node_log.journal(GROUP),
            self.network.outbox(node_id),
            self.timing,
            scheduler=replica.scheduler,
        )
        replica.group = group
        self.network.attach(node_id, group)
        group.start()
        return group

    def stop(self, node_id: str) -> None:
        """Take a replica down: its links go down, its scheduler stops, its journal is closed."""
        replica = self.replicas[node_id]
        group, node_log = replica.group, replica.node_log
        assert group is not None and node_log is not None, f"{node_id} is not running"
        self.network.detach(node_id)
        group.stop()
        if replica.scheduler is not None:
            replica.scheduler.stop()
        node_log.close()
        replica.group = replica.node_log = None
        replica.scheduler = None

    def close(self) -> None:
        for node_id in self.ids:
            if self.replicas[node_id].running:
                self.stop(node_id)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the network ---------------------------------------------------------------

    def partition(self, *nodes: str) -> None:
        """Cut ``nodes`` off from the others (links among each side stay up); replaces any earlier partition."""
        side = set(nodes)
        assert side <= set(self.ids), f"unknown nodes {side - set(self.ids)}"
        self.network.cut(frozenset((a, b)) for a in side for b in self.ids if b not in side)

    def heal(self) -> None:
        self.network.cut(())

    # -- reading the replicas --------------------------------------------------------

    def group(self, node_id: str) -> RaftGroup:
        group = self.replicas[node_id].group
        assert group is not None, f"{node_id} is not running"
        return group

    def machine(self, node_id: str) -> RecordingMachine:
        return self.replicas[node_id].machine

    def running(self) -> list[str]:
        return [node_id for node_id in self.ids if self.replicas[node_id].running]

    def log_entries(self, node_id: str) -> list[tuple[int, int, bytes]]:
        """The ``(index, term, command)`` entries a replica's journal holds now (from its first kept one)."""
        return [(index, term, command) for command, index, term in self.group(node_id).journal[:]]

    def leader(self, among: Iterable[str] | None = None) -> str | None:
        """The replica of ``among`` (default: all running) that leads and that a majority of the cluster follows."""
        nodes = [n for n in (self.ids if among is None else among) if self.replicas[n].running]
        leaders = [n for n in nodes if self.group(n).is_leader]
        if not leaders:
            return None
        best = max(leaders, key=lambda n: self.group(n).raft.term)
        term = self.group(best).raft.term
        followers = [n for n in nodes if self.group(n).leader_id == best and self.group(n).raft.term == term]
        return best if len(followers) > len(self.ids) // 2 else None

    def describe(self) -> str:
        """Every replica's Raft state, for failure messages."""
        lines = []
        for node_id in self.ids:
            replica = self.replicas[node_id]
            if replica.group is None:
                lines.append(f"{node_id}: down (applied {replica.machine.applied_index})")
                continue
            s = replica.group.status()
            lines.append(
                f"{node_id}: role {s['role']} term {s['term']} leader {s['leader'] or '-'} "
                f"commit {s['commit_index']} applied {s['applied_index']} last {s['last_log_index']} "
                f"entries {s['log_entries']}"
            )
        lines.append(f"delivered {dict(self.network.sent)}, dropped {dict(self.network.dropped)}")
        return "\n".join(lines)

    # -- bounded waits ---------------------------------------------------------------

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """Poll ``predicate`` until it returns something true (returned); ``TimeoutError`` after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() >= deadline:
                raise TimeoutError(f"not within {timeout:g}s: {what}\n{self.describe()}")
            time.sleep(0.01)

    def wait_leader(self, timeout: float = 5.0, among: Iterable[str] | None = None) -> str:
        """The leader (see ``leader``) once there is one among ``among``."""
        nodes = list(self.ids if among is None else among)
        return str(self.wait_for(lambda: self.leader(nodes), timeout, f"a leader among {nodes}"))

    def wait_applied(self, index: int, timeout: float = 5.0, nodes: Iterable[str] | None = None) -> None:
        """Until every replica of ``nodes`` (default: all running) applied up to ``index``."""
        targets = list(self.running() if nodes is None else nodes)
        self.wait_for(
            lambda: all(self.machine(n).applied_index >= index for n in targets),
            timeout,
            f"{targets} applied up to {index}",
        )

    # -- writing ---------------------------------------------------------------------

    def commit(self, command: bytes, timeout: float = 5.0, among: Iterable[str] | None = None) -> int:
        """Propose ``command`` on the leader (of ``among``) and wait until applied there: its log index.

        Retries only when the command was certainly not applied (no leader,
        not the leader, discarded by a new leader).
        """
        nodes = list(self.ids if among is None else among)
        deadline = time.monotonic() + timeout
        while True:
            leader = self.wait_leader(max(0.0, deadline - time.monotonic()), among=nodes)
            try:
                proposal = self.group(leader).propose(command)
                return int(proposal.wait(max(0.01, deadline - time.monotonic())))
            except MqdsError as err:
                if err.reason not in (Reason.NO_LEADER, Reason.NOT_LEADER) or time.monotonic() >= deadline:
                    raise
            time.sleep(0.01)


def make_cluster(directory: Path, size: int = 3, **kwargs: Any) -> Cluster:
    """``Cluster(directory, size, ...)``: use it as a context manager so it is stopped after the test."""
    return Cluster(directory, size, **kwargs)
