"""The replication layer in one process: the restricted codec, manifests, placement, groups."""

# The node's write-ahead log has its own file: test_raft_journal.py.

from __future__ import annotations

import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pysyncobj import FAIL_REASON

from mqds.protocol.errors import MqdsError, Reason
from mqds.server.cluster import placement
from mqds.server.raft import codec
from mqds.server.raft import group as raft_group
from mqds.server.raft.group import Outgoing, PeerNode, RaftGroup, RaftTiming, decode_manifest, encode_manifest
from mqds.server.raft.journal import NodeLog
from mqds.server.raft.timing import IDLE_KEEP_BYTES, IdleLog
from mqds.server.raft.transport import FrameQueue

# -- codec -----------------------------------------------------------------------

MESSAGES: list[dict[str, Any]] = [
    {"type": "request_vote", "term": 3, "last_log_index": 10, "last_log_term": 2, "transfer": False},
    {"type": "response_vote", "term": 3},
    {
        "type": "append_entries",
        "term": 4,
        "commit_index": 9,
        "prevLogIdx": 9,
        "prevLogTerm": 3,
        "entries": [(b"\x00cmd", 10, 4), (b"\x01", 11, 4), (b"\x02" + codec.encode_membership(1, "n9"), 12, 4)],
    },
    {"type": "append_entries", "term": 4, "commit_index": 9, "serialized": (b"manifest", True, False)},
    {"type": "append_entries", "term": 4, "commit_index": 9, "serialized": None},
    {"type": "next_node_idx", "next_node_idx": 12, "reset": False, "success": True},
    {"type": "next_node_idx", "next_node_idx": 12, "reset": False, "success": True, "declines_leadership": True},
    {"type": "apply_command", "command": b"\x00x", "request_id": 7},
    {"type": "apply_command_response", "request_id": 7, "log_idx": 12, "log_term": 4},
    {"type": "apply_command_response", "request_id": 8, "error": 2},
    {"type": "timeout_now", "term": 4},
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m["type"])
def test_every_pysyncobj_message_round_trips(message: dict[str, Any]) -> None:
    assert codec.decode(codec.encode(message)) == message


@pytest.mark.parametrize(
    ("command", "words"),
    [
        (b"\x02" + pickle.dumps(["add", "n4", "anything"]), "membership change"),
        (b"\x03" + pickle.dumps(1), "command type 3"),
        (b"", "empty"),
        (b"\x01junk", "no-op entry with a body"),
    ],
)
def test_entries_pysyncobj_would_unpickle_are_refused(command: bytes, words: str) -> None:
    message = {"type": "append_entries", "term": 1, "commit_index": 0, "prevLogIdx": 1, "prevLogTerm": 0}
    raw = codec.encode({**message, "entries": [(command, 2, 1)]})
    with pytest.raises(codec.MalformedMessage, match=words):
        codec.decode(raw)


def test_entries_must_follow_each_other() -> None:
    message = {"type": "append_entries", "term": 1, "commit_index": 0, "prevLogIdx": 1, "prevLogTerm": 0}
    with pytest.raises(codec.MalformedMessage, match="does not follow"):
        codec.decode(codec.encode({**message, "entries": [(b"\x01", 5, 1)]}))


def test_chunked_entries_are_never_sent() -> None:
    with pytest.raises(ValueError, match="pickled"):
        codec.encode({"type": "append_entries", "transmission": "start", "data": b"x", "term": 1, "commit_index": 0})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_decoding_arbitrary_bytes_never_does_worse_than_refuse(raw: bytes) -> None:
    try:
        decoded = codec.decode(raw)
    except codec.MalformedMessage:
        return
    # Whatever parses is plain data: numbers, booleans, bytes and tuples of them.
    assert isinstance(decoded, dict) and isinstance(decoded["type"], str)


# -- manifests -----------------------------------------------------------------------


def test_manifest_round_trip_and_damage() -> None:
    raw = encode_manifest(3, "n1", (b"\x00last", 10, 2), (b"\x01", 9, 2), ["n1", "n2"], b"payload")
    manifest = decode_manifest(raw)
    assert (manifest.group, manifest.source, manifest.last, manifest.prev) == (
        3,
        "n1",
        (b"\x00last", 10, 2),
        (b"\x01", 9, 2),
    )
    assert manifest.members == ["n1", "n2"] and manifest.payload == b"payload"
    with pytest.raises(ValueError, match="checksum"):
        decode_manifest(raw[:-1] + bytes([raw[-1] ^ 1]))


