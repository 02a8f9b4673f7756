"""Leadership transfer, done as etcd does it: pause proposals, wait for the target, then TimeoutNow.

pysyncobj's ``transferLeadership`` sends TimeoutNow only if the target has
the leader's whole log at that instant, and keeps taking writes meanwhile;
under steady writes the transfer rarely happened, or the old leader won the
election again (see DESIGN.md). :class:`LeadershipTransfer` (held by
``RaftGroup``) refuses new proposals from the request on, looks each cycle
whether the target caught up, and gives up after an election timeout. It
also keeps which followers decline leadership (a stopping or not-ready node),
so a transfer without a named target never picks one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pysyncobj import FAIL_REASON

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.server.raft.clock import now as raft_clock
from mqds.server.raft.names import PeerNode

Callback = Callable[[Any, int], None]
"""pysyncobj's result callback: ``(result, FAIL_REASON)``."""


class TransferRaft(Protocol):
    """What a leadership transfer reads and asks of the group's Raft (``RaftCore`` meets it)."""

    @property
    def is_leader(self) -> bool: ...

    @property
    def peers(self) -> set[PeerNode]: ...

    @property
    def connected(self) -> set[PeerNode]: ...

    def match_index(self, node_id: str) -> int: ...

    def transfer_leadership(self, node_id: str, callback: Callback) -> None: ...


class LeadershipTransfer:
    """A group's leadership transfer in progress, the proposals it holds back, and the followers that decline.

    ``timeout_s`` is how long a transfer waits for its target (an election
    timeout); ``not_leader_error`` is the error a proposal gets where this
    replica does not lead.
    """

    def __init__(
        self,
        name: str,
        raft: TransferRaft,
        timeout_s: float,
        not_leader_error: Callable[[], errors.MqdsError],
    ) -> None:
        self._name = name
        self._raft = raft
        self._timeout_s = timeout_s
        self._not_leader_error = not_leader_error
        self._pending: tuple[str, Callback, float] | None = None
        """The transfer in progress (inside the group's cycle only): the target ("" = the most caught-up
        follower), the caller's callback, and when to give up."""
        self._paused_until = 0.0
        """New proposals are refused until then (any thread reads it)."""
        self._declining: set[str] = set()
        """Followers whose latest answer said their node declines leadership (inside the group's cycle only)."""

    def check_accepting(self) -> None:
        """Raise unless this replica takes proposals now: it leads, and hands over to nobody."""
        if not self._raft.is_leader:
            raise self._not_leader_error()
        if raft_clock() < self._paused_until:
            raise errors.error(Reason.NO_LEADER, f"{self._name}: leadership is being handed over; retry")

    def note_answer(self, follower: str, declines: bool) -> None:
        """A follower's answer said whether its node declines leadership."""
        if declines:
            self._declining.add(follower)
        else:
            self._declining.discard(follower)

    def begin(self, node_id: str, callback: Callback) -> None:
        """Inside the group's cycle: a transfer to ``node_id`` ("": the most caught-up follower) was asked for."""
        raft = self._raft
        if not raft.is_leader:
            callback(None, FAIL_REASON.NOT_LEADER)
            return
        if node_id and (node_id not in {n.id for n in raft.peers} or node_id in self._declining):
            callback(None, FAIL_REASON.REQUEST_DENIED)
            return
        if self._pending is not None:
            self._pending[1](None, FAIL_REASON.REQUEST_DENIED)  # superseded by this one
        deadline = raft_clock() + self._timeout_s
        self._pending = (node_id, callback, deadline)
        self._paused_until = deadline

    def advance(self) -> None:
        """After a tick: send TimeoutNow once the target has the whole log (after this cycle's appends); give up
        at the deadline. Nothing to do without a transfer in progress."""
        if self._pending is None:
            return
        node_id, callback, deadline = self._pending
        if not self._raft.is_leader:
            fail = FAIL_REASON.NOT_LEADER
        elif (target := node_id or self._target()) is None:
            fail = FAIL_REASON.REQUEST_DENIED  # nobody to hand over to: no point waiting
        else:
            # pysyncobj answers at once: denied unless the target has the whole log.
            answers: list[int] = []
            self._raft.transfer_leadership(target, lambda _, answer: answers.append(answer))
            fail = answers[0]
            if fail == FAIL_REASON.REQUEST_DENIED and raft_clock() < deadline:
                return  # not caught up yet: the next cycle looks again
        self._pending = None
        if fail != FAIL_REASON.SUCCESS:
            self._paused_until = 0.0
        # Granted: proposals stay refused until the deadline, or until the
        # target's election makes this replica a follower.
        callback(None, fail)

    def _target(self) -> str | None:
        """The most caught-up connected follower that does not decline leadership."""
        raft = self._raft
        connected = raft.connected
        candidates = [
            (raft.match_index(n.id), n.id) for n in raft.peers if n in connected and n.id not in self._declining
        ]
        return max(candidates)[1] if candidates else None
