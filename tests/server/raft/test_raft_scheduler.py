"""The node-wide Raft scheduler (``raft/scheduler.py``): passes, timers, lanes, and no thread per group.

Real ``RaftGroup``s on one real ``NodeLog`` (one node's), each alone in its
group so it leads at once; the scheduler's passes are taken by hand where the
test needs to see one, and by its workers where it needs the threads.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from raft_harness import RecordingMachine
from raft_support import Outbox, elect

from mqds.server.raft import cycles
from mqds.server.raft.group import Outgoing, RaftGroup, RaftTiming
from mqds.server.raft.journal import NodeLog
from mqds.server.raft.scheduler import RaftScheduler

TIMING = RaftTiming(heartbeat_s=0.05, election_timeout_min_s=0.3, election_timeout_max_s=0.6)


class BatchingMachine(RecordingMachine):
    """A vnode-like machine: it takes group-committed batches, so its cycles run in passes."""

    def __init__(self, apply_delay_s: float = 0.0) -> None:
        super().__init__()
        self.apply_delay_s = apply_delay_s

    def apply(self, command: bytes, index: int) -> Any:
        time.sleep(self.apply_delay_s)
        return super().apply(command, index)

    def apply_batch(self, bodies: list[bytes], index: int) -> list[Any]:
        """Every command of one entry, all at that entry's index."""
        time.sleep(self.apply_delay_s)
        with self._lock:
            if index <= self._applied_index:
                return [index for _ in bodies]
            self._entries.extend((index, bytes(body)) for body in bodies)
            self._applied_index = index
        return [index for _ in bodies]