# -- placement ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 7), st.integers(1, 24), st.integers(1, 5))
def test_initial_placement_is_valid_and_even(n_nodes: int, n_shards: int, rf: int) -> None:
    nodes = [f"n{i}" for i in range(n_nodes)]
    layout = placement.initial_placement(nodes, n_shards, rf)
    width = min(rf, n_nodes)
    counts = placement.replica_counts(layout, nodes)
    leaders = placement.replica_counts({s: r[:1] for s, r in layout.items()}, nodes)
    assert all(len(r) == len(set(r)) == width for r in layout.values())
    assert max(counts.values()) - min(counts.values()) <= 1
    assert max(leaders.values()) - min(leaders.values()) <= 1
    assert placement.next_move(layout, nodes, rf) is None


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6), st.integers(1, 16), st.integers(1, 4), st.data())
def test_moves_converge_after_joins_and_leaves(n_nodes: int, n_shards: int, rf: int, data: st.DataObject) -> None:
    nodes = [f"n{i}" for i in range(n_nodes)]
    layout = placement.initial_placement(nodes, n_shards, rf)
    active = list(nodes)
    if data.draw(st.booleans()):
        active.append("new")
    if len(active) > 1 and data.draw(st.booleans()):
        active.remove(data.draw(st.sampled_from(active)))
    for _ in range(10 * n_shards * rf + 10):
        move = placement.next_move(layout, active, rf)
        if move is None:
            break
        before = len(layout[move.shard])
        layout = placement.apply_move(layout, move)
        # Never fewer replicas than before a move, unless it only removes a surplus or a leaving node's.
        assert len(layout[move.shard]) >= before - (0 if move.target else 1)
    else:
        pytest.fail("moves did not converge")
    width = min(rf, len(active))
    counts = placement.replica_counts(layout, active)
    assert all(len(r) == len(set(r)) == width and set(r) <= set(active) for r in layout.values())
    assert max(counts.values()) - min(counts.values()) <= 1
    balanced = placement.balance_leaders(layout)
    leaders = placement.replica_counts({s: r[:1] for s, r in balanced.items()}, active)
    assert all(sorted(balanced[s]) == sorted(layout[s]) for s in layout)
    assert max(leaders.values()) - min(leaders.values()) <= max(1, len(active) - n_shards)


# -- a group in one process ------------------------------------------------------------------


class _Machine:
    applied_index = 0

    def __init__(self) -> None:
        self.applied: list[tuple[int, bytes]] = []
        self.skipped: list[int] = []

    def apply(self, command: bytes, index: int) -> Any:
        self.applied.append((index, command))
        self.applied_index = index
        return index

    def skip(self, index: int) -> None:
        self.skipped.append(index)
        self.applied_index = index

    def snapshot(self) -> bytes:
        return b""

    def install(self, payload: bytes, index: int, source: str, members: list[str]) -> None:
        raise AssertionError("not used")


class _Outbox:
    def __init__(self) -> None:
        self.sent: list[tuple[int, str, dict[str, Any]]] = []
        self.lazy: list[bool] = []

    def send(self, group: int, messages: list[Outgoing]) -> None:
        self.sent.extend((group, node, codec.decode(raw)) for node, raw, _ in messages)
        self.lazy.extend(lazy for _, _, lazy in messages)

    def is_connected(self, node_id: str) -> bool:
        return True

    def address_of(self, node_id: str) -> str | None:
        return f"{node_id}:1"


def _group(tmp_path: Path, members: list[str]) -> tuple[RaftGroup, _Machine, _Outbox]:
    machine, outbox = _Machine(), _Outbox()
    log = NodeLog(str(tmp_path / "wal"))
    group = RaftGroup(0, "n3", members, machine, str(tmp_path / "g"), log.journal(0), outbox, RaftTiming())
    return group, machine, outbox


