"""One Raft group: a pysyncobj ``SyncObj`` driven by a thread of its own.

A group replicates one state machine (a vnode's storage, or the cluster
metadata). Its contract with pysyncobj, and where it departs from pysyncobj's
defaults (see DESIGN.md for why):

- **One replicated entry point taking bytes.** ``propose(body)`` logs
  ``0x00 + body``; applying calls ``machine.apply(body, index)``. Nothing in
  the log is pickled: membership changes are ``0x02 + MembershipChange``
  protobuf, decoded here instead of by pysyncobj's unpickler (the two
  name-mangled methods below replace pysyncobj's).
- **Durable before anything leaves.** The group thread runs cycles: deliver
  the messages that arrived, tick pysyncobj, then ``journal.sync()``
  (fdatasync of new entries, term, vote) and only then hand the messages
  pysyncobj produced to the network. A follower's acknowledgement and a vote
  are never sent for something that is not on disk.
- **Woken, not polled.** A message, a proposal or a read wakes the thread at
  once; the timeout only serves Raft's timers.
- **Snapshots are the machine's.** pysyncobj's "dump file" is a small manifest
  (last two entries, members, the machine's payload) written by
  ``machine.snapshot()``; a follower that receives one calls
  ``machine.install()``, which for a vnode fetches a RocksDB checkpoint.
- **Linearizable reads** use a read index: ``read_barrier()`` on the leader
  waits until a majority answered a heartbeat sent after the read arrived (the
  transport echoes round numbers) and the state machine applied everything
  committed before it.
"""

from __future__ import annotations

import collections
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import pysyncobj.journal
import pysyncobj.syncobj
from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf
from pysyncobj.monotonic import monotonic as raft_clock
from pysyncobj.node import Node
from pysyncobj.transport import Transport

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.server.raft import codec
from mqds.server.raft.journal import RaftJournal, write_atomically

log = logging.getLogger(__name__)

META_GROUP = 0xFFFFFFFF

_original_create_journal = pysyncobj.syncobj.createJournal


def _create_journal(journal_file: Any) -> Any:
    """Let a SyncObjConf carry a ready journal object in ``journalFile``."""
    if isinstance(journal_file, pysyncobj.journal.Journal):
        return journal_file
    return _original_create_journal(journal_file)


pysyncobj.syncobj.createJournal = _create_journal

ROLE_FOLLOWER, ROLE_CANDIDATE, ROLE_LEADER = 0, 1, 2
ROLE_NAMES = {ROLE_FOLLOWER: "follower", ROLE_CANDIDATE: "candidate", ROLE_LEADER: "leader"}


def group_name(group: int) -> str:
    return "meta" if group == META_GROUP else f"shard {group}"


class PeerNode(Node):
    """A Raft member, known by its node id; its address lives in the router's address book."""

    def __init__(self, node_id: str) -> None:
        super().__init__(node_id)


class StateMachine(Protocol):
    """What a group replicates. Apply must be deterministic: same entries, same state, on every replica."""

    @property
    def applied_index(self) -> int:
        """The last log index whose effect is in the machine's storage (0 if none)."""

    def apply(self, command: bytes, index: int) -> Any:
        """Apply one regular entry; skip it if ``index <= applied_index``. The result goes to the proposer.

        Must be total: a command that cannot be applied is answered with an
        ``MqdsError`` as its result, the same on every replica. Only a failure
        of this replica's environment (``STORAGE_ERROR``, ``OSError``,
        ``MemoryError``) may be raised: the group then retries the entry,
        and readiness reports the stall. Anything else raised is taken as the
        entry's deterministic failure (see ``RaftGroup._apply_regular``).
        """

    def skip(self, index: int) -> None:
        """Record entry ``index`` as applied though it changed nothing here.

        An election's no-op, a membership change, or a command whose apply
        failed: the machine's applied index must still reach it, or a restart
        compares a lower applied index with a snapshot manifest taken at the
        entry and asks for a snapshot that no replica can serve.
        """

    def snapshot(self) -> bytes:
        """Make everything applied durable and return the manifest payload describing it."""

    def install(self, payload: bytes, index: int, source: str, members: list[str]) -> None:
        """Replace the state with one that includes log index ``index`` (from ``source``'s manifest).

        Blocks until done; called on the group's thread, only when
        ``applied_index < index``. Must not return before the state is installed.
        """


@dataclass
class PendingRead:
    """A linearizable read waiting for its read index; ``wait`` returns once it may be served."""

    group: int
    done: threading.Event = field(default_factory=threading.Event)
    round: int = 0
    term: int = 0
    read_index: int = 0
    error: errors.MqdsError | None = None

    def wait(self, timeout_s: float) -> None:
        if not self.done.wait(timeout_s):
            raise errors.error(
                Reason.DEADLINE_EXCEEDED, f"{group_name(self.group)}: could not confirm leadership in time"
            )
        if self.error is not None:
            raise self.error