class SlowMetaMachine(RecordingMachine):
    """Like the metadata's machine (no batches, so the long lane), with an apply that takes ``delay_s``."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def apply(self, command: bytes, index: int) -> Any:
        time.sleep(self.delay_s)
        return super().apply(command, index)


def lone_groups(
    tmp_path: Path, log: NodeLog, scheduler: RaftScheduler, count: int, machine: type[RecordingMachine] | None = None
) -> list[RaftGroup]:
    """``count`` single-member groups of node n1 on ``log``, attached to ``scheduler``."""
    groups = []
    for gid in range(1, count + 1):
        group = RaftGroup(
            gid,
            "n1",
            ["n1"],
            (machine or BatchingMachine)(),
            str(tmp_path / f"g{gid}"),
            log.journal(gid),
            Outbox(),
            TIMING,
            scheduler=scheduler,
        )
        groups.append(group)
    return groups


def lead_by_hand(scheduler: RaftScheduler, groups: list[RaftGroup]) -> None:
    """Run passes by hand until every group leads (alone, each campaigns at once)."""
    for group in groups:
        scheduler.attach(group)
    deadline = time.monotonic() + 5
    while not all(g.is_leader for g in groups):
        assert time.monotonic() < deadline, "the lone groups did not take leadership"
        ready = scheduler.take_ready() or groups
        cycles.run_pass(ready, False)


def test_one_pass_writes_and_syncs_the_log_once_for_every_group_in_it(tmp_path: Path) -> None:
    """Eight vnodes with a write each: one pass, one fdatasync, eight answers."""
    log = NodeLog(str(tmp_path / "wal"))
    scheduler = RaftScheduler()  # workers not started: this test runs the pass
    groups = lone_groups(tmp_path, log, scheduler, 8)
    try:
        lead_by_hand(scheduler, groups)
        scheduler.take_ready()
        proposals = [group.propose(b"write %d" % group.group) for group in groups]
        ready = scheduler.take_ready()
        assert sorted(g.group for g in ready) == [g.group for g in groups]  # every proposal queued its group
        flushes = log.flushes
        cycles.run_pass(ready, False)
        # Alone in its group, a leader commits on its own sync and applies in the next pass.
        assert log.flushes == flushes + 1, "the pass synced the log more than once"
        cycles.run_pass(scheduler.take_ready(), False)
        for proposal in proposals:
            proposal.wait(1)
        assert [g.machine.commands for g in groups] == [[b"write %d" % g.group] for g in groups]
    finally:
        for group in groups:
            group.stop()
        log.close()


def test_a_group_whose_cycle_runs_elsewhere_comes_back_when_that_cycle_ends(tmp_path: Path) -> None:
    """A pass that finds a cycle running (a receiving thread's) skips the group; the holder hands it back."""
    log = NodeLog(str(tmp_path / "wal"))
    scheduler = RaftScheduler()
    (group,) = lone_groups(tmp_path, log, scheduler, 1)
    try:
        lead_by_hand(scheduler, [group])
        scheduler.take_ready()
        assert group.try_begin_cycle(long_lane=False)  # as a receiving thread would
        proposal = group.propose(b"x")
        cycles.run_pass(scheduler.take_ready(), False)  # cannot take the cycle: skipped, marked
        assert not proposal.done.is_set()
        assert scheduler.take_ready() == []
        group.end_cycle()  # the holder ends its cycle: the group is handed back
        assert scheduler.take_ready() == [group]
    finally:
        group.stop()
        log.close()


def test_a_node_steps_all_its_groups_on_the_scheduler_threads_alone(tmp_path: Path) -> None:
    """Seventeen groups, writes from eight threads: every write answered, no thread per group."""
    log = NodeLog(str(tmp_path / "wal"))
    scheduler = RaftScheduler(workers=1, long_workers=2)
    # Thread objects, not idents: a thread that ends after this line frees its ident for a new one.
    before = set(threading.enumerate())
    groups = lone_groups(tmp_path, log, scheduler, 17)
    for group in groups:
        group.start()
    try:
        deadline = time.monotonic() + 10
        while not all(g.is_leader for g in groups):
            assert time.monotonic() < deadline, "the groups did not lead"
            time.sleep(0.01)
        new_threads = sorted(t.name for t in threading.enumerate() if t not in before)
        assert new_threads == ["raft-long-0", "raft-long-1", "raft-pass-0"]
        results: list[Any] = []

        def writer(n: int) -> None:
            for i in range(40):
                group = groups[(n * 40 + i) % len(groups)]
                results.append(group.propose(b"%d-%d" % (n, i)).wait(5))

        writers = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
        for thread in writers:
            thread.start()
        for thread in writers:
            thread.join(30)
        assert len(results) == 320
        assert sum(len(g.machine.commands) for g in groups) == 320
        assert scheduler.pass_groups > scheduler.passes, "no pass ever held more than one group"
    finally:
        for group in groups:
            group.stop()
        scheduler.stop()
        log.close()


def test_a_long_step_does_not_hold_up_the_passes(tmp_path: Path) -> None:
    """The metadata group's apply takes a second (the long lane); a vnode's writes go on meanwhile."""
    log = NodeLog(str(tmp_path / "wal"))
    scheduler = RaftScheduler()
    (vnode,) = lone_groups(tmp_path, log, scheduler, 1)
    meta = RaftGroup(
        0,
        "n1",
        ["n1"],
        SlowMetaMachine(1.0),
        str(tmp_path / "meta"),
        log.journal(0),
        Outbox(),
        TIMING,
        scheduler=scheduler,
    )
    vnode.start()
    meta.start()
    try:
        deadline = time.monotonic() + 10
        while not (vnode.is_leader and meta.is_leader):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        slow = meta.propose(b"open replicas")
        time.sleep(0.1)  # the long lane is inside the apply now
        started = time.monotonic()
        for i in range(20):
            vnode.propose(b"w%d" % i).wait(5)
        assert time.monotonic() - started < 0.8, "vnode writes waited for the metadata's apply"
        assert not slow.done.is_set()
        slow.wait(5)
        assert scheduler.long_steps > 0
    finally:
        vnode.stop()
        meta.stop()
        scheduler.stop()
        log.close()


class TimerGroup:
    """What the scheduler asks of a group, with a fixed period: enough to watch its timers."""

    def __init__(self, name: str, period_s: float, scheduler: RaftScheduler) -> None:
        from mqds.server.raft.slot import Slot

        self.name = name
        self.period_s = period_s
        self.slot = Slot()
        self.runs: list[float] = []
        self._scheduler = scheduler

    def sleep_s(self) -> float:
        return self.period_s

    def long_step_due(self) -> bool:
        return False


def test_timers_of_many_groups_run_from_one_heap_on_one_thread(tmp_path: Path) -> None:
    """Each group runs when its own timer is due, and groups due together share a pass."""
    passes: list[list[str]] = []

    def run_pass(groups: list[Any], long_lane: bool) -> None:
        passes.append(sorted(g.name for g in groups))
        for group in groups:
            group.runs.append(time.monotonic())
            scheduler.rearm(group)

    scheduler = RaftScheduler(run_pass=run_pass)
    fast = [TimerGroup(f"fast{i}", 0.05, scheduler) for i in range(5)]
    slow = TimerGroup("slow", 0.25, scheduler)
    for group in [*fast, slow]:
        scheduler.attach(group)  # type: ignore[arg-type]
    scheduler.start()
    try:
        time.sleep(1.0)
    finally:
        scheduler.stop()
    for group in fast:
        assert 12 <= len(group.runs) <= 22, (group.name, len(group.runs))
    assert 3 <= len(slow.runs) <= 6, len(slow.runs)
    # The five fast groups were due together: they shared passes instead of one wake-up each.
    assert len(passes) < sum(len(g.runs) for g in [*fast, slow]) / 3


class NodeOutbox(Outbox):
    """One outbox for all of a node's groups (as its router is), remembering each send: its groups, the syncs then."""

    def __init__(self, log: NodeLog) -> None:
        super().__init__()
        self.log = log
        self.calls: list[tuple[list[int], int]] = []

    def send(self, sends: list[tuple[int, list[Outgoing]]]) -> None:
        self.calls.append(([group for group, _ in sends], self.log.flushes))
        super().send(sends)


def replicas(tmp_path: Path, log: NodeLog, outbox: NodeOutbox, count: int) -> list[RaftGroup]:
    """``count`` vnode groups of n3 with peers n1 and n2 (connected), sharing ``log`` and ``outbox``."""
    groups = []
    for gid in range(1, count + 1):
        group = RaftGroup(
            gid,
            "n3",
            ["n1", "n2", "n3"],
            BatchingMachine(),
            str(tmp_path / f"g{gid}"),
            log.journal(gid),
            outbox,
            TIMING,
        )
        for peer in ("n1", "n2"):
            group.peer_connected(peer, True)
        groups.append(group)
    return groups


def test_a_pass_sends_each_peer_one_frame_for_all_its_groups_and_acknowledges_only_after_its_sync(
    tmp_path: Path,
) -> None:
    """Five vnodes led here, a write each: their append-entries leave in one send, before the pass's one sync.

    Then, as a follower of five vnodes, a frame of entries for each: one sync,
    then all five acknowledgements in one send (the router writes one frame
    per peer for a send).
    """
    log = NodeLog(str(tmp_path / "wal"))
    outbox = NodeOutbox(log)
    leading = replicas(tmp_path / "leading", log, outbox, 5)
    try:
        for group in leading:
            elect(group)
        for group in leading:
            group.propose(b"write %d" % group.group)
        outbox.calls.clear()
        start = len(outbox.sent)
        flushes = log.flushes
        cycles.run_pass(leading, False)
        assert log.flushes == flushes + 1
        sends = [(groups, at) for groups, at in outbox.calls if groups]
        assert sends[0] == ([1, 2, 3, 4, 5], flushes), "the appends did not leave together, before the sync"
        appends = [
            (gid, node) for gid, node, m in outbox.sent[start:] if m["type"] == "append_entries" and m["entries"]
        ]
        assert sorted(appends) == sorted((g, n) for g in range(1, 6) for n in ("n1", "n2"))
    finally:
        for group in leading:
            group.stop()

    following = replicas(tmp_path / "following", log, outbox, 5)
    try:
        beat = {"type": "append_entries", "term": 1, "commit_index": 1, "prevLogIdx": 1, "prevLogTerm": 0}
        for group in following:
            group.deliver("n1", {**beat, "entries": []}, 0)
            group._cycle()
        outbox.calls.clear()
        start = len(outbox.sent)
        for group in following:
            group.deliver("n1", {**beat, "entries": [(b"\x00stored %d" % group.group, 2, 1)]}, 1, wake=False)
        flushes = log.flushes
        cycles.run_cycles(following)  # as the receiving thread runs a frame's groups
        assert log.flushes == flushes + 1
        assert outbox.calls == [([1, 2, 3, 4, 5], flushes + 1)], (
            "the acknowledgements did not leave together, after the sync"
        )
        acks = [(gid, m["next_node_idx"]) for gid, _, m in outbox.sent[start:] if m["type"] == "next_node_idx"]
        assert sorted(acks) == [(g, 3) for g in range(1, 6)]
    finally:
        for group in following:
            group.stop()
        log.close()


def test_a_leaders_appends_leave_even_when_staging_its_records_fails(tmp_path: Path, monkeypatch: Any) -> None:
    """Appends may leave before the leader's own sync (it counts itself only once synced), so a cycle whose
    staging failed still sends them, as a lone cycle does; the group runs again, and nothing is applied."""
    log = NodeLog(str(tmp_path / "wal"))
    outbox = NodeOutbox(log)
    (group,) = replicas(tmp_path, log, outbox, 1)
    try:
        elect(group)
        group.propose(b"write")
        start = len(outbox.sent)

        def broken() -> int:
            raise OSError("staging failed")

        with monkeypatch.context() as patch:
            patch.setattr(group.journal, "stage", broken)
            cycles.run_pass([group], False)
        appends = [node for _, node, m in outbox.sent[start:] if m["type"] == "append_entries" and m["entries"]]
        assert sorted(appends) == ["n1", "n2"]
        assert group.machine.commands == []
    finally:
        group.stop()
        log.close()
