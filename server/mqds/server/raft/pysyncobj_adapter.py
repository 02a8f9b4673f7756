"""Where mqds meets pysyncobj: the one subclass of ``SyncObj``, and the narrow surface a group uses.

pysyncobj is Raft's rules, ticked by its owner (``autoTick=False``): a
``RaftGroup`` (``group.py``) holds a :class:`RaftCore` and drives it from the
node's scheduler. pysyncobj is written to be inherited from, and what mqds
needs of it is partly private (name-mangled ``_SyncObj__*`` attributes and
methods). All of that is reached here and nowhere else, so the next upgrade
is checked in one file:

- :data:`CHECKED_VERSION` is the pysyncobj release this file was read
  against; importing it with another one raises (:func:`check_version`), and
  ``tests/server/raft/test_raft_adapter.py`` checks that every name listed below
  (:data:`MANGLED_ATTRIBUTES`, :data:`MANGLED_METHODS`, ...) still exists on
  a fresh ``SyncObj``, with the same kind (a field, a method, a property),
  and that pyproject.toml pins the same release;
- what is patched in the library: ``createJournal`` accepts a ready journal
  object (the node's shared log, ``journal.py``), and pysyncobj's pipe
  notifier is off (a group is woken through the scheduler instead, without
  two syscalls per command); its poller has nothing to poll (``NoPoller``:
  ``transport.py`` carries the messages); and ``clock.py`` points
  ``pysyncobj.syncobj.monotonicTime``, the one clock pysyncobj reads, at the
  Raft clock (the test checks that no method of ``SyncObj`` reads another);
- what :class:`RaftCore` overrides: committed entries are applied when the
  group's cycle says so (:meth:`RaftCore.apply_committed`), not by the tick;
  a follower's acknowledgement never rewinds its next index
  (:meth:`RaftCore.receive`); the log holds bytes, never pickles: applying an
  entry and reading a membership change go to the group's :class:`CoreHooks`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import pysyncobj.journal
import pysyncobj.syncobj
import pysyncobj.version
from pysyncobj import SyncObj, SyncObjConf
from pysyncobj.transport import Transport

from mqds.server.raft.names import PeerNode

CHECKED_VERSION = "0.3.17"
"""The pysyncobj release whose private names this file was checked against (pinned in pyproject.toml)."""

MANGLED_ATTRIBUTES = (
    "raftLog",
    "raftLeader",
    "raftElectionDeadline",
    "newAppendEntriesTime",
    "raftNextIndex",
    "raftMatchIndex",
    "lastResponseTime",
    "connectedNodes",
    "leaderCommitIndex",
    "noopIDx",
)
"""``SyncObj.__<name>`` fields read (or, for the deadlines and the peers' answers, written) here."""

MANGLED_METHODS = (
    "applyLogEntries",
    "doApplyCommand",
    "parseChangeClusterRequest",
    "doChangeCluster",
    "sendAppendEntries",
)
"""``SyncObj.__<name>`` methods overridden or called here."""

PROTECTED_METHODS = ("_onTick", "_applyCommand", "_isLeader", "_getLeader", "_doDestroy")
"""``SyncObj``'s single-underscore methods called here (``_doDestroy``: by its ``destroy``, not auto-ticked)."""

TRANSPORT_METHODS = ("_onMessageReceived", "_onNodeConnected", "_onNodeDisconnected")
"""pysyncobj ``Transport`` methods that hand it what arrived."""

PUBLIC_PROPERTIES = ("raftCurrentTerm", "raftCommitIndex", "raftLastApplied", "otherNodes")
"""``SyncObj``'s public properties read here."""

PUBLIC_METHODS = ("getStatus", "transferLeadership", "forceLogCompaction", "destroy")
"""``SyncObj``'s public methods called here (or by the group: ``destroy``)."""

STATUS_KEYS = ("log_len", "raft_term", "commit_idx", "last_applied", "leader_commit_idx")
"""Keys of ``getStatus()`` the group reads (besides ``match_idx_server_<id>`` on a leader)."""

PATCHED_GLOBALS = ("createJournal", "PIPE_NOTIFIER_ENABLED")
"""Names of the module ``pysyncobj.syncobj`` replaced below."""


def check_version(installed: str | None = None) -> None:
    """Raise unless the installed pysyncobj (or ``installed``) is :data:`CHECKED_VERSION`."""
    version = pysyncobj.version.VERSION if installed is None else installed
    if version != CHECKED_VERSION:
        raise RuntimeError(
            f"mqds's Raft adapter was checked against pysyncobj {CHECKED_VERSION}, but {version} is installed: "
            f"install pysyncobj=={CHECKED_VERSION}, or check raft/pysyncobj_adapter.py against {version} first"
        )


check_version()

_original_create_journal = pysyncobj.syncobj.createJournal


def _create_journal(journal_file: Any) -> Any:
    """Let a SyncObjConf carry a ready journal object in ``journalFile``."""
    if isinstance(journal_file, pysyncobj.journal.Journal):
        return journal_file
    return _original_create_journal(journal_file)


pysyncobj.syncobj.createJournal = _create_journal
# pysyncobj wakes its own poller through a pipe on every command (a write and
# a read syscall each); the node's scheduler is notified instead (``RaftGroup.wake``).
pysyncobj.syncobj.PIPE_NOTIFIER_ENABLED = False


class NoPoller:
    """pysyncobj polls its transport's sockets once a tick; ours has none (``transport.py`` carries the messages)."""

    def subscribe(self, descr: Any, callback: Any, events: Any) -> None:
        raise NotImplementedError("mqds groups have no sockets for pysyncobj's poller")

    def unsubscribe(self, descr: Any) -> None:
        pass

    def poll(self, timeout: float) -> None:
        pass


class CoreHooks(Protocol):
    """What pysyncobj calls back into, besides the serializer and ``onStateChanged`` of its configuration."""

    def apply_entry(self, command: bytes, index: int) -> Any:
        """Apply committed entry ``index`` (its command, type byte first); the result goes to its proposer."""

    def parse_membership(self, command: bytes) -> tuple[str, str] | None:
        """``("add" | "rem", node id)`` if ``command`` is a membership change, else None."""


Callback = Callable[[Any, int], None]
"""pysyncobj's result callback: ``(result, FAIL_REASON)``."""


class RaftCore(SyncObj):
    """One group's pysyncobj state machine, ticked by its owner; the only ``SyncObj`` in mqds.

    Everything a group reads or changes of Raft's state goes through the
    properties and methods below; nothing else names pysyncobj's private
    fields. Arguments name nodes by id; the sets and dicts that are
    pysyncobj's own (``peers``, ``connected``, ``last_response_times``) hold
    ``PeerNode``s. pysyncobj's public ``destroy()`` (journal and transport
    released) ends it.

    ``SyncObj.__init__`` reads every attribute of the object (looking for
    ``@replicated`` methods) before it has set them all: the class default
    below keeps ``next_heartbeat_at`` readable meanwhile.
    """

    _SyncObj__newAppendEntriesTime = 0.0

    def __init__(
        self,
        node_id: str,
        peers: list[str],
        transport: Transport,
        hooks: CoreHooks,
        *,
        journal: pysyncobj.journal.Journal,
        dump_file: str,
        serializer: Callable[[str, Any], None],
        deserializer: Callable[[str], Any],
        max_entry_bytes: int,
        on_state_changed: Callable[[int, int], None],
        timers: dict[str, Any],
    ) -> None:
        check_version()
        self._hooks = hooks
        self._link = transport
        conf = SyncObjConf(
            autoTick=False,
            appendEntriesUseBatch=False,
            commandsWaitLeader=False,
            dynamicMembershipChange=True,
            journalFile=journal,
            fullDumpFile=dump_file,
            serializer=serializer,
            deserializer=deserializer,
            logCompactionMinEntries=2**62,  # compaction is the group's decision (``compact``)
            logCompactionBatchSize=1024 * 1024,
            appendEntriesBatchSizeBytes=max_entry_bytes,
            onStateChanged=on_state_changed,
            **timers,
        )
        super().__init__(PeerNode(node_id), [PeerNode(p) for p in peers], conf, nodeClass=PeerNode, transport=transport)
        self._poller = NoPoller()

    # -- state -----------------------------------------------------------------

    @property
    def term(self) -> int:
        return int(self.raftCurrentTerm)

    @property
    def commit_index(self) -> int:
        return int(self.raftCommitIndex)

    @property
    def last_applied(self) -> int:
        return int(self.raftLastApplied)

    @property
    def leader_commit_index(self) -> int:
        """The commit index this replica last heard from its leader (its own, on the leader; 0: none yet)."""
        return int(self._SyncObj__leaderCommitIndex or 0)

    @property
    def noop_index(self) -> int | None:
        """The index of this leader's election no-op (None before it led)."""
        noop = self._SyncObj__noopIDx
        return None if noop is None else int(noop)

    @property
    def last_log_index(self) -> int:
        return int(self._SyncObj__raftLog[-1][1])

    @property
    def is_leader(self) -> bool:
        return bool(self._isLeader())

    @property
    def leader_id(self) -> str | None:
        """The last leader this replica knew of (None during an election)."""
        leader = self._getLeader()
        return None if leader is None else str(leader.id)

    @property
    def peers(self) -> set[PeerNode]:
        """The other members (pysyncobj's ``otherNodes`` hands out a copy)."""
        peers: set[PeerNode] = self.otherNodes
        return peers

    @property
    def connected(self) -> set[PeerNode]:
        """The peers the transport reported connected (pysyncobj's own set: read only)."""
        connected: set[PeerNode] = self._SyncObj__connectedNodes
        return connected

    @property
    def election_deadline(self) -> float:
        """When a follower campaigns unless it hears a leader (``raft_clock`` time)."""
        return float(self._SyncObj__raftElectionDeadline)

    @election_deadline.setter
    def election_deadline(self, at: float) -> None:
        self._SyncObj__raftElectionDeadline = at

    @property
    def next_heartbeat_at(self) -> float:
        """When a leader sends its next append-entries unless something is sent before."""
        return float(self._SyncObj__newAppendEntriesTime)

    @next_heartbeat_at.setter
    def next_heartbeat_at(self, at: float) -> None:
        self._SyncObj__newAppendEntriesTime = at

    @property
    def last_response_times(self) -> dict[PeerNode, float]:
        """A leader's record of when each follower last answered: pysyncobj's own dict, changed in place."""
        answered: dict[PeerNode, float] = self._SyncObj__lastResponseTime
        return answered

    def match_index(self, node_id: str) -> int:
        """The last index a leader knows ``node_id`` holds (0: unknown)."""
        return int(self._SyncObj__raftMatchIndex.get(PeerNode(node_id), 0))

    def next_index(self, node_id: str) -> int | None:
        """The next index a leader sends ``node_id`` (None: not a follower of this leader)."""
        index = self._SyncObj__raftNextIndex.get(PeerNode(node_id))
        return None if index is None else int(index)

    def status(self) -> dict[str, Any]:
        """pysyncobj's status dict (``getStatus``); may raise RuntimeError while another thread ticks."""
        status: dict[str, Any] = self.getStatus()
        return status

    # -- driving it --------------------------------------------------------------

    def tick(self) -> None:
        """One step of Raft's timers and bookkeeping (never waits, never applies: ``apply_committed``)."""
        self._onTick(0)

    def receive(self, node_id: str, message: dict[str, Any]) -> None:
        """A message from ``node_id``; a successful acknowledgement never moves the follower's next index back.

        pysyncobj sets a follower's next index to what the follower acknowledged,
        so with several appends in flight (a leader sends new entries as soon as
        they are proposed) every acknowledgement rewound it, the entries in flight
        were sent again, and the follower truncated them from its journal and
        wrote them a second time. The next index only moves back on a refusal
        (``reset``), which a follower sends when an append does not fit its log.
        """
        node = PeerNode(node_id)
        if message["type"] != "next_node_idx" or not message.get("success") or message.get("reset"):
            self._link._onMessageReceived(node, message)
            return
        next_index = self._SyncObj__raftNextIndex
        before = next_index.get(node)
        self._link._onMessageReceived(node, message)
        if before is not None and next_index.get(node, 0) < before:
            next_index[node] = before

    def node_connected(self, node_id: str) -> None:
        self._link._onNodeConnected(PeerNode(node_id))

    def node_disconnected(self, node_id: str) -> None:
        self._link._onNodeDisconnected(PeerNode(node_id))

    def append(self, command: bytes, callback: Callback, kind: int) -> None:
        """Log ``kind`` byte + ``command`` at the next tick (on a leader); ``callback`` gets its result once applied."""
        self._applyCommand(command, callback, kind)

    def send_heartbeats(self) -> None:
        """Send append-entries to every follower now (a read's new round)."""
        self._SyncObj__sendAppendEntries()

    def transfer_leadership(self, node_id: str, callback: Callback) -> None:
        """pysyncobj's TimeoutNow: answered at once, denied unless ``node_id`` has the whole log."""
        self.transferLeadership(PeerNode(node_id), callback)

    def apply_committed(self) -> None:
        """Apply every committed entry not applied yet (through ``CoreHooks.apply_entry``)."""
        SyncObj._SyncObj__applyLogEntries(self)

    def change_cluster(self, request: tuple[str, str]) -> None:
        """Apply a membership change ``("add" | "rem", node id)`` (a no-op when already in effect)."""
        self._SyncObj__doChangeCluster(request)

    def compact(self) -> None:
        """Snapshot and compact the log at the next tick."""
        self.forceLogCompaction()

    # -- what pysyncobj calls --------------------------------------------------

    def _SyncObj__applyLogEntries(self) -> bool:
        """pysyncobj's tick would apply committed entries here; the group's cycle does after sending.

        Its answer tells a leader whether to send append-entries at once:
        pysyncobj's sends one after every apply, only to announce the new
        commit index. We do not: followers learn it from the next
        append-entries (the next write's, or the next heartbeat, within
        ``heartbeat_s``), which halves the messages per write, and their
        acknowledgements, while no client waits on a follower's apply.
        """
        return False

    def _SyncObj__doApplyCommand(self, command: bytes) -> Any:
        return self._hooks.apply_entry(command, self.last_applied + 1)

    def _SyncObj__parseChangeClusterRequest(self, command: bytes) -> tuple[str, str] | None:
        return self._hooks.parse_membership(command)