def test_a_follower_connects_to_a_member_added_by_the_leader(tmp_path: Path) -> None:
    group, _, _ = _group(tmp_path, ["n1", "n2", "n3"])
    add = bytes([codec.COMMAND_MEMBERSHIP]) + codec.encode_membership(1, "n4")
    group.deliver(
        "n1",
        {
            "type": "append_entries",
            "term": 1,
            "commit_index": 1,
            "prevLogIdx": 1,
            "prevLogTerm": 0,
            "entries": [(add, 2, 1)],
        },
        0,
    )
    group._cycle()
    group._cycle()
    assert group.members == ["n1", "n2", "n3", "n4"]
    # Connected in pysyncobj's eyes, so as a leader it would send n4 entries.
    assert group.isNodeConnected(PeerNode("n4"))
    group.stop()


def test_entries_are_durable_before_the_acknowledgement_leaves(tmp_path: Path) -> None:
    group, machine, outbox = _group(tmp_path, ["n1", "n2", "n3"])
    entry = {"type": "append_entries", "term": 1, "commit_index": 1, "prevLogIdx": 1, "prevLogTerm": 0}
    group.deliver("n1", {**entry, "entries": [(b"\x00hello", 2, 1)]}, 7)
    syncs_before = group.journal.syncs
    group._cycle()
    acks = [m for _, node, m in outbox.sent if m["type"] == "next_node_idx"]
    assert acks and acks[-1]["success"] and acks[-1]["next_node_idx"] == 3
    assert group.journal.syncs > syncs_before
    # The log on disk already holds the entry the ack promises.
    assert b"hello" in next((tmp_path / "wal").glob("wal-*")).read_bytes()
    # Committed by the leader's next message: applied with its index.
    group.deliver("n1", {**entry, "commit_index": 2, "prevLogIdx": 2, "prevLogTerm": 1, "entries": []}, 8)
    group._cycle()
    assert machine.applied == [(2, b"hello")]
    group.stop()


def test_a_follower_acknowledges_a_batch_before_it_applies_the_one_before(tmp_path: Path) -> None:
    group, machine, outbox = _group(tmp_path, ["n1", "n2", "n3"])
    entry = {"type": "append_entries", "term": 1, "prevLogTerm": 1, "entries": []}
    first = {**entry, "commit_index": 1, "prevLogIdx": 1, "prevLogTerm": 0, "entries": [(b"\x00a", 2, 1)]}
    group.deliver("n1", first, 1)
    group._cycle()
    acks_when_applied: list[list[int]] = []
    apply = machine.apply

    def apply_noting_acks(command: bytes, index: int) -> Any:
        acks_when_applied.append([m["next_node_idx"] for _, _, m in outbox.sent if m["type"] == "next_node_idx"])
        return apply(command, index)

    machine.apply = apply_noting_acks  # type: ignore[method-assign]
    # The next batch arrives with the news that the first one is committed.
    group.deliver("n1", {**entry, "commit_index": 2, "prevLogIdx": 2, "entries": [(b"\x00b", 3, 1)]}, 2)
    group._cycle()
    assert machine.applied == [(2, b"a")]
    # When the first batch was applied, the acknowledgement of the second (next index 4) had left.
    assert acks_when_applied == [[3, 4]]
    group.stop()


def test_messages_from_non_members_cannot_disturb_the_group(tmp_path: Path) -> None:
    group, _, outbox = _group(tmp_path, ["n1", "n2", "n3"])
    group.deliver("intruder", {"type": "request_vote", "term": 99, "last_log_index": 50, "last_log_term": 50}, 0)
    group._cycle()
    assert group.raftCurrentTerm == 0
    assert group.dropped_messages == 1
    assert not [m for _, node, m in outbox.sent if node == "intruder"]
    group.stop()


_HEARTBEAT = {"type": "append_entries", "term": 1, "commit_index": 1, "prevLogIdx": 1, "prevLogTerm": 0, "entries": []}


def _follower(tmp_path: Path) -> tuple[RaftGroup, _Outbox]:
    """n3 following n1 in term 1, connected to both peers."""
    group, _, outbox = _group(tmp_path, ["n1", "n2", "n3"])
    for peer in ("n1", "n2"):
        group.peer_connected(peer, True)
    group.deliver("n1", _HEARTBEAT, 0)
    group._cycle()
    return group, outbox


