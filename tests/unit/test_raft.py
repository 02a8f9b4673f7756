"""The replication layer in one process: journal durability, the restricted codec, manifests, placement, groups."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqds.server.cluster import placement
from mqds.server.raft import codec
from mqds.server.raft.group import PeerNode, RaftGroup, RaftTiming, decode_manifest, encode_manifest
from mqds.server.raft.journal import JournalCorrupt, NodeLog

# -- journal -------------------------------------------------------------------


def test_only_synced_changes_survive_and_a_torn_tail_is_cut(tmp_path: Path) -> None:
    log = NodeLog(str(tmp_path))
    j = log.journal(1)
    j.add(b"\x01", 1, 0)
    j.add(b"\x00one", 2, 1)
    j.setCurrentTerm(1, "n2")
    j.sync()
    j.add(b"\x00two", 3, 1)  # never synced: a crash loses it, and nothing was acknowledged for it
    log.close()
    again = NodeLog(str(tmp_path))
    j = again.journal(1)
    assert [e[1] for e in j] == [1, 2]
    assert j.getCurrentTerm() == 1 and j.getVotedForNodeId() == "n2"
    again.close()
    # A record cut in half by a crash during the write.
    (segment,) = tmp_path.glob("wal-*")
    segment.write_bytes(segment.read_bytes() + b"\x30\x00\x00\x00\x01\x00\x00\x00partial")
    third = NodeLog(str(tmp_path))
    j = third.journal(1)
    assert [e[1] for e in j] == [1, 2]
    j.add(b"\x00three", 3, 2)
    j.sync()
    third.close()
    assert [e[1] for e in NodeLog(str(tmp_path)).journal(1)] == [1, 2, 3]


def test_groups_share_the_log_and_keep_their_own_history(tmp_path: Path) -> None:
    log = NodeLog(str(tmp_path))
    a, b = log.journal(1), log.journal(2)
    for i in range(1, 11):
        a.add(b"\x00" + bytes([i]), i, 1)
        b.add(b"\x00b", i, 1)
    a.sync()
    b.sync()
    a.deleteEntriesFrom(7)  # entries 8.. rejected by a new leader
    a.add(b"\x00new", 8, 2)
    a.deleteEntriesTo(3)  # compacted after a snapshot at index 4
    a.set_members(["n2", "n1"])
    a.sync()
    b.clear()
    b.add(b"\x01", 20, 3)
    b.sync()
    assert [e[1] for e in a] == [4, 5, 6, 7, 8]
    assert a.size_bytes == sum(len(e[0]) for e in a)
    log.close()
    again = NodeLog(str(tmp_path))
    a, b = again.journal(1), again.journal(2)
    assert [(e[1], e[2]) for e in a] == [(4, 1), (5, 1), (6, 1), (7, 1), (8, 2)]
    assert a[-1][0] == b"\x00new" and a.members == ["n1", "n2"]
    assert [e[1] for e in b] == [20]
    again.drop_group(2)
    again.close()
    assert len(NodeLog(str(tmp_path)).journal(2)) == 0


def test_a_new_segment_keeps_every_groups_live_state(tmp_path: Path) -> None:
    log = NodeLog(str(tmp_path), segment_bytes=2000)
    journals = [log.journal(g) for g in range(3)]
    for i in range(1, 60):
        for g, j in enumerate(journals):
            j.add(b"\x00" + bytes([g]) * 50, i, 1)
            if i % 10 == 0:
                j.deleteEntriesTo(len(j) - 3)
            j.setCurrentTerm(1, f"n{g}")
            j.sync()
    expected = [[e[1] for e in j] for j in journals]
    assert log.flushes < 3 * 59 + 1
    segments = list(tmp_path.glob("wal-*"))
    assert len(segments) == 1 and int(segments[0].name[4:]) > 1, "old segments are deleted"
    log.close()
    again = NodeLog(str(tmp_path))
    for g in range(3):
        j = again.journal(g)
        assert [e[1] for e in j] == expected[g]
        assert j.getVotedForNodeId() == f"n{g}"


def test_damage_in_the_middle_of_the_log_refuses_to_start(tmp_path: Path) -> None:
    log = NodeLog(str(tmp_path))
    j = log.journal(1)
    for i in range(1, 5):
        j.add(b"\x00cmd", i, 1)
    j.sync()
    log.close()
    (segment,) = tmp_path.glob("wal-*")
    (tmp_path / "wal-00000002").write_bytes(b"MQDSWAL1")  # a later segment: the damage is not at the end
    raw = bytearray(segment.read_bytes())
    raw[20] ^= 0xFF
    segment.write_bytes(bytes(raw))
    with pytest.raises(JournalCorrupt, match="damaged record"):
        NodeLog(str(tmp_path))


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

    def apply(self, command: bytes, index: int) -> Any:
        self.applied.append((index, command))
        self.applied_index = index
        return index

    def snapshot(self) -> bytes:
        return b""

    def install(self, payload: bytes, index: int, source: str, members: list[str]) -> None:
        raise AssertionError("not used")


class _Outbox:
    def __init__(self) -> None:
        self.sent: list[tuple[int, str, dict[str, Any]]] = []

    def send(self, group: int, messages: list[tuple[str, bytes]]) -> None:
        self.sent.extend((group, node, codec.decode(raw)) for node, raw in messages)

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


def test_messages_from_non_members_cannot_disturb_the_group(tmp_path: Path) -> None:
    group, _, outbox = _group(tmp_path, ["n1", "n2", "n3"])
    group.deliver("intruder", {"type": "request_vote", "term": 99, "last_log_index": 50, "last_log_term": 50}, 0)
    group._cycle()
    assert group.raftCurrentTerm == 0
    assert group.dropped_messages == 1
    assert not [m for _, node, m in outbox.sent if node == "intruder"]
    group.stop()
