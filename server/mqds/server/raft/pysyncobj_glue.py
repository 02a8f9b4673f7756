"""Where a RaftGroup meets pysyncobj: what is patched in the library, and the methods it overrides.

pysyncobj is used as a library of Raft's rules, driven by the node's
scheduler (``scheduler.py``). A few of its defaults do not fit and are changed here,
in one place:

- ``createJournal`` accepts a ready journal object (the node's shared log,
  ``journal.py``), and pysyncobj's pipe notifier is off (a group is
  woken through the scheduler instead, without two syscalls per command);
- its poller has nothing to poll (``NoPoller``: ``transport.py`` carries the
  messages);
- ``SyncObjOverrides``: committed entries are applied by the group's cycle,
  not by pysyncobj's tick, and a follower's acknowledgement never rewinds its
  next index.

The name-mangled methods that keep pickles out of the log are in ``machine.py``.
"""

from __future__ import annotations

from typing import Any

import pysyncobj.journal
import pysyncobj.syncobj

from mqds.server.raft.names import PeerNode

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


class SyncObjOverrides:
    """Methods of pysyncobj's ``SyncObj`` that a RaftGroup replaces (inherited before it)."""

    _transport: Any
    _SyncObj__raftNextIndex: dict[PeerNode, int]

    def _ack_without_rewind(self, node: PeerNode, message: dict[str, Any]) -> None:
        """Take a follower's acknowledgement without moving its next index back.

        pysyncobj sets a follower's next index to what the follower acknowledged,
        so with several appends in flight (a leader sends new entries as soon as
        they are proposed) every acknowledgement rewound it, the entries in flight
        were sent again, and the follower truncated them from its journal and
        wrote them a second time. The next index only moves back on a refusal
        (``reset``), which a follower sends when an append does not fit its log.
        """
        next_index = self._SyncObj__raftNextIndex
        before = next_index.get(node)
        self._transport._onMessageReceived(node, message)
        if before is not None and next_index.get(node, 0) < before:
            next_index[node] = before

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