def test_a_retiring_replica_neither_takes_a_transfer_nor_campaigns(tmp_path: Path) -> None:
    """A stopping node hands its leaderships over; the balancer of the new leader must not hand them back."""
    group, outbox = _follower(tmp_path)
    group.retire()
    group.deliver("n1", {"type": "timeout_now", "term": 1}, 0)
    group._cycle()
    assert group.raftCurrentTerm == 1 and not [m for _, _, m in outbox.sent if m["type"] == "request_vote"]
    # Nor does it campaign when it stops hearing the leader...
    group._SyncObj__raftElectionDeadline = 0
    group._cycle()
    assert group.raftCurrentTerm == 1 and not [m for _, _, m in outbox.sent if m["type"] == "request_vote"]
    # It tells its leader so in its answers...
    group.deliver("n1", _HEARTBEAT, 0)
    group._cycle()
    assert [m for _, node, m in outbox.sent if m["type"] == "next_node_idx"][-1].get("declines_leadership")
    # ...but it still votes for a follower that does.
    group.deliver("n2", {"type": "request_vote", "term": 2, "last_log_index": 1, "last_log_term": 0}, 0)
    group._cycle()
    assert [m for _, node, m in outbox.sent if node == "n2" and m["type"] == "response_vote"]
    group.stop()


def test_a_replica_that_is_not_retiring_takes_a_transfer(tmp_path: Path) -> None:
    group, outbox = _follower(tmp_path)
    group.deliver("n1", {"type": "timeout_now", "term": 1}, 0)
    group._cycle()
    assert group.raftCurrentTerm == 2 and [m for _, _, m in outbox.sent if m["type"] == "request_vote"]
    group.stop()


def test_a_follower_gives_a_leader_busy_with_a_large_entry_time_before_campaigning(tmp_path: Path) -> None:
    """The leader journals, applies and compacts a large entry too, sending nothing meanwhile.

    A 60 MiB batch on a loaded 2-core machine kept leaders quiet past the
    election timeout: every such write cost an election.
    """
    group, outbox = _follower(tmp_path)
    timing = group.timing
    assert group._SyncObj__raftElectionDeadline <= time.monotonic() + timing.election_timeout_max_s
    large = bytes([codec.COMMAND_REGULAR]) + b"x" * (32 * 1024 * 1024)
    group.deliver("n1", {**_HEARTBEAT, "entries": [(large, 2, 1)]}, 0)
    group._cycle()
    # A heartbeat right after (pysyncobj resets its deadline on each) does not shorten the wait.
    group.deliver("n1", {**_HEARTBEAT, "prevLogIdx": 2, "prevLogTerm": 1}, 0)
    group._cycle()
    busy_s = len(large) / timing.busy_bytes_per_s
    assert busy_s >= 1
    assert group._SyncObj__raftElectionDeadline >= time.monotonic() + busy_s - 0.5 + timing.election_timeout_min_s
    # Once that time has passed, a silent leader is given up on as ever.
    group._leader_busy_until = 0.0
    group._SyncObj__raftElectionDeadline = 0
    group._cycle()
    assert group.raftCurrentTerm == 2 and [m for _, _, m in outbox.sent if m["type"] == "request_vote"]
    group.stop()


def _leader(tmp_path: Path) -> tuple[RaftGroup, _Outbox]:
    group, _, outbox = _group(tmp_path, ["n1", "n2", "n3"])
    for peer in ("n1", "n2"):
        group.peer_connected(peer, True)
    group._quiet_until = 0.0
    group._SyncObj__raftElectionDeadline = 0
    group._cycle()
    group.deliver("n1", {"type": "response_vote", "term": group.raftCurrentTerm}, 0)
    group._cycle()
    assert group.is_leader
    return group, outbox


