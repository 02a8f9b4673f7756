"""One scheduler steps every Raft group of a node, in passes, on a fixed set of threads.

A group used to have a thread of its own, woken by every proposal, frame and
timer. On a 2-core machine each wake-up is a context switch and a wait for
the interpreter, and with seventeen groups per node they were most of a small
write's cost (docs/performance.md). Multi-group Raft systems that are fast do
it the other way (Dragonboat's step workers, TiKV's batch system): a few
workers step whichever groups have work, and the fixed cost of a round (the
log write and its fdatasync, a frame per peer) is paid once per pass for all
the groups in it.

Here a **pass** is :func:`mqds.server.raft.cycles.run_cycles` over the groups
that have work: the first half of each group's cycle (deliver, log
proposals, tick; a leader's appends leave), one write and fdatasync of the
node's log for all of them, then the second half of each (send, apply). A
group has work when something calls :meth:`RaftScheduler.notify` (a proposal,
a read, a message the receiving thread could not run, a link change), or when
its next timer is due (a heartbeat, an election deadline), which the
scheduler keeps in one heap for every group (:meth:`RaftScheduler.rearm`,
after each cycle, on whatever thread ran it).

Two lanes:

- the **pass lane** (``workers`` threads, one by default) runs ordinary
  cycles, many groups per pass;
- the **long lane** (``long_workers`` threads) runs, one group at a time, the
  cycles that may take long and must not hold up the others: the metadata
  group (its applies open and close replicas), a snapshot being received and
  installed (a RocksDB checkpoint fetched from a peer), a log due for
  compaction, a group stopping.

A group's cycle is never run by two threads at once (``RaftGroup.cycle_lock``).
A worker that finds a group's cycle running elsewhere (a receiving thread
running it, ``cycles.py``) leaves a mark that the other thread reads when it
releases the lock, and the group comes back to the scheduler then: no
spinning, and no wake-up lost.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from mqds.server.raft import cycles
from mqds.server.raft.timing import raft_clock

if TYPE_CHECKING:
    from mqds.server.raft.group import RaftGroup

log = logging.getLogger(__name__)

_LONGEST_SLEEP_S = 1.0
"""A worker with nothing due wakes at least this often (to notice a stop)."""
COALESCE_S = 0.002
"""Timers due within this much of each other run in one pass: an idle node's heartbeats share its wake-ups."""
RETRY_AFTER_FAILURE_S = 0.5
"""A group whose cycle raised runs again after this long (a failing disk must not spin a worker)."""


