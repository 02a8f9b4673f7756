"""Leadership transfer, done as etcd does it: pause proposals, wait for the target, then TimeoutNow.

pysyncobj's ``transferLeadership`` sends TimeoutNow only if the target has
the leader's whole log at that instant, and keeps taking writes meanwhile;
under steady writes the transfer rarely happened, or the old leader won the
election again (see DESIGN.md). :class:`LeadershipTransfer` (part of
``RaftGroup``) refuses new proposals from the request on, looks each cycle
whether the target caught up, and gives up after an election timeout. It
also keeps which followers decline leadership (a stopping or not-ready node),
so a transfer without a named target never picks one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pysyncobj import FAIL_REASON

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.server.raft.clock import now as raft_clock
from mqds.server.raft.pysyncobj_adapter import RaftCore
from mqds.server.raft.timing import RaftTiming


class LeadershipTransfer:
    """Part of ``RaftGroup``: a leadership transfer in progress, and the proposals it holds back."""

    name: str
    timing: RaftTiming
    raft: RaftCore
    not_leader_error: Callable[[], errors.MqdsError]
    _members_set: Callable[[], set[str]]

    def _init_transfer(self) -> None:
        # A leadership transfer in progress (inside the group's cycle only): the
        # target ("" = the most caught-up follower), the caller's callback,
        # and when to give up. New proposals are refused until
        # ``_paused_until`` (any thread reads it).
        self._transfer: tuple[str, Callable[[Any, int], None], float] | None = None
        self._paused_until = 0.0
        # Followers whose latest answer said their node is stopping (inside the group's cycle only).
        self._declining: set[str] = set()

    def _check_accepting(self) -> None:
        if not self.raft.is_leader:
            raise self.not_leader_error()
        if raft_clock() < self._paused_until:
            raise errors.error(Reason.NO_LEADER, f"{self.name}: leadership is being handed over; retry")

    def _begin_transfer(self, node_id: str, callback: Callable[[Any, int], None]) -> None:
        if not self.raft.is_leader:
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
        if not self.raft.is_leader:
            fail = FAIL_REASON.NOT_LEADER
        elif (target := node_id or self._transfer_target()) is None:
            fail = FAIL_REASON.REQUEST_DENIED  # nobody to hand over to: no point waiting
        else:
            # pysyncobj answers at once: denied unless the target has the whole log.
            answers: list[int] = []
            self.raft.transfer_leadership(target, lambda _, answer: answers.append(answer))
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
        raft = self.raft
        connected = raft.connected
        candidates = [
            (raft.match_index(n.id), n.id) for n in raft.peers if n in connected and n.id not in self._declining
        ]
        return max(candidates)[1] if candidates else None