def test_a_leader_busy_with_a_large_entry_does_not_step_down_for_its_own_silence(tmp_path: Path) -> None:
    group, _ = _leader(tmp_path)
    answered = group._SyncObj__lastResponseTime
    # The followers answered its last append-entries 2.5 s ago; its thread has been applying
    # since (3 s between two ticks), sending nothing they could answer.
    now = time.monotonic()
    for node in answered:
        answered[node] = now - 2.5
    group._last_tick_at = now - 3.0
    group._cycle()
    assert group.is_leader
    # A leader that did send, and heard nothing back for longer than the timeout, steps down.
    for node in answered:
        answered[node] = time.monotonic() - 2.5
    group._cycle()
    assert not group.is_leader
    group.stop()


def test_a_leader_gives_followers_time_to_take_in_a_large_entry_before_stepping_down(tmp_path: Path) -> None:
    group, _ = _leader(tmp_path)
    answered = group._SyncObj__lastResponseTime
    large = bytes([codec.COMMAND_REGULAR]) + b"x" * (32 * 1024 * 1024)
    last, term = group.last_log_index, group.raftCurrentTerm
    entries = {"type": "append_entries", "term": term, "commit_index": last, "prevLogIdx": last, "prevLogTerm": term}
    # The followers last answered 1.5 s ago (past the fallback timeout); since, the leader sent
    # them a large entry, which they are still taking in.
    for node in answered:
        answered[node] = time.monotonic() - 1.5
        group._transport.send(node, {**entries, "entries": [(large, last + 1, term)]})
    group._last_tick_at = time.monotonic()
    group._cycle()
    assert group.is_leader
    group.stop()


def _sent_since(outbox: _Outbox, start: int) -> list[tuple[str, dict[str, Any], bool]]:
    """(peer, message, lazy) of what the group sent since ``start``."""
    sent = zip(outbox.sent[start:], outbox.lazy[start:], strict=True)
    return [(node, m, lazy) for (_, node, m), lazy in sent]


def _kinds_since(outbox: _Outbox, start: int) -> list[tuple[str, str, bool]]:
    """(peer, message type, lazy) of what the group sent since ``start``."""
    return [(node, m["type"], lazy) for node, m, lazy in _sent_since(outbox, start)]


def test_a_leader_lets_only_repeated_heartbeats_wait_for_company(tmp_path: Path) -> None:
    group, outbox = _leader(tmp_path)
    # The new leader's first append-entries (its no-op entry) left at once.
    appends = [(node, lazy) for node, kind, lazy in _kinds_since(outbox, 0) if kind == "append_entries"]
    assert sorted(appends[:2]) == [("n1", False), ("n2", False)]
    # A heartbeat in the same term and read round: nobody waits for it.
    mark = len(outbox.sent)
    group._SyncObj__newAppendEntriesTime = 0
    group._cycle()
    assert sorted(_kinds_since(outbox, mark)) == [("n1", "append_entries", True), ("n2", "append_entries", True)]
    # Entries: a commit waits for their acknowledgement.
    mark = len(outbox.sent)
    group.propose(b"\x00write")
    group._cycle()
    assert sorted(_kinds_since(outbox, mark)) == [("n1", "append_entries", False), ("n2", "append_entries", False)]
    # A read: its heartbeat starts a new round, and the read waits for the echoes.
    mark = len(outbox.sent)
    group.begin_read()
    group._cycle()
    sent = _kinds_since(outbox, mark)
    assert sent and all(kind == "append_entries" and not lazy for _, kind, lazy in sent)
    group.stop()


def test_a_follower_lets_only_answers_that_repeat_themselves_wait(tmp_path: Path) -> None:
    group, outbox = _follower(tmp_path)

    def answer_to(message: dict[str, Any], echo: int = 0) -> tuple[int, bool]:
        mark = len(outbox.sent)
        group.deliver("n1", message, echo)
        group._cycle()
        sent = _sent_since(outbox, mark)
        (answer,) = [(m["next_node_idx"], lazy) for _, m, lazy in sent if m["type"] == "next_node_idx"]
        return answer

    # The same heartbeat again: the answer repeats the last one.
    assert answer_to(_HEARTBEAT) == (2, True)
    # Entries: the leader's commit waits for this answer.
    entries = {**_HEARTBEAT, "entries": [(b"\x00a", 2, 1)]}
    assert answer_to(entries) == (3, False)
    # A heartbeat after them: nothing new to say.
    beat = {**_HEARTBEAT, "prevLogIdx": 2, "prevLogTerm": 1}
    assert answer_to(beat) == (3, True)
    # The same entries sent again (say after a reconnection): answered at once all the same.
    assert answer_to(entries) == (3, False)
    # A heartbeat of a read round: the read waits for its echo.
    assert answer_to(beat, echo=5) == (3, False)
    # A heartbeat that does not fit the log: the refusal leaves at once.
    assert answer_to({**_HEARTBEAT, "prevLogIdx": 9, "prevLogTerm": 1}) == (3, False)
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


