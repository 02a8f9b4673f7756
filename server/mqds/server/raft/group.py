"""One Raft group: pysyncobj's Raft, held and stepped by the node's scheduler.

A group replicates one state machine (a vnode's storage, or the cluster
metadata). Its contract with pysyncobj, and where it departs from pysyncobj's
defaults (see DESIGN.md for why):

- **One replicated entry point taking bytes.** ``propose(body)`` logs
  ``0x00 + body``; applying calls ``machine.apply(body, index)``. Nothing in
  the log is pickled: membership changes are ``0x02 + MembershipChange``
  protobuf, decoded by us instead of by pysyncobj's unpickler (the group's
  ``CommandApplier``, ``machine.py``, behind the hooks ``RaftCore`` calls).
- **Durable before anything leaves.** The group runs cycles: deliver
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
- **Linearizable reads** use a read index: ``begin_read()`` on the leader
  waits until a majority answered a heartbeat sent after the read arrived (the
  transport echoes round numbers) and the state machine applied everything
  committed before it.

``RaftGroup`` holds its Raft state machine, a ``RaftCore``
(``pysyncobj_adapter.py``, the only code that knows pysyncobj's internals),
and parts with state of their own, one concern per module (DESIGN.md,
"Files"), each given what it needs of the group when it is made; this one
keeps the group's cycle, the inputs from other threads, and the state that
other modules read.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from pysyncobj import FAIL_REASON

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.server.durable import make_dirs
from mqds.server.raft import batching, codec
from mqds.server.raft.futures import PendingRead as PendingRead  # "X as X": moved out, re-exported
from mqds.server.raft.futures import Proposal
from mqds.server.raft.journal import RaftJournal
from mqds.server.raft.machine import CommandApplier, StateMachine
from mqds.server.raft.names import META_GROUP as META_GROUP
from mqds.server.raft.names import PeerNode as PeerNode
from mqds.server.raft.names import group_name
from mqds.server.raft.outbox import GroupTransport, Outbox, carries_entries
from mqds.server.raft.outbox import Outgoing as Outgoing
from mqds.server.raft.pysyncobj_adapter import RaftCore
from mqds.server.raft.reads import ReadIndex
from mqds.server.raft.slot import Slot
from mqds.server.raft.snapshot import Manifest as Manifest
from mqds.server.raft.snapshot import ManifestFiles
from mqds.server.raft.snapshot import decode_manifest as decode_manifest
from mqds.server.raft.snapshot import encode_manifest as encode_manifest
from mqds.server.raft.timing import IDLE_KEEP_BYTES, ElectionTimers, IdleLog, RaftTiming, raft_clock, syncobj_timers
from mqds.server.raft.transfer import LeadershipTransfer

log = logging.getLogger(__name__)


ROLE_FOLLOWER, ROLE_CANDIDATE, ROLE_LEADER = 0, 1, 2
ROLE_NAMES = {ROLE_FOLLOWER: "follower", ROLE_CANDIDATE: "candidate", ROLE_LEADER: "leader"}

_MESSAGE, _CONNECTED, _DISCONNECTED, _TRANSFER = 0, 1, 2, 3


class GroupScheduler(Protocol):
    """What a group asks of the scheduler that steps it (``scheduler.RaftScheduler``, given it by the node)."""

    def start(self) -> None: ...

    def attach(self, group: RaftGroup) -> None: ...

    def detach(self, group: RaftGroup) -> None: ...

    def notify(self, group: RaftGroup) -> None: ...

    def rearm(self, group: RaftGroup, failed: bool = False) -> None: ...


class RaftGroup:
    """A Raft group replicating ``machine``, with this node as one member.

    Its Raft state is ``self.raft``, a ``RaftCore``: the group ticks it,
    hands it what arrived, and is called back to apply entries
    (``apply_entry``, ``parse_membership``: its ``CommandApplier``), to write
    and read snapshots (its ``ManifestFiles``) and when its role changes
    (``_state_changed``). Its other parts: the reads waiting for their read
    index (``ReadIndex``), a leadership transfer in progress
    (``LeadershipTransfer``), and the election timers (``ElectionTimers``).
    """

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
        on_disk_failure: Callable[[BaseException], None] | None = None,
        admit: Callable[[bytes], None] | None = None,
        scheduler: GroupScheduler | None = None,
    ) -> None:
        self.group = group
        self.name = group_name(group)
        self.node_id = node_id
        self.machine = machine
        self.timing = timing or RaftTiming()
        self.directory = directory
        self._outbox = outbox
        self._on_role_change = on_role_change
        self.admit = admit
        """Asked of every regular command before the leader logs it; raises ``MqdsError`` to refuse it (the
        node's admission control, ``diskusage.py``). Every proposal passes here, whoever makes it."""
        self.proposals = (
            batching.ProposalQueue(self.timing.max_entry_bytes) if hasattr(machine, "apply_batch") else None
        )
        """Group commit (``batching.py``): proposals for the next cycle; None if the machine takes no batches."""
        self._inbox: collections.deque[tuple[int, str, Any]] = collections.deque()
        self._scheduler = scheduler
        """Steps this group with the node's others (``scheduler.py``); None: only driven by hand (tests)."""
        self.slot = Slot()
        """The scheduler's bookkeeping for this group."""
        self.cycle_lock = threading.Lock()
        """Held while a cycle runs: by a scheduler's worker, or by a receiving thread (``cycles.run_cycles``)."""
        self._cycle_missed = False
        """A thread found the cycle running elsewhere: whoever ends it hands the group back to the scheduler."""
        self._cycle_thread = 0
        """The thread running a cycle now (0: none)."""
        self._long_lane = False
        """Whether the cycle running now is on the scheduler's long lane (where a snapshot may be installed)."""
        self.snapshot_inbound = False
        """A snapshot's transfer waits in the inbox: the next cycle must run on the long lane."""
        self._stopping = False
        self._retiring = False
        self.not_ready = False
        """Set by the node while it is not ready: the replica declines leadership transfers."""
        # Counted for the metrics, each written by the group's thread only
        # (so plain ints, exact and free); read by scrapes from any thread.
        self.dropped_messages = 0
        self.overtaken_messages = 0
        """Append-entries dropped because a newer one from the same leader came first (``_overtaken``)."""
        self._last_sequence: dict[str, tuple[int, int]] = {}
        """Per leader: the (term, sequence) of the newest append-entries taken from it."""
        self.elections = 0
        """Elections this replica started (it became a candidate)."""
        self.leader_changes = 0
        """New (term, leader) pairs this replica learned of, the first one after it started not counted."""
        self._seen_leader: str | None = None
        self._seen_term = -1
        self._idle_log = IdleLog(self.timing.idle_compaction_s)
        self._compaction_wanted = False
        """``compact_soon`` asked for a compaction that has not run yet."""
        self._role = ROLE_FOLLOWER
        make_dirs(directory)
        self.journal = journal
        recorded = self.journal.members
        initial = recorded if recorded is not None else sorted(set(members) | {node_id})
        if recorded is None:
            self.journal.set_members(initial)
        self._members_recorded = set(initial)
        had_journal = len(self.journal) > 0  # before pysyncobj logs its first no-op
        self._manifests = ManifestFiles(
            group, self.name, node_id, directory, machine, sync_directory_first=journal.sync_directory_first
        )
        """Snapshot manifests: pysyncobj's serializer and deserializer, and the snapshots installed here."""
        self._transport = GroupTransport(self)
        others = [m for m in initial if m != node_id]
        self.raft = RaftCore(
            node_id,
            others,
            self._transport,
            self,
            journal=self.journal,
            dump_file=os.path.join(directory, "snapshot"),
            serializer=self._manifests.write,
            deserializer=self._manifests.read,
            max_entry_bytes=self.timing.max_entry_bytes,
            on_state_changed=self._state_changed,
            timers=syncobj_timers(self.timing),
        )
        """This group's Raft (pysyncobj's, through the adapter): ticked by the cycle, nothing else steps it."""
        # Its parts, each given what it uses of the group (nothing calls them before the first cycle).
        self._applier = CommandApplier(self.name, machine, self.raft, on_disk_failure)
        """Applies committed entries (``RaftCore`` calls the group's ``apply_entry``), and tracks apply progress."""
        self._reads = ReadIndex(group, self.name, self.raft, self.wake, self.not_leader_error)
        """Linearizable reads waiting for their read index, and the heartbeat rounds they wait on."""
        self._transfer = LeadershipTransfer(
            self.name, self.raft, self.timing.election_timeout_max_s, self.not_leader_error
        )
        """A leadership transfer in progress, and the followers that decline leadership."""
        # Alone in the group, nobody else can lead it: it campaigns at once.
        self._timers = ElectionTimers(self.timing, self.raft, heard_leader=had_journal or not others, joining=joining)
        """The group's sleep, and the election deadline of a replica that must not campaign."""
        if not others:
            self.raft.election_deadline = 0

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        """Have the node's scheduler step this group from now on."""
        if self._scheduler is None:
            raise RuntimeError(f"{self.name} has no scheduler to step it")
        self._scheduler.start()
        self._scheduler.attach(self)

    def stop(self) -> None:
        """Stop stepping the group (waiting for a cycle in progress) and sync its journal."""
        self._stopping = True
        if self._scheduler is not None:
            self._scheduler.detach(self)
        ours = self._cycle_thread == threading.get_ident()
        held = ours or self.cycle_lock.acquire(timeout=30)
        try:
            self.journal.sync()
        except OSError:
            log.exception("%s: final journal sync failed", self.name)
        finally:
            if held and not ours:
                self.cycle_lock.release()
        self._reads.fail_stopping()
        if self.proposals is not None:
            self.proposals.fail_all(FAIL_REASON.NOT_LEADER)
        self.raft.destroy()

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
        self.wake()

    # -- inputs from other threads ---------------------------------------------

    def deliver(self, node_id: str, message: dict[str, Any], echo: int, wake: bool = True, sequence: int = 0) -> None:
        """A decoded message from a peer (any thread); ``wake=False``: the caller runs or wakes the cycle.

        ``sequence``: the number its leader gave an append-entries (``RaftMessage.sequence``; 0: none).
        """
        if "serialized" in message:
            self.snapshot_inbound = True  # set before it is queued: no pass may take it (``long_step_due``)
        self._inbox.append((_MESSAGE, node_id, (message, echo, sequence)))
        if wake:
            self.wake()

    def wake(self) -> None:
        """Have the scheduler run a cycle of this group soon (any thread)."""
        if self._scheduler is not None:
            self._scheduler.notify(self)

    def note_cycle(self) -> None:
        """A cycle ended (``cycles.py``): what is noted after each."""
        self._applier.note_progress()

    # -- who runs a cycle (``cycles.py``, ``scheduler.py``) ----------------------

    def try_begin_cycle(self, long_lane: bool) -> bool:
        """Take the cycle for this thread, without waiting; False if another thread runs it (or the group stopped).

        Whoever then ends that cycle hands the group back to the scheduler, so
        the work that brought this thread here is not lost.
        """
        lock = self.cycle_lock
        if not lock.acquire(blocking=False):
            self._cycle_missed = True
            if not lock.acquire(blocking=False):  # released meanwhile? Then the holder may not have seen the mark
                return False
            self._cycle_missed = False
        if self._stopping:
            lock.release()
            return False
        self._cycle_thread = threading.get_ident()
        self._long_lane = long_lane
        if long_lane:
            self.snapshot_inbound = False  # this cycle takes what is queued; a later one sets it again
        return True

    def end_cycle(self, failed: bool = False) -> None:
        """Release the cycle (``try_begin_cycle``); set the group's timer; hand it back if a thread found it busy."""
        self._cycle_thread = 0
        self._long_lane = False
        self.cycle_lock.release()
        scheduler = self._scheduler
        if scheduler is None:
            return
        scheduler.rearm(self, failed)
        if self._cycle_missed or self.snapshot_inbound:
            self._cycle_missed = False
            scheduler.notify(self)

    def long_step_due(self) -> bool:
        """Whether this group's next cycle belongs on the scheduler's long lane, not in a pass (``cycles.py``).

        A pass runs only a vnode's ordinary traffic: the metadata group (no
        proposal queue), a group stopping, a snapshot being installed or
        received, and a log due for compaction go to the long lane.
        """
        return not (
            self.proposals is not None
            and not self.stopping
            and not self.installing_snapshot
            and not self.snapshot_inbound
            and self.journal.size_bytes <= self.timing.log_max_bytes
        )

    def peer_connected(self, node_id: str, connected: bool) -> None:
        self._inbox.append((_CONNECTED if connected else _DISCONNECTED, node_id, None))
        self.wake()

    def propose(self, body: bytes) -> Proposal:
        """Log a regular command (on the leader, if ``admit`` takes it); the returned proposal's ``wait`` gives
        the result of applying it."""
        proposal = Proposal(self.group)
        self._transfer.check_accepting()
        if self.admit is not None:
            self.admit(body)
        if self.proposals is not None:
            self.proposals.add(body, proposal)  # logged by the next cycle, with whatever else came
        else:
            self.raft.append(body, proposal.on_result, codec.COMMAND_REGULAR)
        self.wake()
        return proposal

    def begin_read(self) -> PendingRead:
        """Start a linearizable read (``ReadIndex.begin``); its ``wait`` returns once it may be served here."""
        return self._reads.begin()

    def change_membership(self, add: bool, node_id: str) -> Proposal:
        """Add or remove one member (Raft's single-server change)."""
        proposal = Proposal(self.group)
        self._transfer.check_accepting()
        kind = codec.rpb.MembershipChange.KIND_ADD if add else codec.rpb.MembershipChange.KIND_REMOVE
        self.raft.append(codec.encode_membership(kind, node_id), proposal.on_result, codec.COMMAND_MEMBERSHIP)
        self.wake()
        return proposal

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
        self.wake()
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
        return self.raft.is_leader

    @property
    def leader_id(self) -> str | None:
        return self.raft.leader_id

    @property
    def members(self) -> list[str]:
        return sorted([self.node_id, *(n.id for n in self.raft.peers)])

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
                raw = self.raft.status()
                break
            except RuntimeError:  # a dict changed size while a cycle updated it
                time.sleep(0.001)
        else:
            raw = self.raft.status()
        last = raw["log_len"] and self.raft.last_log_index
        lag = {}
        match = {}
        if self.is_leader:
            for node in self.raft.peers:
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

    def match_index(self, node_id: str) -> int:
        return self.raft.match_index(node_id)

    @property
    def last_log_index(self) -> int:
        return self.raft.last_log_index

    def sleep_s(self) -> float:
        """How long nothing needs doing unless woken (``ElectionTimers.sleep_s``): the scheduler's timer."""
        return self._timers.sleep_s()

    def catch_up_lag(self) -> int:
        """Entries committed that this replica has not applied yet (``CommandApplier.catch_up_lag``)."""
        return self._applier.catch_up_lag()

    def apply_stalled_s(self) -> float:
        """How long committed entries have waited here while none was applied (``CommandApplier``)."""
        return self._applier.apply_stalled_s()

    @property
    def apply_failures(self) -> int:
        """Committed entries whose command could not be applied (recorded as failed on every replica)."""
        return self._applier.apply_failures

    @property
    def installing_snapshot(self) -> bool:
        """True while a snapshot is being fetched and installed: the replica cannot serve (readiness)."""
        return self._manifests.installing

    @property
    def snapshots_installed(self) -> int:
        return self._manifests.snapshots_installed

    @property
    def snapshot_install_seconds(self) -> float:
        return self._manifests.snapshot_install_seconds

    # -- what the group's transport reads (``outbox.Sender``) ---------------------

    @property
    def echo_round(self) -> int:
        """The last read round this leader started, stamped on its append-entries (``ReadIndex``)."""
        return self._reads.echo_round

    @property
    def last_echo_from(self) -> dict[str, int]:
        """Per leader, the last read round it stamped on an append-entries: echoed in the answer (``ReadIndex``)."""
        return self._reads.last_echo_from

    def sent_entries(self, node_id: str, entry_bytes: int) -> None:
        """A leader sent ``node_id`` entries of ``entry_bytes`` (``ElectionTimers.sent_entries``)."""
        self._timers.sent_entries(node_id, entry_bytes)

    # -- what ``RaftCore`` calls (``CoreHooks``) -----------------------------------

    def apply_entry(self, command: bytes, index: int) -> Any:
        """Apply committed entry ``index`` (``CommandApplier.apply_entry``): its result goes to its proposer."""
        return self._applier.apply_entry(command, index)

    def parse_membership(self, command: bytes) -> tuple[str, str] | None:
        """Whether a command is a membership change (``CommandApplier.parse_membership``)."""
        return self._applier.parse_membership(command)

    # -- the cycle ---------------------------------------------------------------

    def _cycle(self) -> None:
        """One whole cycle on the calling thread (tests drive groups by hand with it; passes run its parts)."""
        self._send(self.cycle_before_sync())
        self.journal.sync()
        self._send(self.take_outgoing())
        self.cycle_apply()

    def cycle_before_sync(self) -> list[Outgoing]:
        """A cycle up to its log sync: deliver the inbox, log proposals, tick.

        Returns what may leave before the sync: a leader's append-entries
        (the caller sends them, with the other groups' of its pass, before
        the sync). Everything else the cycle produced waits for the sync
        (``take_outgoing``).
        """
        members = self._members_set()
        inbox = self._inbox
        while inbox:
            kind, node_id, payload = inbox.popleft()
            if kind == _MESSAGE:
                message, echo, sequence = payload
                if "serialized" in message and not self._long_lane and self._scheduler is not None:
                    # A snapshot's transfer came after this cycle was taken for a pass: it and
                    # what follows it wait for the long lane (``end_cycle`` hands the group on).
                    inbox.appendleft((kind, node_id, payload))
                    self.snapshot_inbound = True
                    break
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
                self._receive(node_id, message, echo, sequence)
            elif kind == _CONNECTED:
                members = self._members_set()
                if node_id in members:
                    self.raft.node_connected(node_id)
            elif kind == _DISCONNECTED:
                self.raft.node_disconnected(node_id)
            elif kind == _TRANSFER:
                self._transfer.begin(node_id, payload)
        self._timers.hold_election(self._retiring)
        self._timers.excuse_own_silence()
        if self.proposals:
            self._log_proposals()
        raft = self.raft
        raft.tick()
        self._transfer.advance()
        leader = raft.leader_id
        if leader is not None and (leader != self._seen_leader or raft.term != self._seen_term):
            if self._seen_leader is not None:
                self.leader_changes += 1
            self._seen_leader, self._seen_term = leader, raft.term
        self._reads.serve()
        if self.journal.size_bytes > self.timing.log_max_bytes or self._idle_compaction_due():
            raft.compact()
        current = set(self.members)
        if current != self._members_recorded:
            self.journal.set_members(sorted(current))
            self._members_recorded = current
        if self._role == ROLE_LEADER:
            # A leader's append-entries leave before its own log sync, which
            # then runs while they travel (Raft allows it: Ongaro's thesis,
            # 10.2.1). Nothing is lost: an entry commits on the followers'
            # answers, handled in a later cycle (after this sync), and is
            # applied, and answered, only after this sync in any case.
            return self.take_outgoing()
        return []

    def compact_soon(self) -> None:
        """Compact the log at the next cycle that may, whatever its size or age (the node's disk is past a limit:
        the log's entries are in the replica's storage already, and a deleted message's stay in the log until then)."""
        self._compaction_wanted = True
        self.wake()

    def _idle_compaction_due(self) -> bool:
        """Whether the log stopped growing long enough to compact (``IdleLog``), or ``compact_soon`` asked.

        A leader waits until every follower has the whole log: one that was
        down would otherwise need a snapshot (a copy of the shard) where a few
        entries would do.
        """
        last = self.last_log_index
        if self._role == ROLE_LEADER and any(self.match_index(str(n.id)) < last for n in self.raft.peers):
            return False
        if self._compaction_wanted:
            self._compaction_wanted = False
            if self.journal.size_bytes > IDLE_KEEP_BYTES:
                return True
        return self._idle_log.due(last, self.journal.size_bytes, raft_clock())

    def take_outgoing(self) -> list[Outgoing]:
        """What the cycle produced so far, for the caller to send (after the sync; a leader's appends before)."""
        outgoing = self._transport.outbox
        if outgoing:
            self._transport.outbox = []
        return outgoing

    def cycle_apply(self) -> None:
        """The end of a cycle, once its log records are durable and its messages left: apply what is committed.

        Only now, with the cycle's acknowledgements and append-entries on
        their way, so a follower's answer to the next batch does not wait for
        the previous one to reach RocksDB.
        """
        raft = self.raft
        if raft.commit_index > raft.last_applied:
            raft.apply_committed()
            self._reads.serve()  # reads that waited for this apply
            if self._transport.outbox or set(self.members) != self._members_recorded:
                self.wake()  # the next cycle syncs and sends them
        if raft.is_leader and not raft.peers and raft.commit_index < raft.last_log_index:
            # Alone in the group: nobody's answer will wake us to commit what
            # was just appended (and synced), so go round again at once.
            self.wake()

    @property
    def outbox(self) -> Outbox:
        """Where this group's messages go (the node's router): a pass sends every group's through it at once."""
        return self._outbox

    def _send(self, outgoing: list[Outgoing]) -> None:
        if outgoing:
            self._outbox.send([(self.group, outgoing)])

    def _log_proposals(self) -> None:
        """Hand the proposals queued since the last cycle to pysyncobj, batched (group commit)."""
        assert self.proposals is not None
        if not self.raft.is_leader:
            self.proposals.fail_all(FAIL_REASON.NOT_LEADER)
            return

        def log(body: bytes, callback: Callable[[Any, int], None], is_batch: bool) -> None:
            self.raft.append(body, callback, codec.COMMAND_BATCH if is_batch else codec.COMMAND_REGULAR)

        self.proposals.drain(log)

    def _members_set(self) -> set[str]:
        return {n.id for n in self.raft.peers}

    def _overtaken(self, node_id: str, message: dict[str, Any], sequence: int) -> bool:
        """Whether an append-entries from ``node_id`` was overtaken by a newer one it sent in the same term.

        Messages from one leader can arrive out of order (the connection they
        left on went down while a new one already delivered later ones).
        Raft lets a follower drop a message; taking an old one is not safe
        with pysyncobj, which deletes every entry after its ``prevLogIdx``
        whether or not they conflict, so a follower would lose entries it had
        acknowledged and the leader may have committed (found by the
        deterministic simulation with reordering: DESIGN.md).
        """
        if not sequence:
            return False  # a node of a version that does not number its messages
        term = message["term"]
        last = self._last_sequence.get(node_id)
        if last is not None and last[0] == term and sequence <= last[1]:
            return True
        if last is None or term >= last[0]:
            self._last_sequence[node_id] = (term, sequence)
        return False

    def _receive(self, node_id: str, message: dict[str, Any], echo: int, sequence: int = 0) -> None:
        kind = message["type"]
        if kind == "request_vote" and self._timers.staying_quiet():
            return
        if kind == "timeout_now" and self.declines_leadership:
            self.dropped_messages += 1
            return
        if kind == "append_entries":
            if self._overtaken(node_id, message, sequence):
                self.overtaken_messages += 1
                return
            self._timers.heard_from_leader()
            self._reads.heard(node_id, echo)
            self._transport.answering_entries = carries_entries(message)
        elif kind == "next_node_idx":
            self._reads.echoed(node_id, echo)
            self._transfer.note_answer(node_id, bool(message.get("declines_leadership")))
        try:
            self.raft.receive(node_id, message)  # an acknowledgement never rewinds the follower's next index
        finally:
            self._transport.answering_entries = False
        if kind == "append_entries":
            self._timers.allow_for_leaders_work(node_id, codec.command_bytes(message))

    def _state_changed(self, old: int, new: int) -> None:
        self._role = new
        if new == ROLE_CANDIDATE:
            self.elections += 1
        log.info("%s: %s -> %s (term %d)", self.name, ROLE_NAMES[old], ROLE_NAMES[new], self.raft.term)
        if self._on_role_change is not None:
            self._on_role_change(self, old, new)

    def on_member_added(self, node_id: str) -> None:
        """pysyncobj added a member: treat it as connected if the router is."""
        if self._outbox.is_connected(node_id):
            self._inbox.append((_CONNECTED, node_id, None))
