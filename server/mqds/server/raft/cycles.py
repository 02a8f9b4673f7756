"""Running the cycles of the groups a frame touched on the thread that received it, with one log sync.

A frame from a peer carries messages for many groups (a leader's appends for
every vnode it leads there, a follower's answers to them). Handing each
group's messages to its own thread costs a wake-up and a hand-off of the GIL
per group, on every node and for every round, which on a busy node was most of
a small write's CPU. Instead the receiving thread runs those groups' cycles
itself, in two halves (``RaftGroup.cycle_before_sync`` and
``cycle_after_sync``) around *one* log write that makes every group's records
durable at once: the order inside each group's cycle, and so "durable before
anything leaves", is unchanged.

A group runs here only when nothing else is running its cycle
(``cycle_lock``, taken without waiting) and only for the ordinary traffic of a
vnode: a snapshot transfer, a log due for compaction or the metadata group
(whose applies start and stop replicas) go to the group's own thread, so a long
step never holds up the other groups' messages behind it on the same stream.
A group this thread could not run is woken, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mqds.server.raft.group import RaftGroup

log = logging.getLogger(__name__)


def inline_eligible(group: RaftGroup) -> bool:
    """Whether ``group``'s cycle may run on a receiving thread now (a vnode, nothing long due)."""
    return (
        group.proposals is not None
        and not group.stopping
        and not group.installing_snapshot
        and group.journal.size_bytes <= group.timing.log_max_bytes
    )


def run_cycles(groups: Iterable[RaftGroup]) -> None:
    """Run a cycle of each group on this thread, sharing one log write; wake the groups it cannot run."""
    taken: list[RaftGroup] = []
    for group in groups:
        if inline_eligible(group) and group.cycle_lock.acquire(blocking=False):
            taken.append(group)
        else:
            group.wake()
    if not taken:
        return
    try:
        ready: list[RaftGroup] = []
        rounds: list[int] = []
        for group in taken:
            try:
                group.cycle_before_sync()
                round_ = group.journal.stage()
            except Exception:
                log.exception("%s: Raft cycle failed on a receiving thread; its own thread retries", group.name)
                group.wake()
                continue
            ready.append(group)
            if round_ is not None:
                rounds.append(round_)
        if rounds:
            try:
                ready[0].journal.wait_durable(max(rounds))
            except Exception:
                log.exception("syncing the Raft log failed on a receiving thread; the groups' threads retry")
                for group in ready:
                    group.wake()
                return
        for group in ready:
            try:
                group.cycle_after_sync()
            except Exception:
                log.exception("%s: Raft cycle failed on a receiving thread; its own thread retries", group.name)
                group.wake()
            group.note_cycle()
    finally:
        for group in taken:
            group.cycle_lock.release()