def _transferring(tmp_path: Path, target: str) -> tuple[RaftGroup, _Outbox, list[int]]:
    """A leader with an entry its followers have not acknowledged, asked to hand over to ``target``."""
    group, outbox = _leader(tmp_path)
    group.propose(b"\x00before")
    group._cycle()
    results: list[int] = []
    group._inbox.append((raft_group._TRANSFER, target, lambda _, fail: results.append(fail)))
    group._cycle()
    return group, outbox, results


def test_a_transfer_stops_new_writes_and_waits_for_the_target_to_catch_up(tmp_path: Path) -> None:
    """Under load a transfer used to fail: the leader kept appending, so the target campaigned with a
    shorter log, the old leader refused its vote and campaigned (and won) at once."""
    group, outbox, results = _transferring(tmp_path, "n1")
    # n1 has not acknowledged the last entry: nothing sent yet, and no new writes taken meanwhile.
    assert results == [] and not [m for _, _, m in outbox.sent if m["type"] == "timeout_now"]
    with pytest.raises(MqdsError, match="being handed over") as raised:
        group.propose(b"\x00during")
    assert raised.value.reason == Reason.NO_LEADER
    group.deliver(
        "n1", {"type": "next_node_idx", "next_node_idx": group.last_log_index + 1, "reset": False, "success": True}, 1
    )
    group._cycle()
    assert results == [FAIL_REASON.SUCCESS]
    assert [node for _, node, m in outbox.sent if m["type"] == "timeout_now"] == ["n1"]
    with pytest.raises(MqdsError, match="being handed over"):
        group.propose(b"\x00after")
    group.stop()


def test_a_transfer_to_a_follower_that_never_catches_up_gives_up_and_writes_resume(tmp_path: Path) -> None:
    group, outbox, results = _transferring(tmp_path, "n2")
    assert results == []
    # Past the deadline (an election timeout).
    node_id, callback, _ = group._transfer
    group._transfer = (node_id, callback, 0.0)
    group._cycle()
    assert results == [FAIL_REASON.REQUEST_DENIED]
    assert not [m for _, _, m in outbox.sent if m["type"] == "timeout_now"]
    group.propose(b"\x00after")
    group.stop()


def test_a_leader_hands_over_to_followers_that_do_not_decline(tmp_path: Path) -> None:
    group, outbox = _leader(tmp_path)
    caught_up = {"type": "next_node_idx", "next_node_idx": group.last_log_index + 1, "reset": False, "success": True}
    group.deliver("n2", {**caught_up, "declines_leadership": True}, 1)
    group.deliver("n1", caught_up, 1)
    group._cycle()
    results: list[int] = []
    # Not to n2, whose node is stopping: refused at once, and writes go on.
    group._inbox.append((raft_group._TRANSFER, "n2", lambda _, fail: results.append(fail)))
    group._cycle()
    assert results == [FAIL_REASON.REQUEST_DENIED]
    group.propose(b"\x00still")
    group._cycle()
    group.deliver("n1", {**caught_up, "next_node_idx": group.last_log_index + 1}, 2)
    group.deliver("n2", {**caught_up, "next_node_idx": group.last_log_index + 1, "declines_leadership": True}, 2)
    group._cycle()
    # Any follower: n1 (the highest id would win a tie).
    group._inbox.append((raft_group._TRANSFER, "", lambda _, fail: results.append(fail)))
    group._cycle()
    assert results[-1] == FAIL_REASON.SUCCESS
    assert [node for _, node, m in outbox.sent if m["type"] == "timeout_now"] == ["n1"]
    group.stop()


# -- apply is total, and every entry's index reaches the machine ---------------------------------


