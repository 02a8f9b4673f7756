"""Timing: Raft's timers as a group configures them, and when its thread must wake or stay quiet.

pysyncobj keeps the deadlines (next heartbeat, election) and acts on them
when ticked; it never sleeps itself (``autoTick=False``). The group's thread
sleeps until the next deadline unless woken (:meth:`ElectionTimers.sleep_s`),
and pushes the election deadline back while the replica must not campaign
(:meth:`ElectionTimers.hold_election`): a retiring replica, or a new or
wiped one that has not heard a leader yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from mqds.server.raft.clock import now as raft_clock
from mqds.server.raft.names import PeerNode


@dataclass(frozen=True)
class RaftTiming:
    """Raft timers, in seconds."""

    heartbeat_s: float = 0.1
    """How often a leader sends append-entries when idle."""
    election_timeout_min_s: float = 0.5
    """A follower that hears nothing for a random time between min and max starts an election."""
    election_timeout_max_s: float = 1.0
    busy_bytes_per_s: float = 32 * 1024 * 1024
    """A follower that receives entries of N bytes waits N / this longer before campaigning.

    The leader journals, applies and compacts the same bytes, and its thread
    sends no heartbeat meanwhile: a 60 MiB batch kept it quiet for one to two
    seconds on a loaded 2-core machine, and the followers campaigned.
    """
    log_max_bytes: int = 16 * 1024 * 1024
    """Compact (snapshot) the journal once its commands exceed this many bytes."""
    compaction_interval_s: float = 600.0
    """Compact at least this often when anything was applied."""
    max_entry_bytes: int = 65 * 1024 * 1024
    """Largest command; pysyncobj would chunk (and pickle) larger ones."""
    idle_compaction_s: float = 30.0
    """Compact a log that has not grown for this long (``IdleLog``), whatever it holds (0: never)."""


def syncobj_timers(t: RaftTiming) -> dict[str, Any]:
    """The ``SyncObjConf`` settings that are timers."""
    return {
        "appendEntriesPeriod": t.heartbeat_s,
        "raftMinTimeout": t.election_timeout_min_s,
        "raftMaxTimeout": t.election_timeout_max_s,
        "leaderFallbackTimeout": t.election_timeout_max_s,
        "connectionTimeout": max(3.5, t.election_timeout_max_s),
        "logCompactionMinTime": t.compaction_interval_s,
    }


IDLE_KEEP_BYTES = 64 * 1024
"""An idle group's log holding at most this much is left as it is."""


class IdleLog:
    """When a group's log has stopped growing long enough to compact what it holds.

    A group compacts at ``log_max_bytes``, or after ``compaction_interval_s``:
    one that goes idle below that kept its entries, and so the node's log
    segment holding them (``journal.py``), for up to ten minutes. A soak of
    short-lived clientids left each node's Raft log at tens of MiB after
    every session had ended. Compacting an idle group costs a RocksDB log
    sync and a small manifest, once per idle spell.
    """

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self._index = -1
        self._since = 0.0
        self._compacted = -1

    def due(self, last_index: int, size_bytes: int, now: float) -> bool:
        """Whether to compact: the log ended at ``last_index`` ``after_s`` ago and holds over ``IDLE_KEEP_BYTES``."""
        if last_index != self._index:
            self._index, self._since = last_index, now
            return False
        if not self.after_s or now - self._since < self.after_s or self._compacted == last_index:
            return False
        if size_bytes <= IDLE_KEEP_BYTES:
            return False
        self._compacted = last_index  # once per idle spell, whatever the compaction leaves
        return True


class TimerRaft(Protocol):
    """What the election timers read and move of the group's Raft (``RaftCore`` meets it)."""

    @property
    def is_leader(self) -> bool: ...

    @property
    def leader_id(self) -> str | None: ...

    @property
    def election_deadline(self) -> float: ...

    @election_deadline.setter
    def election_deadline(self, at: float) -> None: ...

    @property
    def next_heartbeat_at(self) -> float: ...

    @property
    def last_response_times(self) -> dict[PeerNode, float]: ...

    @property
    def connected(self) -> set[PeerNode]: ...

    @property
    def peers(self) -> set[PeerNode]: ...


