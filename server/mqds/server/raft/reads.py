"""Linearizable reads by read index: a read waits for a majority to echo a heartbeat round sent after it.

:class:`ReadIndex` (held by ``RaftGroup``) numbers heartbeat rounds. A read
on the leader takes the next round and the commit index; the transport
stamps append-entries with the round (``echo_round``) and a follower's answer
echoes the last round it heard (``last_echo_from``), counted per follower
(``echoed``). A read is served once a majority echoed its round, the
leader committed an entry of its own term, and it applied everything
committed when the read arrived: a deposed leader cut off from the majority
can never serve a stale read. Reads are answered through a
:class:`~mqds.server.raft.futures.PendingRead`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.server.raft.futures import PendingRead
from mqds.server.raft.names import PeerNode


class ReadRaft(Protocol):
    """What the read index reads of the group's Raft (``RaftCore`` meets it)."""

    @property
    def term(self) -> int: ...

    @property
    def is_leader(self) -> bool: ...

    @property
    def commit_index(self) -> int: ...

    @property
    def last_applied(self) -> int: ...

    @property
    def noop_index(self) -> int | None: ...

    @property
    def peers(self) -> set[PeerNode]: ...

    def send_heartbeats(self) -> None: ...


class ReadIndex:
    """A group's reads waiting for their read index, and the heartbeat rounds they wait on.

    ``wake`` asks for a cycle of the group (which calls ``serve``);
    ``not_leader_error`` is the error a read gets where this replica does not lead.
    """

    def __init__(
        self,
        group: int,
        name: str,
        raft: ReadRaft,
        wake: Callable[[], None],
        not_leader_error: Callable[[], errors.MqdsError],
    ) -> None:
        self._group = group
        self._name = name
        self._raft = raft
        self._wake = wake
        self._not_leader_error = not_leader_error
        self.echo_round = 0
        """The last heartbeat round this leader started (stamped on its append-entries)."""
        self.last_echo_from: dict[str, int] = {}
        """Per leader: the last round it stamped on an append-entries (echoed in the answer)."""
        self._acked_round: dict[str, int] = {}
        self._acks_term = -1
        self._reads_new: list[PendingRead] = []
        self._reads: list[PendingRead] = []
        self._reads_lock = threading.Lock()

    def begin(self) -> PendingRead:
        """Start a linearizable read; its ``wait`` returns once it may be served here.

        Raises NOT_LEADER or NO_LEADER at once when this replica is not the
        leader; ``wait`` raises them when leadership was lost meanwhile.
        """
        if not self._raft.is_leader:
            raise self._not_leader_error()
        read = PendingRead(self._group)
        with self._reads_lock:
            self._reads_new.append(read)
        self._wake()
        return read

    def heard(self, leader: str, echo: int) -> None:
        """An append-entries from ``leader`` carried round ``echo``: the answer echoes it."""
        self.last_echo_from[leader] = echo

    def echoed(self, follower: str, echo: int) -> None:
        """A follower's answer echoed round ``echo``."""
        if echo > self._acked_round.get(follower, 0):
            self._acked_round[follower] = echo

    def fail_stopping(self) -> None:
        """The replica is stopping: every read still waiting fails with SHUTTING_DOWN."""
        with self._reads_lock:
            for read in self._reads_new + self._reads:
                read.error = errors.error(Reason.SHUTTING_DOWN, f"{self._name}: replica is stopping")
                read.done.set()
            self._reads_new, self._reads = [], []

    def serve(self) -> None:
        """Inside the group's cycle: start a round for the new reads, and release those that may be served."""
        with self._reads_lock:
            new, self._reads_new = self._reads_new, []
            if not new and not self._reads:
                return
        raft = self._raft
        term = raft.term
        if term != self._acks_term:
            self._acked_round = {}
            self._acks_term = term
        if not raft.is_leader:
            for read in new + self._reads:
                read.error = self._not_leader_error()
                read.done.set()
            self._reads = []
            return
        if new:
            self.echo_round += 1
            for read in new:
                read.round, read.term, read.read_index = self.echo_round, term, raft.commit_index
            self._reads.extend(new)
            # A heartbeat now, stamped with the new round, instead of waiting
            # for the next period.
            raft.send_heartbeats()
        others = [n.id for n in raft.peers]
        noop = raft.noop_index
        ready_commit = noop is not None and raft.commit_index >= noop
        waiting = []
        for read in self._reads:
            if read.term != term:
                read.error = self._not_leader_error()
                read.done.set()
                continue
            acks = 1 + sum(1 for n in others if self._acked_round.get(n, 0) >= read.round)
            if 2 * acks > len(others) + 1 and ready_commit and raft.last_applied >= read.read_index:
                read.done.set()
            else:
                waiting.append(read)
        self._reads = waiting