def _append(group: RaftGroup, commit: int, prev: int, entries: list[tuple[bytes, int, int]]) -> None:
    """n1, leader in term 1, appends ``entries`` after index ``prev`` and says ``commit`` is committed."""
    message = {"type": "append_entries", "term": 1, "commit_index": commit, "prevLogIdx": prev, "entries": entries}
    group.deliver("n1", {**message, "prevLogTerm": 0 if prev == 1 else 1}, 0)
    group._cycle()


def test_entries_that_change_nothing_still_move_the_machines_applied_index(tmp_path: Path) -> None:
    """An election's no-op never reached storage: after an idle spell a restart compared storage's index
    with a manifest taken at the no-op, fetched a snapshot no replica could serve, and never got ready."""
    group, machine, _ = _group(tmp_path, ["n1", "n2", "n3"])
    no_op = bytes([codec.COMMAND_NO_OP])
    add = bytes([codec.COMMAND_MEMBERSHIP]) + codec.encode_membership(1, "n4")
    _append(group, 1, 1, [(b"\x00a", 2, 1), (no_op, 3, 1), (add, 4, 1), (no_op, 5, 1)])
    _append(group, 5, 5, [])
    assert machine.applied == [(2, b"a")]
    assert machine.skipped == [3, 4, 5]
    assert machine.applied_index == group.raftLastApplied == 5
    group.stop()


def test_a_manifest_written_here_needs_no_snapshot_when_only_entries_without_effect_are_missing(
    tmp_path: Path,
) -> None:
    """Data written before no-ops were recorded: the replica's own manifest is ahead of its storage by
    no-ops only, and it must open without asking for a snapshot (which every replica would refuse)."""
    group, machine, _ = _group(tmp_path, ["n1", "n2", "n3"])
    machine.applied_index = 9
    manifest = tmp_path / "own"
    no_op = bytes([codec.COMMAND_NO_OP])
    manifest.write_bytes(encode_manifest(0, "n3", (no_op, 12, 3), (no_op, 11, 2), ["n1", "n2", "n3"], b""))
    last, _, _ = group._read_manifest(str(manifest))
    assert last[1] == 12 and machine.applied_index == 12 and machine.skipped == [12]
    # One another replica sent, or a storage that holds nothing: the state must come from a snapshot.
    for source, applied in (("n1", 9), ("n3", 0)):
        machine.applied_index = applied
        manifest.write_bytes(encode_manifest(0, source, (no_op, 12, 3), (no_op, 11, 2), ["n1", "n2", "n3"], b""))
        with pytest.raises(AssertionError, match="not used"):
            group._read_manifest(str(manifest))
    group.stop()


def test_an_entry_the_machine_cannot_apply_is_recorded_as_failed_and_the_log_goes_on(tmp_path: Path) -> None:
    """A queue acknowledgement whose filter made the trie match recurse 1,500 deep raised on every replica,
    and the group retried that committed entry forever: the shard was dead for good."""
    group, machine, _ = _group(tmp_path, ["n1", "n2", "n3"])
    apply = machine.apply

    def apply_or_fail(command: bytes, index: int) -> Any:
        if command == b"poison":
            raise RecursionError("maximum recursion depth exceeded")
        return apply(command, index)

    machine.apply = apply_or_fail  # type: ignore[method-assign]
    _append(group, 1, 1, [(b"\x00a", 2, 1), (b"\x00poison", 3, 1), (b"\x00b", 4, 1)])
    _append(group, 4, 4, [])
    assert machine.applied == [(2, b"a"), (4, b"b")]
    assert machine.skipped == [3] and group.raftLastApplied == 4
    assert group.apply_failures == 1 and group.apply_stalled_s() == 0
    group.stop()


def test_an_entry_the_machine_refuses_without_writing_still_moves_its_applied_index(tmp_path: Path) -> None:
    """A vnode answers some commands with a refusal and writes nothing (a reused producer sequence, a
    generation already dropped): its applied index stayed behind those entries too."""
    group, machine, _ = _group(tmp_path, ["n1", "n2", "n3"])

    def refuse(command: bytes, index: int) -> Any:
        return MqdsError(Reason.INVALID_REQUEST, "sequence 7 was used for other messages")

    machine.apply = refuse  # type: ignore[method-assign]
    _append(group, 1, 1, [(b"\x00again", 2, 1)])
    _append(group, 2, 2, [])
    assert machine.skipped == [2] and machine.applied_index == group.raftLastApplied == 2
    group.stop()