@dataclass
class Proposal:
    """A command handed to Raft; ``wait`` returns the machine's result."""

    group: int
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    fail: int | None = None

    def on_result(self, result: Any, fail: int) -> None:
        if fail == FAIL_REASON.SUCCESS:
            self.result = result
        else:
            self.fail = fail
        self.done.set()

    def wait(self, timeout_s: float) -> Any:
        if not self.done.wait(timeout_s):
            raise errors.error(
                Reason.DEADLINE_EXCEEDED,
                f"{group_name(self.group)}: not committed within {timeout_s:g}s; it may still be applied",
            )
        if self.fail is not None:
            raise _fail_error(self.group, self.fail)
        if isinstance(self.result, errors.MqdsError):
            raise self.result
        return self.result


def _fail_error(group: int, fail: int) -> errors.MqdsError:
    name = group_name(group)
    if fail == FAIL_REASON.QUEUE_FULL:
        return errors.error(Reason.OVERLOADED, f"{name}: too many commands waiting; retry later")
    if fail in (FAIL_REASON.MISSING_LEADER, FAIL_REASON.NOT_LEADER):
        return errors.error(Reason.NO_LEADER, f"{name}: no leader now (election in progress); retry")
    if fail == FAIL_REASON.DISCARDED:
        return errors.error(Reason.NO_LEADER, f"{name}: leader changed before the command committed; retry")
    if fail == FAIL_REASON.REQUEST_DENIED:
        return errors.error(
            Reason.MEMBERSHIP_CHANGE_IN_PROGRESS, f"{name}: another membership change is not committed yet; retry"
        )
    return errors.error(
        Reason.DEADLINE_EXCEEDED, f"{name}: leader changed while the command was in flight; it may have been applied"
    )


@dataclass(frozen=True)
class RaftTiming:
    """Raft timers, in seconds."""

    heartbeat_s: float = 0.1
    """How often a leader sends append-entries when idle."""
    election_timeout_min_s: float = 0.5
    """A follower that hears nothing for a random time between min and max starts an election."""
    election_timeout_max_s: float = 1.0
    log_max_bytes: int = 16 * 1024 * 1024
    """Compact (snapshot) the journal once its commands exceed this many bytes."""
    compaction_interval_s: float = 600.0
    """Compact at least this often when anything was applied."""
    max_entry_bytes: int = 65 * 1024 * 1024
    """Largest command; pysyncobj would chunk (and pickle) larger ones."""


_MANIFEST_MAGIC = b"MQDSSNP1"
_MANIFEST_ENTRY = struct.Struct("<QQI")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


def encode_manifest(
    group: int,
    source: str,
    last: tuple[bytes, int, int],
    prev: tuple[bytes, int, int],
    members: list[str],
    payload: bytes,
) -> bytes:
    parts = [_MANIFEST_MAGIC, _U32.pack(group)]
    raw = source.encode("utf-8")
    parts += [_U16.pack(len(raw)), raw]
    for cmd, idx, term in (last, prev):
        parts += [_MANIFEST_ENTRY.pack(idx, term, len(cmd)), cmd]
    parts.append(_U16.pack(len(members)))
    for member in members:
        raw = member.encode("utf-8")
        parts += [_U16.pack(len(raw)), raw]
    parts += [_U32.pack(len(payload)), payload]
    body = b"".join(parts)
    return body + _U32.pack(zlib.crc32(body))


@dataclass(frozen=True)
class Manifest:
    group: int
    source: str
    last: tuple[bytes, int, int]
    prev: tuple[bytes, int, int]
    members: list[str]
    payload: bytes


def decode_manifest(raw: bytes) -> Manifest:
    if len(raw) < len(_MANIFEST_MAGIC) + 8 or not raw.startswith(_MANIFEST_MAGIC):
        raise ValueError("not an mqds snapshot manifest")
    body, crc = raw[:-4], _U32.unpack(raw[-4:])[0]
    if zlib.crc32(body) != crc:
        raise ValueError("snapshot manifest checksum mismatch")
    pos = len(_MANIFEST_MAGIC)
    (group,) = _U32.unpack_from(body, pos)
    pos += 4

    def text() -> str:
        nonlocal pos
        (size,) = _U16.unpack_from(body, pos)
        pos += 2
        value = body[pos : pos + size].decode("utf-8")
        pos += size
        return value

    source = text()
    entries = []
    for _ in range(2):
        idx, term, size = _MANIFEST_ENTRY.unpack_from(body, pos)
        pos += _MANIFEST_ENTRY.size
        entries.append((bytes(body[pos : pos + size]), idx, term))
        pos += size
    (count,) = _U16.unpack_from(body, pos)
    pos += 2
    members = [text() for _ in range(count)]
    (size,) = _U32.unpack_from(body, pos)
    pos += 4
    payload = bytes(body[pos : pos + size])
    for cmd, _, _ in entries:
        codec.check_command(cmd)
    return Manifest(group, source, entries[0], entries[1], members, payload)


def carries_entries(message: dict[str, Any]) -> bool:
    """Whether an append-entries carries log entries or a snapshot (not just a heartbeat)."""
    return bool(message.get("entries")) or "serialized" in message or "transmission" in message


