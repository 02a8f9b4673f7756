"""A pass: the cycles of several groups around one log sync, on a scheduler's worker or a receiving thread.

A frame from a peer carries messages for many groups (a leader's appends for
every vnode it leads there, a follower's answers to them). Handing each
group's messages to its own thread costs a wake-up and a hand-off of the GIL
per group, on every node and for every round, which on a busy node was most of
a small write's CPU. Instead the receiving thread runs those groups' cycles
itself, in parts (``RaftGroup.cycle_before_sync``, ``take_outgoing``,
``cycle_apply``) around *one* log write that makes every group's records
durable at once, and sends what they produced in one frame per peer: the
order inside each group's cycle, and so "durable before anything leaves", is
unchanged.

The node's scheduler (``scheduler.py``) runs the same pass (``run_pass``) over
the groups that have work. A group runs in a pass only when nothing else is
running its cycle (``cycle_lock``, taken without waiting) and, on a receiving
thread or the scheduler's pass lane, only for the ordinary traffic of a vnode:
a snapshot transfer, a log due for compaction or the metadata group (whose
applies start and stop replicas) go to the scheduler's long lane
(``RaftGroup.long_step_due``), so a long step never holds up the other groups'
messages.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mqds.server.raft.group import RaftGroup
    from mqds.server.raft.outbox import Outbox, Outgoing, Sends

log = logging.getLogger(__name__)


def run_cycles(groups: Iterable[RaftGroup]) -> None:
    """On a receiving thread: run a cycle of each group here, sharing one log write; hand the others on."""
    taken: list[RaftGroup] = []
    for group in groups:
        if not group.long_step_due() and group.try_begin_cycle(long_lane=False):
            taken.append(group)
        else:
            group.wake()  # the scheduler runs it (on the long lane if it must)
    if taken:
        _run_taken(taken, retry_now=True)


def run_pass(groups: list[RaftGroup], long_lane: bool) -> None:
    """A scheduler's pass (``scheduler.py``): a cycle of each group, sharing one log write.

    A group whose cycle runs elsewhere is skipped; the other thread hands it
    back to the scheduler when it ends (``RaftGroup.end_cycle``).
    """
    taken = [group for group in groups if group.try_begin_cycle(long_lane)]
    if taken:
        _run_taken(taken, retry_now=False)


def _run_taken(taken: list[RaftGroup], retry_now: bool) -> None:
    """The cycles of groups whose ``cycle_lock`` this thread holds, as one pass.

    In order: the first half of every cycle; the leaders' append-entries
    leave, one frame per peer for all of them; one log write and sync for
    every group's records; every other message leaves, again one frame per
    peer; then every group applies. Within each group that is the order of a
    cycle run alone (``RaftGroup._cycle``), so durable-before-send holds. A
    cycle that fails is run again by the scheduler: at once when it failed
    on a receiving thread (``retry_now``), else after a pause, so a failing
    disk cannot spin a worker.
    """
    failed: set[int] = set()
    try:
        ready: list[RaftGroup] = []
        rounds: list[int] = []
        early: list[tuple[RaftGroup, list[Outgoing]]] = []
        for group in taken:
            outgoing: list[Outgoing] = []
            try:
                outgoing = group.cycle_before_sync()
                round_ = group.journal.stage()
            except Exception:
                log.exception("%s: Raft cycle failed; it runs again", group.name)
                failed.add(id(group))
            else:
                ready.append(group)
                if round_ is not None:
                    rounds.append(round_)
            if outgoing:  # a leader's appends leave even if staging its records failed, as before the pass
                early.append((group, outgoing))
        failed.update(_send(early))
        if rounds:
            try:
                ready[0].journal.wait_durable(max(rounds))
            except Exception:
                log.exception("syncing the Raft log failed; the groups' cycles run again")
                failed.update(id(group) for group in ready)
                return
        failed.update(_send([(group, outgoing) for group in ready if (outgoing := group.take_outgoing())]))
        for group in ready:
            if id(group) not in failed:
                try:
                    group.cycle_apply()
                except Exception:
                    log.exception("%s: Raft cycle failed; it runs again", group.name)
                    failed.add(id(group))
            group.note_cycle()
    finally:
        for group in taken:
            if id(group) in failed:
                group.end_cycle(failed=not retry_now)
                if retry_now:
                    group.wake()
            else:
                group.end_cycle()


def _send(sends: list[tuple[RaftGroup, list[Outgoing]]]) -> set[int]:
    """Send the groups' messages, one frame per peer for all of them; the ids of groups whose sending failed.

    A pass's groups share the node's router; groups of different outboxes
    (nodes in one process, in tests) are sent through each in turn.
    """
    by_outbox: dict[int, tuple[Outbox, list[RaftGroup], Sends]] = {}
    for group, outgoing in sends:
        outbox = group.outbox
        _, groups, batch = by_outbox.setdefault(id(outbox), (outbox, [], []))
        groups.append(group)
        batch.append((group.group, outgoing))
    failed: set[int] = set()
    for outbox, groups, batch in by_outbox.values():
        try:
            outbox.send(batch)
        except Exception:
            log.exception("sending the Raft messages of %d groups failed; their cycles run again", len(groups))
            failed.update(id(group) for group in groups)
    return failed