class RaftScheduler:
    """Runs the cycles of a node's Raft groups: ``workers`` pass threads, ``long_workers`` long-step threads."""

    def __init__(
        self,
        workers: int = 1,
        long_workers: int = 4,
        clock: Callable[[], float] = raft_clock,
        run_pass: Callable[[list[RaftGroup], bool], None] | None = None,
    ) -> None:
        if workers < 1 or long_workers < 1:
            raise ValueError("a scheduler needs at least one pass worker and one long-step worker")
        self._workers = workers
        self._long_workers = long_workers
        self.clock = clock
        self._run_pass = cycles.run_pass if run_pass is None else run_pass
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        """Guards the lists and the heap; the pass workers wait on it."""
        self._long_cond = threading.Condition(lock)
        """The same lock; the long-step workers wait on it."""
        self._ready: list[RaftGroup] = []
        self._long: list[RaftGroup] = []
        self._heap: list[tuple[float, int, RaftGroup]] = []
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        # Counted for the metrics and the docs' figures (written under the lock, read anywhere).
        self.passes = 0
        """Passes the pass lane ran."""
        self.pass_groups = 0
        """Group cycles those passes held, in all (``pass_groups / passes``: groups per pass)."""
        self.long_steps = 0
        """Cycles the long lane ran."""

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            if self._threads:
                return
            self._stopping = False
            for i in range(self._workers):
                self._threads.append(threading.Thread(target=self._pass_worker, name=f"raft-pass-{i}", daemon=True))
            for i in range(self._long_workers):
                self._threads.append(threading.Thread(target=self._long_worker, name=f"raft-long-{i}", daemon=True))
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop the workers (the groups are stopped by their owner first)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            self._long_cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=30)
        self._threads = []

    @property
    def running(self) -> bool:
        return bool(self._threads) and not self._stopping

    # -- groups ------------------------------------------------------------------

    def attach(self, group: RaftGroup) -> None:
        """Start stepping ``group``: it runs a cycle at once, then whenever it has work."""
        with self._cond:
            group.slot.attached = True
        self.notify(group)

    def detach(self, group: RaftGroup) -> None:
        """Stop stepping ``group`` (its owner waits for a cycle in progress itself)."""
        with self._cond:
            slot = group.slot
            slot.attached = False
            if slot.queued:
                self._ready.remove(group)
                slot.queued = False
            if slot.long_queued:
                self._long.remove(group)
                slot.long_queued = False
            slot.heap_due = slot.next_due = float("inf")

    def notify(self, group: RaftGroup) -> None:
        """``group`` has work (any thread): its cycle runs in the next pass."""
        slot = group.slot
        if slot.queued or not slot.attached:
            return  # already waiting for a pass (read without the lock: a miss only costs the lock below)
        with self._cond:
            if slot.queued or not slot.attached:
                return
            slot.queued = True
            self._ready.append(group)
            self._cond.notify()

    def rearm(self, group: RaftGroup, failed: bool = False) -> None:
        """After a cycle of ``group`` (any thread): set its timer from what the cycle left due."""
        now = self.clock()
        due = now + group.sleep_s()
        with self._cond:
            slot = group.slot
            if not slot.attached:
                return
            if failed:
                slot.failed_until = now + RETRY_AFTER_FAILURE_S
                due = max(due, slot.failed_until)
            slot.next_due = due
            if due < slot.heap_due:
                slot.heap_due = due
                heapq.heappush(self._heap, (due, next(self._seq), group))
                if self._heap[0][2] is group:
                    self._cond.notify()  # the earliest timer moved up: a sleeping worker must wake sooner

    # -- the lanes ---------------------------------------------------------------

    def _collect_due(self, now: float) -> float | None:
        """Move groups whose timers are due to the ready list (holding the lock); the next due time, if any."""
        heap = self._heap
        horizon = now + COALESCE_S
        while heap and heap[0][0] <= horizon:
            due, _, group = heapq.heappop(heap)
            slot = group.slot
            if due != slot.heap_due:
                continue  # superseded by an earlier entry of the same group
            slot.heap_due = float("inf")
            if slot.next_due > horizon:
                # The group's timer moved later since this entry was pushed: keep one for the new time.
                slot.heap_due = slot.next_due
                heapq.heappush(heap, (slot.next_due, next(self._seq), group))
                continue
            slot.next_due = float("inf")
            if slot.attached and not slot.queued:
                slot.queued = True
                self._ready.append(group)
        return heap[0][0] if heap else None

    def take_ready(self) -> list[RaftGroup]:
        """Take every group with work now (notified, or its timer due), without waiting or running them.

        The workers take their passes this way; a harness that steps groups
        itself (on one thread, in a chosen order) calls it instead of starting
        the workers.
        """
        with self._cond:
            self._collect_due(self.clock())
            return self._take_locked(self.clock())

    def next_due(self) -> float | None:
        """When a group next has work, without taking it: now if one is ready, else the earliest timer (None: none).

        Read-only, for a harness that steps groups itself on a simulated clock
        (``tests/raft_sim.py``): it advances the clock to this time, then calls
        :meth:`take_ready`. The time may be early (a timer that moved later
        since), never late.
        """
        with self._cond:
            if self._ready:
                return self.clock()
            return self._heap[0][0] if self._heap else None

    def _take_locked(self, now: float) -> list[RaftGroup]:
        """The ready list, emptied (holding the lock); groups that failed lately are put off until their retry."""
        taken, self._ready = self._ready, []
        kept: list[RaftGroup] = []
        for group in taken:
            slot = group.slot
            slot.queued = False
            if slot.failed_until <= now:
                kept.append(group)
                continue
            slot.next_due = min(slot.next_due, slot.failed_until)
            if slot.next_due < slot.heap_due:
                slot.heap_due = slot.next_due
                heapq.heappush(self._heap, (slot.next_due, next(self._seq), group))
        return kept

    def _take_pass(self) -> list[RaftGroup] | None:
        """Wait for groups with work; take them all, handing the long steps to the long lane (None: stopping)."""
        with self._cond:
            while True:
                if self._stopping:
                    return None
                now = self.clock()
                next_due = self._collect_due(now)
                if self._ready:
                    break
                wait = _LONGEST_SLEEP_S if next_due is None else min(max(next_due - now, 0.0), _LONGEST_SLEEP_S)
                self._cond.wait(wait)
            passing: list[RaftGroup] = []
            for group in self._take_locked(now):
                if group.long_step_due():
                    if not group.slot.long_queued:
                        group.slot.long_queued = True
                        self._long.append(group)
                        self._long_cond.notify()
                else:
                    passing.append(group)
            if passing:
                self.passes += 1
                self.pass_groups += len(passing)
            return passing

    def _pass_worker(self) -> None:
        while True:
            groups = self._take_pass()
            if groups is None:
                return
            if groups:
                try:
                    self._run_pass(groups, False)
                except Exception:  # run_pass handles each group's failure; this is a bug in the pass itself
                    log.exception("a Raft pass failed")

    def _long_worker(self) -> None:
        while True:
            with self._cond:
                while not self._long and not self._stopping:
                    self._long_cond.wait(_LONGEST_SLEEP_S)
                if self._stopping:
                    return
                group = self._long.pop(0)
                group.slot.long_queued = False
                self.long_steps += 1
            try:
                self._run_pass([group], True)
            except Exception:
                log.exception("%s: a long Raft step failed", group.name)