class ElectionTimers:
    """A group's sleep, and the election deadline of a replica that must not campaign.

    ``heard_leader``: whether this replica heard from a leader (or had a
    journal when it started, or is alone in its group); ``joining``: a replica
    added to a group that has a leader, which waits for it however long.
    """

    def __init__(self, timing: RaftTiming, raft: TimerRaft, heard_leader: bool, joining: bool) -> None:
        self._timing = timing
        self._raft = raft
        # A replica with an empty journal may be new in a group that has a
        # leader (a move, or a node whose disk was wiped): it stays quiet,
        # neither campaigning nor voting, until it hears from a leader. That
        # keeps it from disturbing the group with a higher term, and from
        # voting twice in a term it voted in before the wipe. A replica of a
        # new cluster gives up waiting after two election timeouts.
        self._heard_leader = heard_leader
        """Whether this replica heard from a leader (or had a journal when it started)."""
        self._quiet_until = float("inf") if joining else raft_clock() + 2 * timing.election_timeout_max_s
        """Until when a replica that has not heard a leader neither campaigns nor votes."""
        self._leader_busy_until = 0.0
        """Until when the leader is taken to be busy with the entries it sent (``allow_for_leaders_work``)."""
        self._last_tick_at = 0.0
        """When the group last ticked (``excuse_own_silence``)."""

    def heard_from_leader(self) -> None:
        """An append-entries came from a leader: this replica may campaign and vote from now on."""
        self._heard_leader = True

    def staying_quiet(self) -> bool:
        """Whether this replica neither campaigns nor votes yet (it has not heard a leader)."""
        return not self._heard_leader and raft_clock() < self._quiet_until

    def allow_for_leaders_work(self, leader: str, entry_bytes: int) -> None:
        """After an append-entries from ``leader``: keep the election deadline past the leader's busy time.

        Entries of N bytes keep the leader busy for about N /
        ``busy_bytes_per_s`` from their arrival (later heartbeats, which reset
        pysyncobj's deadline, do not shorten that); the deadline is at least
        one minimum election timeout after it.
        """
        raft = self._raft
        if raft.is_leader or raft.leader_id != leader:
            return
        now = raft_clock()
        if entry_bytes:
            self._leader_busy_until = max(self._leader_busy_until, now + entry_bytes / self._timing.busy_bytes_per_s)
        if self._leader_busy_until > now:
            deadline = self._leader_busy_until + self._timing.election_timeout_min_s
            if deadline > raft.election_deadline:
                raft.election_deadline = deadline

    def excuse_own_silence(self) -> None:
        """Before a tick: a leader does not blame its followers for the time its own thread was busy.

        pysyncobj's leader steps down when a majority has not answered within
        ``leaderFallbackTimeout``; but while its thread journals, applies or
        compacts a large entry it sends nothing, so there is nothing to
        answer. The time between two ticks beyond a heartbeat period is
        added to each follower's last answer (never past now).
        """
        now = raft_clock()
        gap = now - self._last_tick_at - self._timing.heartbeat_s
        self._last_tick_at = now
        if gap <= 0 or not self._raft.is_leader:
            return
        answered = self._raft.last_response_times
        for node, at in answered.items():
            answered[node] = max(at, min(at + gap, now))

    def sent_entries(self, node_id: str, entry_bytes: int) -> None:
        """A leader sent ``node_id`` entries of ``entry_bytes``: large ones give its answer their busy time.

        The follower receives, checks and journals them before it answers:
        a 60 MiB batch took over a second on a loaded 2-core machine, and the
        leader stepped down (``leaderFallbackTimeout``) before the answers
        came. Entries that take less than a heartbeat period change nothing
        (a leader that keeps sending small ones to a follower that never
        answers must still step down).
        """
        busy_s = entry_bytes / self._timing.busy_bytes_per_s
        if busy_s < self._timing.heartbeat_s:
            return
        answered = self._raft.last_response_times
        node = PeerNode(node_id)
        if node in answered:
            # Counted as an answer when its busy time is over (pysyncobj only compares it).
            answered[node] = max(answered[node], raft_clock() + busy_s)

    def hold_election(self, retiring: bool) -> None:
        """Before a tick: keep a replica that must not campaign (``retiring``, or staying quiet) from reaching its
        election deadline."""
        if retiring or self.staying_quiet():
            # Not campaigning: a retiring replica, or a new one that has not heard a leader yet.
            self._raft.election_deadline = raft_clock() + self._timing.election_timeout_max_s

    def sleep_s(self) -> float:
        """How long nothing needs doing unless woken: until the next heartbeat or election deadline."""
        now = raft_clock()
        raft = self._raft
        if raft.is_leader:
            due = raft.next_heartbeat_at
        else:
            due = raft.election_deadline
            if due <= now and not raft.connected and raft.peers:
                # Past the deadline, but pysyncobj campaigns only when some
                # peer is connected, and a link coming up wakes the group. A
                # node alone with its peers down used to wake every group
                # every millisecond here (about half a core).
                return 1.0
        return max(min(due - now, 1.0), 0.001)
