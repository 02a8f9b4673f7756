"""A Raft group in one process: peers, durability before acknowledgement, strangers, and apply.

The node's write-ahead log has its own file (test_raft_journal.py); elections and the timing of
messages test_raft_timing.py; leadership handed over test_raft_leadership.py; the codec,
manifests and placement test_raft_codec.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from raft_support import make_group

from mqds.protocol.errors import MqdsError, Reason
from mqds.server.raft import codec
from mqds.server.raft.group import PeerNode, RaftGroup, encode_manifest


def test_a_follower_connects_to_a_member_added_by_the_leader(tmp_path: Path) -> None:
    group, _, _ = make_group(tmp_path, ["n1", "n2", "n3"])
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
    assert PeerNode("n4") in group.raft.connected
    group.stop()


def test_entries_are_durable_before_the_acknowledgement_leaves(tmp_path: Path) -> None:
    group, machine, outbox = make_group(tmp_path, ["n1", "n2", "n3"])
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
    group, machine, outbox = make_group(tmp_path, ["n1", "n2", "n3"])
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
    group, _, outbox = make_group(tmp_path, ["n1", "n2", "n3"])
    group.deliver("intruder", {"type": "request_vote", "term": 99, "last_log_index": 50, "last_log_term": 50}, 0)
    group._cycle()
    assert group.raft.term == 0
    assert group.dropped_messages == 1
    assert not [m for _, node, m in outbox.sent if node == "intruder"]
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
    group, machine, _ = make_group(tmp_path, ["n1", "n2", "n3"])
    no_op = bytes([codec.COMMAND_NO_OP])
    add = bytes([codec.COMMAND_MEMBERSHIP]) + codec.encode_membership(1, "n4")
    _append(group, 1, 1, [(b"\x00a", 2, 1), (no_op, 3, 1), (add, 4, 1), (no_op, 5, 1)])
    _append(group, 5, 5, [])
    assert machine.applied == [(2, b"a")]
    assert machine.skipped == [3, 4, 5]
    assert machine.applied_index == group.raft.last_applied == 5
    group.stop()


def test_a_manifest_written_here_needs_no_snapshot_when_only_entries_without_effect_are_missing(
    tmp_path: Path,
) -> None:
    """Data written before no-ops were recorded: the replica's own manifest is ahead of its storage by
    no-ops only, and it must open without asking for a snapshot (which every replica would refuse)."""
    group, machine, _ = make_group(tmp_path, ["n1", "n2", "n3"])
    machine.applied_index = 9
    manifest = tmp_path / "own"
    no_op = bytes([codec.COMMAND_NO_OP])
    manifest.write_bytes(encode_manifest(0, "n3", (no_op, 12, 3), (no_op, 11, 2), ["n1", "n2", "n3"], b""))
    last, _, _ = group._manifests.read(str(manifest))
    assert last[1] == 12 and machine.applied_index == 12 and machine.skipped == [12]
    # One another replica sent, or a storage that holds nothing: the state must come from a snapshot.
    for source, applied in (("n1", 9), ("n3", 0)):
        machine.applied_index = applied
        manifest.write_bytes(encode_manifest(0, source, (no_op, 12, 3), (no_op, 11, 2), ["n1", "n2", "n3"], b""))
        with pytest.raises(AssertionError, match="not used"):
            group._manifests.read(str(manifest))
    group.stop()


def test_an_entry_the_machine_cannot_apply_is_recorded_as_failed_and_the_log_goes_on(tmp_path: Path) -> None:
    """A queue acknowledgement whose filter made the trie match recurse 1,500 deep raised on every replica,
    and the group retried that committed entry forever: the shard was dead for good."""
    group, machine, _ = make_group(tmp_path, ["n1", "n2", "n3"])
    apply = machine.apply

    def apply_or_fail(command: bytes, index: int) -> Any:
        if command == b"poison":
            raise RecursionError("maximum recursion depth exceeded")
        return apply(command, index)

    machine.apply = apply_or_fail  # type: ignore[method-assign]
    _append(group, 1, 1, [(b"\x00a", 2, 1), (b"\x00poison", 3, 1), (b"\x00b", 4, 1)])
    _append(group, 4, 4, [])
    assert machine.applied == [(2, b"a"), (4, b"b")]
    assert machine.skipped == [3] and group.raft.last_applied == 4
    assert group.apply_failures == 1 and group.apply_stalled_s() == 0
    group.stop()


def test_an_entry_the_machine_refuses_without_writing_still_moves_its_applied_index(tmp_path: Path) -> None:
    """A vnode answers some commands with a refusal and writes nothing (a reused producer sequence, a
    generation already dropped): its applied index stayed behind those entries too."""
    group, machine, _ = make_group(tmp_path, ["n1", "n2", "n3"])

    def refuse(command: bytes, index: int) -> Any:
        return MqdsError(Reason.INVALID_REQUEST, "sequence 7 was used for other messages")

    machine.apply = refuse  # type: ignore[method-assign]
    _append(group, 1, 1, [(b"\x00again", 2, 1)])
    _append(group, 2, 2, [])
    assert machine.skipped == [2] and machine.applied_index == group.raft.last_applied == 2
    group.stop()


def test_a_proposer_gets_the_failure_of_an_entry_as_an_error(tmp_path: Path) -> None:
    group, machine, _ = make_group(tmp_path, ["n3"])
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
    group, machine, _ = make_group(tmp_path, ["n1", "n2", "n3"])
    failing = True

    def apply_unless_disk_fails(command: bytes, index: int) -> Any:
        if failing:
            raise MqdsError(Reason.STORAGE_ERROR, "write failed: IO error")
        machine.applied.append((index, command))
        machine.applied_index = index

    machine.apply = apply_unless_disk_fails  # type: ignore[method-assign]
    told: list[BaseException] = []
    group._applier.on_disk_failure = told.append  # the node's disk guard
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
    group._applier.note_progress()
    assert group.raft.last_applied == 1 and machine.skipped == []
    group._applier._applied_moved_at -= 30  # thirty seconds later, still failing
    group._applier.note_progress()
    assert group.apply_stalled_s() >= 30
    failing = False
    group._cycle()
    group._applier.note_progress()
    assert machine.applied == [(2, b"a")] and group.apply_stalled_s() == 0
    group.stop()