class Outgoing(NamedTuple):
    """An encoded message for one peer, once it may leave the node."""

    node_id: str
    raw: bytes
    lazy: bool
    """Nobody waits for it: it may wait a little to share a frame (see ``GroupTransport.send``)."""


class Outbox(Protocol):
    """Where a group's messages go once they may leave the node (the router)."""

    def send(self, group: int, messages: list[Outgoing]) -> None: ...

    def is_connected(self, node_id: str) -> bool: ...

    def address_of(self, node_id: str) -> str | None: ...


class GroupTransport(Transport):
    """pysyncobj's transport for one group: encodes and holds messages until the group's cycle ends."""

    def __init__(self, group: RaftGroup) -> None:
        super().__init__(None, None, None)
        self._group = group
        self.outbox: list[Outgoing] = []
        self.answering_entries = False
        """Set while the group handles an append-entries that carries entries (its answer is never lazy)."""
        # Per peer: the (term, read round) of the last append-entries sent,
        # and the (next index, read round, declines) of the last answer.
        self._last_beat: dict[str, tuple[int, int]] = {}
        self._last_answer: dict[str, tuple[int, int, bool]] = {}

    def send(self, node: Node, message: dict[str, Any]) -> bool:
        """Encode a message for ``node``, and say whether anybody waits for it.

        Lazy (it may wait up to ``raft_heartbeat_linger_s`` in the peer's link
        to share a frame): a leader's heartbeat (no entries, no snapshot) in a
        term and read round it already sent this peer, and a follower's
        answer to a heartbeat that repeats its last answer. A commit waits
        for answers to entries, a read for a new round's echo, an election for
        votes, a new leader for its first heartbeat: those leave at once, and
        take whatever waits for the same peer with them. A lazy heartbeat
        still resets the follower's election timer within the linger, and
        tells it the commit index a little later; nothing else changes.
        """
        group = self._group
        kind = message["type"]
        lazy = False
        if kind == "append_entries":
            echo = group.echo_round
            beat = (message["term"], echo)
            lazy = not carries_entries(message) and self._last_beat.get(node.id) == beat
            self._last_beat[node.id] = beat
        elif kind == "next_node_idx":
            echo = group.last_echo_from.get(node.id, 0)
            if group.declines_leadership:
                message = {**message, "declines_leadership": True}
            answer = (message["next_node_idx"], echo, bool(message.get("declines_leadership")))
            lazy = (
                not self.answering_entries
                and message["success"]
                and not message["reset"]
                and self._last_answer.get(node.id) == answer
            )
            self._last_answer[node.id] = answer
        else:
            echo = 0
        try:
            raw = codec.encode(message, echo)
        except ValueError:
            log.exception("%s: cannot send %s to %s", group.name, kind, node.id)
            return False
        self.outbox.append(Outgoing(node.id, raw, lazy))
        return True

    def addNode(self, node: Node) -> None:
        self._group.on_member_added(node.id)

    def dropNode(self, node: Node) -> None:
        pass


_MESSAGE, _CONNECTED, _DISCONNECTED, _TRANSFER = 0, 1, 2, 3


