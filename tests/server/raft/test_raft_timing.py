"""Time in a Raft group: a leader busy with a large entry, heartbeats that wait for company, the frame
queue's linger, a replica cut off from its peers, and a log compacted when it stops growing."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from raft_support import HEARTBEAT, follower, kinds_since, leader, make_group, sent_since

from mqds.server.raft import codec
from mqds.server.raft import group as raft_group
from mqds.server.raft.grpc_link import FrameQueue
from mqds.server.raft.scheduler import RaftScheduler
from mqds.server.raft.timing import IDLE_KEEP_BYTES, IdleLog


def test_a_follower_gives_a_leader_busy_with_a_large_entry_time_before_campaigning(tmp_path: Path) -> None:
    """The leader journals, applies and compacts a large entry too, sending nothing meanwhile.

    A 60 MiB batch on a loaded 2-core machine kept leaders quiet past the
    election timeout: every such write cost an election.
    """
    group, outbox = follower(tmp_path)
    timing = group.timing
    assert group.raft.election_deadline <= time.monotonic() + timing.election_timeout_max_s
    large = bytes([codec.COMMAND_REGULAR]) + b"x" * (32 * 1024 * 1024)
    group.deliver("n1", {**HEARTBEAT, "entries": [(large, 2, 1)]}, 0)
    group._cycle()
    # A heartbeat right after (pysyncobj resets its deadline on each) does not shorten the wait.
    group.deliver("n1", {**HEARTBEAT, "prevLogIdx": 2, "prevLogTerm": 1}, 0)
    group._cycle()
    busy_s = len(large) / timing.busy_bytes_per_s
    assert busy_s >= 1
    assert group.raft.election_deadline >= time.monotonic() + busy_s - 0.5 + timing.election_timeout_min_s
    # Once that time has passed, a silent leader is given up on as ever.
    group._timers._leader_busy_until = 0.0
    group.raft.election_deadline = 0
    group._cycle()
    assert group.raft.term == 2 and [m for _, _, m in outbox.sent if m["type"] == "request_vote"]
    group.stop()


def test_a_leader_busy_with_a_large_entry_does_not_step_down_for_its_own_silence(tmp_path: Path) -> None:
    group, _ = leader(tmp_path)
    answered = group.raft.last_response_times
    # The followers answered its last append-entries 2.5 s ago; its thread has been applying
    # since (3 s between two ticks), sending nothing they could answer.
    now = time.monotonic()
    for node in answered:
        answered[node] = now - 2.5
    group._timers._last_tick_at = now - 3.0
    group._cycle()
    assert group.is_leader
    # A leader that did send, and heard nothing back for longer than the timeout, steps down.
    for node in answered:
        answered[node] = time.monotonic() - 2.5
    group._cycle()
    assert not group.is_leader
    group.stop()


def test_a_leader_gives_followers_time_to_take_in_a_large_entry_before_stepping_down(tmp_path: Path) -> None:
    group, _ = leader(tmp_path)
    answered = group.raft.last_response_times
    large = bytes([codec.COMMAND_REGULAR]) + b"x" * (32 * 1024 * 1024)
    last, term = group.last_log_index, group.raft.term
    entries = {"type": "append_entries", "term": term, "commit_index": last, "prevLogIdx": last, "prevLogTerm": term}
    # The followers last answered 1.5 s ago (past the fallback timeout); since, the leader sent
    # them a large entry, which they are still taking in.
    for node in answered:
        answered[node] = time.monotonic() - 1.5
        group._transport.send(node, {**entries, "entries": [(large, last + 1, term)]})
    group._timers._last_tick_at = time.monotonic()
    group._cycle()
    assert group.is_leader
    group.stop()


def test_a_leader_lets_only_repeated_heartbeats_wait_for_company(tmp_path: Path) -> None:
    group, outbox = leader(tmp_path)
    # The new leader's first append-entries (its no-op entry) left at once.
    appends = [(node, lazy) for node, kind, lazy in kinds_since(outbox, 0) if kind == "append_entries"]
    assert sorted(appends[:2]) == [("n1", False), ("n2", False)]
    # A heartbeat in the same term and read round: nobody waits for it.
    mark = len(outbox.sent)
    group.raft.next_heartbeat_at = 0
    group._cycle()
    assert sorted(kinds_since(outbox, mark)) == [("n1", "append_entries", True), ("n2", "append_entries", True)]
    # Entries: a commit waits for their acknowledgement.
    mark = len(outbox.sent)
    group.propose(b"\x00write")
    group._cycle()
    assert sorted(kinds_since(outbox, mark)) == [("n1", "append_entries", False), ("n2", "append_entries", False)]
    # A read: its heartbeat starts a new round, and the read waits for the echoes.
    mark = len(outbox.sent)
    group.begin_read()
    group._cycle()
    sent = kinds_since(outbox, mark)
    assert sent and all(kind == "append_entries" and not lazy for _, kind, lazy in sent)
    group.stop()


def test_a_follower_lets_only_answers_that_repeat_themselves_wait(tmp_path: Path) -> None:
    group, outbox = follower(tmp_path)

    def answer_to(message: dict[str, Any], echo: int = 0) -> tuple[int, bool]:
        mark = len(outbox.sent)
        group.deliver("n1", message, echo)
        group._cycle()
        sent = sent_since(outbox, mark)
        (answer,) = [(m["next_node_idx"], lazy) for _, m, lazy in sent if m["type"] == "next_node_idx"]
        return answer

    # The same heartbeat again: the answer repeats the last one.
    assert answer_to(HEARTBEAT) == (2, True)
    # Entries: the leader's commit waits for this answer.
    entries = {**HEARTBEAT, "entries": [(b"\x00a", 2, 1)]}
    assert answer_to(entries) == (3, False)
    # A heartbeat after them: nothing new to say.
    beat = {**HEARTBEAT, "prevLogIdx": 2, "prevLogTerm": 1}
    assert answer_to(beat) == (3, True)
    # The same entries sent again (say after a reconnection): answered at once all the same.
    assert answer_to(entries) == (3, False)
    # A heartbeat of a read round: the read waits for its echo.
    assert answer_to(beat, echo=5) == (3, False)
    # A heartbeat that does not fit the log: the refusal leaves at once.
    assert answer_to({**HEARTBEAT, "prevLogIdx": 9, "prevLogTerm": 1}) == (3, False)
    group.stop()


def test_the_frame_queue_holds_lazy_messages_until_the_linger_passes() -> None:
    queue = FrameQueue(linger_s=0.3)
    queue.set_open(True)
    started = time.monotonic()
    queue.put([b"beat-1"], lazy=True)
    queue.put([b"beat-2"], lazy=True)
    assert queue.take(lambda: False) == b"beat-1beat-2"
    assert 0.25 <= time.monotonic() - started < 5


def test_a_message_somebody_waits_for_sends_the_lazy_ones_with_it_at_once() -> None:
    queue = FrameQueue(linger_s=30.0)
    queue.set_open(True)
    queue.put([b"beat"], lazy=True)
    threading.Timer(0.05, lambda: queue.put([b"entries"])).start()
    started = time.monotonic()
    assert queue.take(lambda: False) == b"beatentries"
    assert time.monotonic() - started < 5
    # Without a linger nothing waits.
    eager = FrameQueue(linger_s=0.0)
    eager.set_open(True)
    eager.put([b"beat"], lazy=True)
    started = time.monotonic()
    assert eager.take(lambda: False) == b"beat"
    assert time.monotonic() - started < 0.5


def test_the_frame_queue_drops_what_waits_when_the_link_goes_down_or_overflows() -> None:
    queue = FrameQueue(linger_s=0.0, max_bytes=10)
    assert queue.put([b"x"]) == 0  # not open yet: not queued
    queue.set_open(True)
    queue.put([b"lost"])
    queue.set_open(False)
    queue.set_open(True)
    assert queue.put([b"123456", b"7890ab"]) == 2  # past max_bytes: dropped (Raft resends)
    queue.put([b"kept"])
    assert queue.take(lambda: False) == b"kept"
    stop = threading.Event()
    threading.Timer(0.05, lambda: (stop.set(), queue.wake())).start()
    assert queue.take(stop.is_set) is None


def test_a_replica_cut_off_from_every_peer_sleeps_instead_of_spinning(tmp_path: Path) -> None:
    """A node alone with its peers down used about half a core: every group woke every millisecond,
    past its election deadline but unable to campaign (pysyncobj needs a connected peer)."""
    scheduler = RaftScheduler()  # its workers not started: the test takes what a pass would
    group, _, _ = make_group(tmp_path, ["n1", "n2", "n3"], scheduler)
    scheduler.attach(group)
    assert scheduler.take_ready() == [group]  # a first cycle
    group._timers._quiet_until = 0.0
    group.raft.election_deadline = 0
    assert group.sleep_s() == 1.0
    group._cycle()
    scheduler.rearm(group)
    assert group.raft.term == 0  # nobody to ask for a vote
    assert scheduler.take_ready() == []  # nothing due for a second
    # A link coming up wakes the group, and it campaigns at once.
    group.peer_connected("n1", True)
    assert scheduler.take_ready() == [group]
    group._cycle()
    assert group.raft.term == 1 and group.role == raft_group.ROLE_CANDIDATE
    group.stop()


def test_a_log_that_stopped_growing_is_compacted_once_per_idle_spell() -> None:
    idle = IdleLog(after_s=30)
    big = IDLE_KEEP_BYTES + 1
    assert not idle.due(10, big, now=0.0)  # the log just reached index 10
    assert not idle.due(10, big, now=29.0)
    assert idle.due(10, big, now=30.5)  # idle for 30 s with more than a little in it
    assert not idle.due(10, big, now=90.0)  # once: the compaction may leave a large last entry
    assert not idle.due(11, big, now=91.0)  # it grew again: a new spell
    assert not idle.due(11, IDLE_KEEP_BYTES, now=200.0)  # little in it: left as it is
    assert idle.due(11, big, now=201.0)
    assert not IdleLog(after_s=0).due(5, big, now=0.0) and not IdleLog(after_s=0).due(5, big, now=1e9)