def test_a_proposer_gets_the_failure_of_an_entry_as_an_error(tmp_path: Path) -> None:
    group, machine, _ = _group(tmp_path, ["n3"])
    group._cycle()
    assert group.is_leader

    def refuse(command: bytes, index: int) -> Any:
        raise ValueError("no such thing")

    machine.apply = refuse  # type: ignore[method-assign]
    proposal = group.propose(b"anything")
    for _ in range(5):
        group._cycle()
    with pytest.raises(MqdsError, match="could not be applied") as raised:
        proposal.wait(1)
    assert raised.value.reason == Reason.INTERNAL
    group.stop()


def test_a_failing_disk_is_retried_not_skipped_and_the_group_reports_it_stalled(tmp_path: Path) -> None:
    group, machine, _ = _group(tmp_path, ["n1", "n2", "n3"])
    failing = True

    def apply_unless_disk_fails(command: bytes, index: int) -> Any:
        if failing:
            raise MqdsError(Reason.STORAGE_ERROR, "write failed: IO error")
        machine.applied.append((index, command))
        machine.applied_index = index

    machine.apply = apply_unless_disk_fails  # type: ignore[method-assign]
    told: list[BaseException] = []
    group.on_disk_failure = told.append  # the node's disk guard
    group.deliver(
        "n1",
        {
            "type": "append_entries",
            "term": 1,
            "commit_index": 2,
            "prevLogIdx": 1,
            "prevLogTerm": 0,
            "entries": [(b"\x00a", 2, 1)],
        },
        0,
    )
    with pytest.raises(MqdsError, match="IO error"):
        group._cycle()
    assert [str(err) for err in told] == [
        "STORAGE_ERROR: write failed: IO error"
    ]  # told, and not recorded as the entry's failure
    group._note_apply_progress()
    assert group.raftLastApplied == 1 and machine.skipped == []
    group._applied_moved_at -= 30  # thirty seconds later, still failing
    group._note_apply_progress()
    assert group.apply_stalled_s() >= 30
    failing = False
    group._cycle()
    group._note_apply_progress()
    assert machine.applied == [(2, b"a")] and group.apply_stalled_s() == 0
    group.stop()


def test_a_replica_that_is_not_ready_declines_leadership_but_still_campaigns(tmp_path: Path) -> None:
    """A leader balancer handed vnodes to a node that was still fetching snapshots."""
    group, outbox = _follower(tmp_path)
    group.not_ready = True
    group.deliver("n1", _HEARTBEAT, 0)
    group._cycle()
    assert [m for _, _, m in outbox.sent if m["type"] == "next_node_idx"][-1].get("declines_leadership")
    group.deliver("n1", {"type": "timeout_now", "term": 1}, 0)
    group._cycle()
    assert group.raftCurrentTerm == 1
    # When its leader is gone, it stands in the election like any replica.
    group._SyncObj__raftElectionDeadline = 0
    group._cycle()
    assert group.raftCurrentTerm == 2 and [m for _, _, m in outbox.sent if m["type"] == "request_vote"]
    group.stop()


def test_a_replica_cut_off_from_every_peer_sleeps_instead_of_spinning(tmp_path: Path) -> None:
    """A node alone with its peers down used about half a core: every group woke every millisecond,
    past its election deadline but unable to campaign (pysyncobj needs a connected peer)."""
    group, _, _ = _group(tmp_path, ["n1", "n2", "n3"])
    group._quiet_until = 0.0
    group._SyncObj__raftElectionDeadline = 0
    assert group._sleep_s() == 1.0
    group._cycle()
    assert group.raftCurrentTerm == 0  # nobody to ask for a vote
    # A link coming up wakes the group, and it campaigns at once.
    group.peer_connected("n1", True)
    assert group._wake.is_set()
    group._cycle()
    assert group.raftCurrentTerm == 1 and group.role == raft_group.ROLE_CANDIDATE
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