class RaftGroup(SyncObj):
    """A Raft group replicating ``machine``, with this node as one member."""

    def __init__(
        self,
        group: int,
        node_id: str,
        members: list[str],
        machine: StateMachine,
        directory: str,
        journal: RaftJournal,
        outbox: Outbox,
        timing: RaftTiming | None = None,
        on_role_change: Callable[[RaftGroup, int, int], None] | None = None,
        joining: bool = False,
    ) -> None:
        self.group = group
        self.name = group_name(group)
        self.node_id = node_id
        self.machine = machine
        self.timing = timing or RaftTiming()
        self.directory = directory
        self._outbox = outbox
        self._on_role_change = on_role_change
        self.echo_round = 0
        self.last_echo_from: dict[str, int] = {}
        self._acked_round: dict[str, int] = {}
        self._acks_term = -1
        self._reads_new: list[PendingRead] = []
        self._reads: list[PendingRead] = []
        self._reads_lock = threading.Lock()
        self._inbox: collections.deque[tuple[int, str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._retiring = False
        self.not_ready = False
        """Set by the node while it is not ready: the replica declines leadership transfers."""
        # A leadership transfer in progress (the group's thread only): the
        # target ("" = the most caught-up follower), the caller's callback,
        # and when to give up. New proposals are refused until
        # ``_paused_until`` (any thread reads it).
        self._transfer: tuple[str, Callable[[Any, int], None], float] | None = None
        self._paused_until = 0.0
        # Followers whose latest answer said their node is stopping (group's thread only).
        self._declining: set[str] = set()
        # Counted for the metrics, each written by the group's thread only
        # (so plain ints, exact and free); read by scrapes from any thread.
        self.snapshots_installed = 0
        self.snapshot_install_seconds = 0.0
        self.installing_snapshot = False
        """True while a snapshot is being fetched and installed: the replica cannot serve (readiness)."""
        self.dropped_messages = 0
        self.apply_failures = 0
        """Committed entries whose command could not be applied (recorded as failed on every replica)."""
        self.elections = 0
        """Elections this replica started (it became a candidate)."""
        self.leader_changes = 0
        """New (term, leader) pairs this replica learned of, the first one after it started not counted."""
        self._seen_leader: str | None = None
        self._seen_term = -1
        self._applied_seen = 0
        self._applied_moved_at = raft_clock()
        self._role = ROLE_FOLLOWER
        os.makedirs(directory, exist_ok=True)
        self.journal = journal
        recorded = self.journal.members
        initial = recorded if recorded is not None else sorted(set(members) | {node_id})
        if recorded is None:
            self.journal.set_members(initial)
        self._members_recorded = set(initial)
        # A replica with an empty journal may be new in a group that has a
        # leader (a move, or a node whose disk was wiped): it stays quiet,
        # neither campaigning nor voting, until it hears from a leader. That
        # keeps it from disturbing the group with a higher term, and from
        # voting twice in a term it voted in before the wipe. A replica of a
        # new cluster gives up waiting after two election timeouts.
        self._heard_leader = len(self.journal) > 0
        self._quiet_until = float("inf") if joining else raft_clock() + 2 * self.timing.election_timeout_max_s
        t = self.timing
        conf = SyncObjConf(
            autoTick=False,
            appendEntriesUseBatch=False,
            appendEntriesPeriod=t.heartbeat_s,
            raftMinTimeout=t.election_timeout_min_s,
            raftMaxTimeout=t.election_timeout_max_s,
            leaderFallbackTimeout=t.election_timeout_max_s,
            connectionTimeout=max(3.5, t.election_timeout_max_s),
            commandsWaitLeader=False,
            dynamicMembershipChange=True,
            journalFile=self.journal,
            fullDumpFile=os.path.join(directory, "snapshot"),
            serializer=self._write_manifest,
            deserializer=self._read_manifest,
            logCompactionMinEntries=2**62,
            logCompactionMinTime=t.compaction_interval_s,
            logCompactionBatchSize=1024 * 1024,
            appendEntriesBatchSizeBytes=t.max_entry_bytes,
            onStateChanged=self._state_changed,
        )
        self._transport = GroupTransport(self)
        others = [PeerNode(m) for m in initial if m != node_id]
        super().__init__(PeerNode(node_id), others, conf, nodeClass=PeerNode, transport=self._transport)
        if not others:
            # Alone in the group: nobody else can lead it, so campaign at once.
            self._heard_leader = True
            self._SyncObj__raftElectionDeadline = 0
        self._thread = threading.Thread(target=self._run, name=f"raft-{self.name}", daemon=True)

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the group's thread and close its journal."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        with self._reads_lock:
            for read in self._reads_new + self._reads:
                read.error = errors.error(Reason.SHUTTING_DOWN, f"{self.name}: replica is stopping")
                read.done.set()
            self._reads_new, self._reads = [], []
        self._doDestroy()

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def retiring(self) -> bool:
        return self._retiring

    @property
    def declines_leadership(self) -> bool:
        """Whether this replica refuses leadership handed to it (TimeoutNow), and tells its leader so.

        A stopping node (``retire``), or one that is not ready: a leader
        balancer must never move leadership to a replica that cannot serve
        (a node replaying, fetching a snapshot, or stuck), or stop it taking
        over. Only retiring stops campaigning: a not-ready replica still
        stands in an election, since every replica may be not ready at once.
        """
        return self._retiring or self.not_ready

    def retire(self) -> None:
        """This node is about to stop: from now on it refuses to take leadership.

        It neither campaigns nor accepts a leadership transfer (``timeout_now``),
        but still votes and replicates, so its followers elect one of their own;
        its answers to a leader say so, and that leader hands leadership to others.
        Without this, a follower that was handed leadership gave it straight
        back to the stopping node if that was the vnode's preferred replica
        (the leader balancer), and writes stopped for the whole grace period.
        """
        self._retiring = True
        self._wake.set()

    # -- inputs from other threads ---------------------------------------------

    def deliver(self, node_id: str, message: dict[str, Any], echo: int) -> None:
        """A decoded message from a peer (any thread)."""
        self._inbox.append((_MESSAGE, node_id, (message, echo)))
        self._wake.set()

    def peer_connected(self, node_id: str, connected: bool) -> None:
        self._inbox.append((_CONNECTED if connected else _DISCONNECTED, node_id, None))
        self._wake.set()

    def _check_accepting(self) -> None:
        if not self._isLeader():
            raise self.not_leader_error()
        if raft_clock() < self._paused_until:
            raise errors.error(Reason.NO_LEADER, f"{self.name}: leadership is being handed over; retry")

    def propose(self, body: bytes) -> Proposal:
        """Log a regular command; the returned proposal's ``wait`` gives the result of applying it."""
        proposal = Proposal(self.group)
        self._check_accepting()
        self._applyCommand(body, proposal.on_result, codec.COMMAND_REGULAR)
        self._wake.set()
        return proposal

    def change_membership(self, add: bool, node_id: str) -> Proposal:
        """Add or remove one member (Raft's single-server change)."""
        proposal = Proposal(self.group)
        self._check_accepting()
        kind = codec.rpb.MembershipChange.KIND_ADD if add else codec.rpb.MembershipChange.KIND_REMOVE
        self._applyCommand(codec.encode_membership(kind, node_id), proposal.on_result, codec.COMMAND_MEMBERSHIP)
        self._wake.set()
        return proposal

    def begin_read(self) -> PendingRead:
        """Start a linearizable read; its ``wait`` returns once it may be served here.

        Raises NOT_LEADER or NO_LEADER at once when this replica is not the
        leader; ``wait`` raises them when leadership was lost meanwhile.
        """
        if not self._isLeader():
            raise self.not_leader_error()
        read = PendingRead(self.group)
        with self._reads_lock:
            self._reads_new.append(read)
        self._wake.set()
        return read

    def transfer_leadership(self, node_id: str | None) -> None:
        """Hand leadership to ``node_id`` (None: the most caught-up follower), as Raft's TimeoutNow.

        As in etcd, the leader stops taking proposals at once, waits (up to an
        election timeout) for the target to have its whole log, then tells it
        to campaign. Returns once that message is sent. Taking new writes
        meanwhile made transfers under load fail: the target's log was behind
        when it campaigned, the old leader refused its vote and, its election
        deadline long past, campaigned at once and won again.
        """
        result: list[int] = []
        done = threading.Event()

        def callback(_: Any, fail: int) -> None:
            result.append(fail)
            done.set()

        self._inbox.append((_TRANSFER, node_id or "", callback))
        self._wake.set()
        if not done.wait(5) or result[0] != FAIL_REASON.SUCCESS:
            raise errors.error(
                Reason.NO_LEADER, f"{self.name}: leadership transfer to {node_id or 'a follower'} was refused"
            )

    # -- state -----------------------------------------------------------------

    @property
    def role(self) -> int:
        return self._role

    @property
    def is_leader(self) -> bool:
        return bool(self._isLeader())

    @property
    def leader_id(self) -> str | None:
        leader = self._getLeader()
        return None if leader is None else str(leader.id)

    @property
    def members(self) -> list[str]:
        return sorted([self.node_id, *(n.id for n in self.otherNodes)])

    def not_leader_error(self) -> errors.MqdsError:
        leader = self.leader_id
        if leader is None or leader == self.node_id:
            return errors.error(Reason.NO_LEADER, f"{self.name} has no leader now (election in progress); retry")
        return errors.error(
            Reason.NOT_LEADER,
            f"this node is not the leader of {self.name}; its leader is {leader}",
            leader=leader,
            leader_address=self._outbox.address_of(leader) or "",
            group=str(self.group),
        )

    def status(self) -> dict[str, Any]:
        """The group's Raft state, read from another thread."""
        for _ in range(10):
            try:
                raw = self.getStatus()
                break
            except RuntimeError:  # a dict changed size while pysyncobj's thread updated it
                time.sleep(0.001)
        else:
            raw = self.getStatus()
        last = raw["log_len"] and self._SyncObj__raftLog[-1][1]
        lag = {}
        match = {}
        if self.is_leader:
            for node in self.otherNodes:
                match[node.id] = raw.get(f"match_idx_server_{node.id}", 0)
                lag[node.id] = max(0, last - match[node.id])
        return {
            "role": self._role,
            "term": raw["raft_term"],
            "leader": self.leader_id or "",
            "commit_index": raw["commit_idx"],
            "applied_index": self.machine.applied_index,
            "last_applied": raw["last_applied"],
            "last_log_index": last,
            "log_entries": raw["log_len"],
            "log_bytes": self.journal.size_bytes,
            "members": self.members,
            "follower_lag": lag,
            "match_index": match,
            "leader_commit": raw.get("leader_commit_idx") or 0,
        }

    def catch_up_lag(self) -> int:
        """Entries committed (as far as this replica knows from its leader) that it has not applied yet.

        Cheaper than ``status()``: readiness asks it of every group several times a second.
        """
        known = max(self._SyncObj__leaderCommitIndex or 0, self.raftCommitIndex)
        return max(0, int(known) - int(self.raftLastApplied))

    def _note_apply_progress(self) -> None:
        """After each cycle: remember when the applied index last moved, or had nothing to catch up."""
        applied = int(self.raftLastApplied)
        if applied != self._applied_seen or self.catch_up_lag() == 0:
            self._applied_seen = applied
            self._applied_moved_at = raft_clock()

    def apply_stalled_s(self) -> float:
        """How long committed entries have waited here while none was applied (0 when none waits).

        A group whose apply keeps failing (its disk), or whose thread is stuck,
        reports a growing figure, so readiness can tell it from a replica that
        is merely busy catching up. Accurate to a cycle (at most a second idle).
        """
        if self.catch_up_lag() == 0:
            return 0.0
        return max(0.0, raft_clock() - self._applied_moved_at)

    def match_index(self, node_id: str) -> int:
        return int(self._SyncObj__raftMatchIndex.get(PeerNode(node_id), 0))

    @property
    def last_log_index(self) -> int:
        return int(self._SyncObj__raftLog[-1][1])

    # -- the group's thread -----------------------------------------------------

    def _sleep_s(self) -> float:
        """How long nothing needs doing unless woken: until the next heartbeat or election deadline."""
        now = raft_clock()
        if self._isLeader():
            due = self._SyncObj__newAppendEntriesTime
        else:
            due = self._SyncObj__raftElectionDeadline
            if due <= now and self.otherNodes and not self._SyncObj__connectedNodes:
                # Past the deadline, but pysyncobj campaigns only when some
                # peer is connected, and a link coming up wakes the group. A
                # node alone with its peers down used to wake every group
                # every millisecond here (about half a core).
                return 1.0
        return max(min(due - now, 1.0), 0.001)

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self._sleep_s())
            self._wake.clear()
            if self._stopping:
                break
            try:
                self._cycle()
            except Exception:
                log.exception("%s: Raft cycle failed; retrying", self.name)
                time.sleep(0.5)
            self._note_apply_progress()
        try:
            self.journal.sync()
        except OSError:
            log.exception("%s: final journal sync failed", self.name)

    def _cycle(self) -> None:
        members = self._members_set()
        inbox = self._inbox
        while inbox:
            kind, node_id, payload = inbox.popleft()
            if kind == _MESSAGE:
                message, echo = payload
                if node_id not in members:
                    members = self._members_set()  # a change applied earlier in this cycle?
                if node_id not in members and message["type"] != "append_entries":
                    # A node that is not (or no longer) a member must not
                    # disturb the group with a vote request, or count in an
                    # election or a commit. Append-entries are the exception:
                    # a leader may know of a membership change this replica
                    # has not received yet, and only its entries can tell it.
                    self.dropped_messages += 1
                    continue
                self._receive(node_id, message, echo)
            elif kind == _CONNECTED:
                members = self._members_set()
                if node_id in members:
                    self._transport._onNodeConnected(PeerNode(node_id))
            elif kind == _DISCONNECTED:
                self._transport._onNodeDisconnected(PeerNode(node_id))
            elif kind == _TRANSFER:
                self._begin_transfer(node_id, payload)
        if self._retiring or (not self._heard_leader and raft_clock() < self._quiet_until):
            # Not campaigning: a retiring replica, or a new one that has not heard a leader yet.
            self._SyncObj__raftElectionDeadline = raft_clock() + self.timing.election_timeout_max_s
        self._onTick(0)
        if self._transfer is not None:
            self._advance_transfer()
        leader = self._SyncObj__raftLeader
        if leader is not None and (leader.id != self._seen_leader or self.raftCurrentTerm != self._seen_term):
            if self._seen_leader is not None:
                self.leader_changes += 1
            self._seen_leader, self._seen_term = leader.id, self.raftCurrentTerm
        self._serve_reads()
        if self.journal.size_bytes > self.timing.log_max_bytes:
            self.forceLogCompaction()
        current = set(self.members)
        if current != self._members_recorded:
            self.journal.set_members(sorted(current))
            self._members_recorded = current
        self.journal.sync()
        outbox = self._transport.outbox
        if outbox:
            self._transport.outbox = []
            self._outbox.send(self.group, outbox)
        # Only now, with this cycle's acknowledgements and append-entries on
        # their way, apply what is committed: a follower's answer to the next
        # batch does not wait for the previous one to reach RocksDB.
        if self.raftCommitIndex > self.raftLastApplied:
            SyncObj._SyncObj__applyLogEntries(self)
            self._serve_reads()  # reads that waited for this apply
            if self._transport.outbox or set(self.members) != self._members_recorded:
                self._wake.set()  # the next cycle syncs and sends them
        if self._isLeader() and not self.otherNodes and self.raftCommitIndex < self.last_log_index:
            # Alone in the group: nobody's answer will wake us to commit what
            # was just appended (and synced), so go round again at once.
            self._wake.set()

    def _begin_transfer(self, node_id: str, callback: Callable[[Any, int], None]) -> None:
        if not self._isLeader():
            callback(None, FAIL_REASON.NOT_LEADER)
            return
        if node_id and (node_id not in self._members_set() or node_id in self._declining):
            callback(None, FAIL_REASON.REQUEST_DENIED)
            return
        if self._transfer is not None:
            self._transfer[1](None, FAIL_REASON.REQUEST_DENIED)  # superseded by this one
        deadline = raft_clock() + self.timing.election_timeout_max_s
        self._transfer = (node_id, callback, deadline)
        self._paused_until = deadline

    def _advance_transfer(self) -> None:
        """Send TimeoutNow once the target has the whole log (after this cycle's appends); give up at the deadline."""
        assert self._transfer is not None
        node_id, callback, deadline = self._transfer
        if not self._isLeader():
            fail = FAIL_REASON.NOT_LEADER
        elif (target := node_id or self._transfer_target()) is None:
            fail = FAIL_REASON.REQUEST_DENIED  # nobody to hand over to: no point waiting
        else:
            # pysyncobj answers at once: denied unless the target has the whole log.
            answers: list[int] = []
            self.transferLeadership(target, lambda _, answer: answers.append(answer))
            fail = answers[0]
            if fail == FAIL_REASON.REQUEST_DENIED and raft_clock() < deadline:
                return  # not caught up yet: the next cycle looks again
        self._transfer = None
        if fail != FAIL_REASON.SUCCESS:
            self._paused_until = 0.0
        # Granted: proposals stay refused until the deadline, or until the
        # target's election makes this replica a follower.
        callback(None, fail)

    def _transfer_target(self) -> str | None:
        """The most caught-up connected follower that does not decline leadership."""
        connected = self._SyncObj__connectedNodes
        candidates = [
            (self.match_index(n.id), n.id) for n in self.otherNodes if n in connected and n.id not in self._declining
        ]
        return max(candidates)[1] if candidates else None

    def _members_set(self) -> set[str]:
        return {n.id for n in self.otherNodes}

    def _receive(self, node_id: str, message: dict[str, Any], echo: int) -> None:
        kind = message["type"]
        if kind == "request_vote" and not self._heard_leader and raft_clock() < self._quiet_until:
            return
        if kind == "timeout_now" and self.declines_leadership:
            self.dropped_messages += 1
            return
        if kind == "append_entries":
            self._heard_leader = True
            self.last_echo_from[node_id] = echo
            self._transport.answering_entries = carries_entries(message)
        elif kind == "next_node_idx":
            if echo > self._acked_round.get(node_id, 0):
                self._acked_round[node_id] = echo
            if message.get("declines_leadership"):
                self._declining.add(node_id)
            else:
                self._declining.discard(node_id)
            if message.get("success") and not message.get("reset"):
                self._ack_without_rewind(PeerNode(node_id), message)
                return
        try:
            self._transport._onMessageReceived(PeerNode(node_id), message)
        finally:
            self._transport.answering_entries = False

    def _ack_without_rewind(self, node: PeerNode, message: dict[str, Any]) -> None:
        """Take a follower's acknowledgement without moving its next index back.

        pysyncobj sets a follower's next index to what the follower acknowledged,
        so with several appends in flight (a leader sends new entries as soon as
        they are proposed) every acknowledgement rewound it, the entries in flight
        were sent again, and the follower truncated them from its journal and
        wrote them a second time. The next index only moves back on a refusal
        (``reset``), which a follower sends when an append does not fit its log.
        """
        next_index: dict[PeerNode, int] = self._SyncObj__raftNextIndex
        before = next_index.get(node)
        self._transport._onMessageReceived(node, message)
        if before is not None and next_index.get(node, 0) < before:
            next_index[node] = before

    def _serve_reads(self) -> None:
        with self._reads_lock:
            new, self._reads_new = self._reads_new, []
            if not new and not self._reads:
                return
        term = self.raftCurrentTerm
        if term != self._acks_term:
            self._acked_round = {}
            self._acks_term = term
        if not self.is_leader:
            for read in new + self._reads:
                read.error = self.not_leader_error()
                read.done.set()
            self._reads = []
            return
        if new:
            self.echo_round += 1
            for read in new:
                read.round, read.term, read.read_index = self.echo_round, term, self.raftCommitIndex
            self._reads.extend(new)
            # A heartbeat now, stamped with the new round, instead of waiting
            # for the next period.
            self._SyncObj__sendAppendEntries()
        others = [n.id for n in self.otherNodes]
        noop = self._SyncObj__noopIDx
        ready_commit = noop is not None and self.raftCommitIndex >= noop
        waiting = []
        for read in self._reads:
            if read.term != term:
                read.error = self.not_leader_error()
                read.done.set()
                continue
            acks = 1 + sum(1 for n in others if self._acked_round.get(n, 0) >= read.round)
            if 2 * acks > len(others) + 1 and ready_commit and self.raftLastApplied >= read.read_index:
                read.done.set()
            else:
                waiting.append(read)
        self._reads = waiting

    def _state_changed(self, old: int, new: int) -> None:
        self._role = new
        if new == ROLE_CANDIDATE:
            self.elections += 1
        log.info("%s: %s -> %s (term %d)", self.name, ROLE_NAMES[old], ROLE_NAMES[new], self.raftCurrentTerm)
        if self._on_role_change is not None:
            self._on_role_change(self, old, new)

    def on_member_added(self, node_id: str) -> None:
        """pysyncobj added a member: treat it as connected if the router is."""
        if self._outbox.is_connected(node_id):
            self._inbox.append((_CONNECTED, node_id, None))

    # -- pysyncobj overrides (name-mangled private methods of SyncObj) -----------

    def _SyncObj__applyLogEntries(self) -> bool:
        """pysyncobj's tick would apply committed entries here; ``_cycle`` does after sending.

        Its answer tells a leader whether to send append-entries at once:
        pysyncobj's sends one after every apply, only to announce the new
        commit index. We do not: followers learn it from the next
        append-entries (the next write's, or the next heartbeat, within
        ``heartbeat_s``), which halves the messages per write, and their
        acknowledgements, while no client waits on a follower's apply.
        """
        return False

    def _SyncObj__parseChangeClusterRequest(self, command: bytes) -> tuple[str, str] | None:
        if not command or command[0] != codec.COMMAND_MEMBERSHIP:
            return None
        return codec.decode_membership(command[1:])

    def _SyncObj__doApplyCommand(self, command: bytes) -> Any:
        index = self.raftLastApplied + 1
        kind = command[0]
        if kind == codec.COMMAND_REGULAR:
            return self._apply_regular(command[1:], index)
        if kind == codec.COMMAND_MEMBERSHIP:
            # After a restart the journal is replayed: apply the change again
            # (a no-op when already in effect).
            self._SyncObj__doChangeCluster(codec.decode_membership(command[1:]))
        if index > self.machine.applied_index:
            self.machine.skip(index)
        return None

    def _apply_regular(self, body: bytes, index: int) -> Any:
        """``machine.apply``, made total: a deterministic failure becomes the entry's result.

        Whatever a committed entry holds, every replica must get past it the
        same way. An exception from the command itself (a bug, or input the
        leader's checks let through) would otherwise fail the cycle, and the
        group would retry the same entry forever, on every replica and after
        every restart: the shard dead for good. So it is logged, the entry is
        recorded as applied, and the proposer gets an error. A failure of
        this replica's environment (its disk, its memory) is not the entry's
        fault and is raised: the cycle retries it, and readiness reports a
        group whose applied index stopped behind its commit index.
        """
        try:
            result = self.machine.apply(body, index)
        except errors.MqdsError as err:
            if err.reason is Reason.STORAGE_ERROR:
                raise
            failure: BaseException = err
        except (OSError, MemoryError):
            raise
        except Exception as err:  # any other failure is the entry's own
            failure = err
        else:
            if index > self.machine.applied_index:
                # A refusal the machine answered without writing (a reused
                # sequence number, a generation already dropped): applied all the same.
                self.machine.skip(index)
            return result
        log.error("%s: log entry %d could not be applied; recorded as failed", self.name, index, exc_info=failure)
        self.apply_failures += 1
        if index > self.machine.applied_index:
            self.machine.skip(index)
        if isinstance(failure, errors.MqdsError):
            return failure
        return errors.error(
            Reason.INTERNAL,
            f"{self.name}: log entry {index} could not be applied ({type(failure).__name__}); "
            "every replica recorded it as failed and went on",
        )

    # -- snapshots ---------------------------------------------------------------

    def _write_manifest(self, tmp_file: str, data: tuple[Any, Any, Any]) -> None:
        last, prev, cluster = data
        payload = self.machine.snapshot()
        members = sorted(str(n.id) for n in cluster)
        raw = encode_manifest(self.group, self.node_id, tuple(last), tuple(prev), members, payload)
        write_atomically(tmp_file, raw)
        # pysyncobj renames it into place and then drops the entries it
        # covers: the rename must be on disk before that drop is.
        self.journal.sync_directory_first(self.directory)
        log.debug("%s: snapshot at index %d", self.name, last[1])

    def _read_manifest(self, file_name: str) -> tuple[Any, Any, list[PeerNode]]:
        with open(file_name, "rb") as fh:
            manifest = decode_manifest(fh.read())
        index = manifest.last[1]
        applied = self.machine.applied_index
        if 0 < applied < index and manifest.source == self.node_id:
            # This replica wrote the manifest itself, by compacting entries it
            # had applied, after syncing the machine's storage: the storage
            # holds every effect up to ``index``. What lies between is entries
            # that changed nothing (election no-ops, membership changes), which
            # versions before ``skip`` did not record. Asking for a snapshot
            # here wedged idle shards on restart: every replica had the same
            # gap, so none could serve one.
            log.info("%s: applied %d, manifest at %d written here: nothing to install", self.name, applied, index)
            self.machine.skip(index)
        elif applied < index:
            log.info(
                "%s: installing snapshot at index %d from %s (applied here: %d)",
                self.name,
                index,
                manifest.source,
                self.machine.applied_index,
            )
            started = time.monotonic()
            self.installing_snapshot = True
            try:
                self.machine.install(manifest.payload, index, manifest.source, manifest.members)
            finally:
                self.installing_snapshot = False
            self.snapshots_installed += 1
            self.snapshot_install_seconds += time.monotonic() - started
        # As nodes, not ids: pysyncobj drops this node from the list by comparing
        # with its own Node, and an id never equals a Node. With ids it kept
        # itself as a peer, a phantom member that raised every majority by one,
        # so after a restart or a snapshot a group could not elect a leader with
        # one replica down (found by the chaos runs).
        return manifest.last, manifest.prev, [PeerNode(m) for m in manifest.members]
