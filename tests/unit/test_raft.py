"""The replication layer in one process: journal durability, the restricted codec, manifests, placement, groups."""

from __future__ import annotations

import itertools
import os
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
from mqds.server.raft import journal as journal_mod
from mqds.server.raft.group import Outgoing, PeerNode, RaftGroup, RaftTiming, decode_manifest, encode_manifest
from mqds.server.raft.journal import JournalCorrupt, NodeLog
from mqds.server.raft.timing import IDLE_KEEP_BYTES, IdleLog
from mqds.server.raft.transport import FrameQueue

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


def test_groups_syncing_at_once_share_flushes_and_all_their_records_survive(tmp_path: Path) -> None:
    log = NodeLog(str(tmp_path))
    journals = [log.journal(g) for g in range(8)]

    def write(j: Any) -> None:
        for i in range(1, 41):
            j.add(b"\x00" + bytes([j.group]) * 20, i, 1)
            j.sync()

    threads = [threading.Thread(target=write, args=(j,)) for j in journals]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    # One flush covered several groups' syncs (the thread that writes takes what the others queued).
    assert sum(j.syncs for j in journals) == 8 * 40
    assert log.flushes < 8 * 40
    log.close()
    again = NodeLog(str(tmp_path))
    for g in range(8):
        assert [e[1] for e in again.journal(g)] == list(range(1, 41))


def test_a_failed_log_write_fails_every_sync_after_it_and_hangs_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = NodeLog(str(tmp_path))
    told: list[BaseException] = []
    log.on_failure = told.append  # the node's disk guard
    a, b = log.journal(1), log.journal(2)
    a.add(b"\x00kept", 1, 1)
    a.sync()
    assert told == [] and log.failure is None

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(journal_mod.os, "fdatasync", broken)
    a.add(b"\x00lost", 2, 1)
    with pytest.raises(OSError, match="Input/output error"):
        a.sync()
    monkeypatch.undo()
    assert [str(err) for err in told] == ["[Errno 5] Input/output error"] and log.failure is told[0]
    log.fail(OSError(28, "No space left on device"))  # a later failure elsewhere: told once only
    assert len(told) == 1
    # The disk's state is unknown from here on: nothing is promised durable again.
    b.add(b"\x00later", 1, 1)
    with pytest.raises(OSError, match="writing the Raft log failed"):
        b.sync()
    log.close()
    assert NodeLog(str(tmp_path)).journal(1)[0][0] == b"\x00kept"


def test_closing_the_log_writes_the_syncs_still_waiting_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = NodeLog(str(tmp_path))
    a, b = log.journal(1), log.journal(2)
    flush = journal_mod.os.fdatasync
    in_flush = threading.Event()

    def slow(fd: int) -> None:
        in_flush.set()
        time.sleep(0.3)
        flush(fd)

    monkeypatch.setattr(journal_mod.os, "fdatasync", slow)
    a.add(b"\x00first", 1, 1)
    first = threading.Thread(target=a.sync)
    first.start()
    assert in_flush.wait(5)
    b.add(b"\x00second", 1, 1)
    second = threading.Thread(target=b.sync)  # queued behind the write in progress
    second.start()
    time.sleep(0.05)
    log.close()
    first.join(5)
    second.join(5)
    assert not first.is_alive() and not second.is_alive()
    again = NodeLog(str(tmp_path))
    assert again.journal(1)[0][0] == b"\x00first"
    assert again.journal(2)[0][0] == b"\x00second"


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
    numbers = sorted(int(p.name[4:]) for p in tmp_path.glob("wal-*"))
    # Older segments go once every entry in them was compacted (here up to 13
    # live entries a group, spread over the last few small segments).
    assert numbers[0] > 1 and len(numbers) <= 3 < numbers[-1], numbers
    log.close()
    again = NodeLog(str(tmp_path))
    for g in range(3):
        j = again.journal(g)
        assert [e[1] for e in j] == expected[g]
        assert j.getVotedForNodeId() == f"n{g}"


def test_a_new_segment_copies_only_small_logs_and_old_ones_go_once_compacted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_mod, "COPY_BYTES", 150)
    log = NodeLog(str(tmp_path), segment_bytes=4000)
    busy, pinned, small = log.journal(1), log.journal(2), log.journal(3)
    pinned.add(b"\x00" + bytes(200), 1, 1)  # over COPY_BYTES, never compacted: keeps the first segment
    pinned.setCurrentTerm(1, "n1")
    pinned.sync()
    small.add(b"\x00small", 1, 1)  # copied into every new segment
    small.sync()
    for i in range(1, 200):
        busy.add(b"\x00" + bytes(100), i, 1)
        busy.sync()
    segments = sorted(tmp_path.glob("wal-*"))
    assert len(segments) > 3, "the busy group filled several segments"
    # A new segment starts with each group's state and the small group's entry, not the busy group's entries.
    assert all(p.stat().st_size < 4000 + 200 for p in segments)
    assert segments[0].name == "wal-00000001", "the pinned group's live entry is in the first segment"
    # The busy group compacts: nothing goes while the pinned group's entry is live...
    busy.deleteEntriesTo(len(busy) - 5)
    busy.add(b"\x00more", 200, 1)
    busy.sync()
    assert sorted(tmp_path.glob("wal-*"))[0].name == "wal-00000001"
    # ...and once it is compacted too, every segment before the active one goes.
    pinned.deleteEntriesTo(1)
    pinned.add(b"\x00" + bytes(200), 2, 1)
    pinned.sync()
    busy.add(b"\x00last", 201, 1)
    busy.sync()
    left = sorted(tmp_path.glob("wal-*"))
    assert len(left) <= 2 and left[0].name != "wal-00000001", [p.name for p in left]
    expected = {g: [(e[1], e[0]) for e in j] for g, j in ((1, busy), (2, pinned), (3, small))}
    log.close()
    again = NodeLog(str(tmp_path))
    reopened = {g: again.journal(g) for g in (1, 2, 3)}
    for g in (1, 2, 3):
        assert [(e[1], e[0]) for e in reopened[g]] == expected[g]
    assert reopened[2].getVotedForNodeId() == "n1"
    again.close()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="tells files apart by /proc/self/fd")
def test_dropped_segments_leave_the_log_at_once_and_are_deleted_a_few_mib_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleting a whole 256 MiB segment inside a log write stalled every group of the node 90-155 ms."""
    monkeypatch.setattr(journal_mod, "_REAP_STEP_BYTES", 1000)
    monkeypatch.setattr(journal_mod, "_REAP_PAUSE_S", 0.0)
    cuts: list[int] = []
    real_ftruncate = os.ftruncate

    def ftruncate(fd: int, size: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):  # not other tests' reapers
            cuts.append(size)
        real_ftruncate(fd, size)

    monkeypatch.setattr(journal_mod.os, "ftruncate", ftruncate)
    log = NodeLog(str(tmp_path), segment_bytes=4000)
    busy = log.journal(1)
    for i in range(1, 120):
        busy.add(b"\x00" + bytes(100), i, 1)
        if len(busy) > 10:
            busy.deleteEntriesTo(len(busy) - 5)  # compacted as it goes: old segments die
        busy.sync()
    log._reaper.wait_idle(10)
    live = sorted(p.name for p in tmp_path.glob("wal-*"))
    assert len(live) <= 2, live
    assert not list((tmp_path / journal_mod.DEAD_DIR).iterdir()), "every dropped segment was deleted"
    assert log._reaper.deleted >= 3
    # Each was cut down in steps (of 1,000 bytes here), never freed whole.
    assert len(cuts) >= 4 * log._reaper.deleted
    assert cuts.count(0) == log._reaper.deleted
    assert all(before - after <= 1000 for before, after in itertools.pairwise(cuts) if after < before)
    expected = [(e[1], e[0]) for e in busy]
    log.close()
    again = NodeLog(str(tmp_path))
    assert [(e[1], e[0]) for e in again.journal(1)] == expected
    again.close()


def test_a_dead_segment_left_by_a_crash_is_never_read_and_is_deleted_on_open(tmp_path: Path) -> None:
    log = NodeLog(str(tmp_path))
    journal = log.journal(1)
    journal.add(b"\x00kept", 1, 1)
    journal.sync()
    log.close()
    # A crash while the reaper was cutting a dropped segment down: half of it is left.
    (tmp_path / journal_mod.DEAD_DIR).mkdir()
    (tmp_path / journal_mod.DEAD_DIR / "wal-00000000").write_bytes(b"MQDSWAL1" + b"\xff" * 500)
    again = NodeLog(str(tmp_path))
    assert [e[0] for e in again.journal(1)] == [b"\x00kept"]
    assert again._reaper.wait_idle(10)
    assert not list((tmp_path / journal_mod.DEAD_DIR).iterdir())
    again.close()


def test_an_idle_group_does_not_keep_old_segments(tmp_path: Path) -> None:
    log = NodeLog(str(tmp_path), segment_bytes=4000)
    busy, idle = log.journal(1), log.journal(2)
    idle.add(b"\x00idle", 1, 1)
    idle.add(b"\x00idle too", 2, 1)
    idle.sync()
    for i in range(1, 200):
        busy.add(b"\x00" + bytes(100), i, 1)
        if i % 20 == 0:
            busy.deleteEntriesTo(len(busy) - 2)
        busy.sync()
    # The idle group's two entries are copied into each new segment, so the
    # old ones go as the busy group compacts.
    assert len(list(tmp_path.glob("wal-*"))) <= 3
    log.close()
    again = NodeLog(str(tmp_path))
    assert [e[0] for e in again.journal(2)] == [b"\x00idle", b"\x00idle too"]
    again.close()


def test_a_log_whose_groups_all_compacted_starts_a_segment_early_and_gives_back_the_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node whose traffic stopped kept up to a whole segment (256 MiB) of dead entries; now it starts a new one."""
    monkeypatch.setattr(journal_mod, "EARLY_ROLL_BYTES", 20_000, raising=False)
    log = NodeLog(str(tmp_path), copy_bytes=1_000)  # segments of the default size: never full here
    a, b = log.journal(1), log.journal(2)
    for i in range(1, 200):
        for j in (a, b):
            j.add(b"\x00" + bytes(100), i, 1)
            j.sync()
    assert [p.name for p in tmp_path.glob("wal-*")] == ["wal-00000001"]
    a.deleteEntriesTo(len(a) - 2)  # one group compacted, the other still holds 20 KB: nothing to do yet
    a.setCurrentTerm(2, "n1")
    a.sync()
    assert [p.name for p in tmp_path.glob("wal-*")] == ["wal-00000001"]
    b.deleteEntriesTo(len(b) - 2)  # now every group's entries fit in the copy: a new segment, the old one goes
    b.sync()
    log._reaper.wait_idle(10)
    left = sorted(tmp_path.glob("wal-*"))
    assert [p.name for p in left] == ["wal-00000002"] and left[0].stat().st_size < 2_000, left
    expected = {g: [(e[1], e[0]) for e in j] for g, j in ((1, a), (2, b))}
    log.close()
    again = NodeLog(str(tmp_path))
    reopened = {g: again.journal(g) for g in (1, 2)}
    for g in (1, 2):
        assert [(e[1], e[0]) for e in reopened[g]] == expected[g]
    assert reopened[1].getVotedForNodeId() == "n1"
    again.close()


_OPS = st.lists(
    st.tuples(
        st.integers(0, 2),  # group
        st.sampled_from(["add", "add", "add", "truncate", "compact", "clear", "sync", "drop", "restart"]),
        st.integers(0, 6),
    ),
    max_size=120,
)


@settings(max_examples=60, deadline=None)
@given(_OPS, st.sampled_from([0, 150, journal_mod.COPY_BYTES]))
def test_whatever_happens_a_restart_rebuilds_every_synced_journal(
    ops: list[tuple[int, str, int]], copy_bytes: int
) -> None:
    """Random appends, truncations, compactions, clears, drops and restarts on small segments.

    With ``copy_bytes`` 0 a new segment copies no group's entries, with the
    default every group's here, and in between some.
    """
    import tempfile

    default = journal_mod.COPY_BYTES
    journal_mod.COPY_BYTES = copy_bytes
    try:
        with tempfile.TemporaryDirectory() as d:
            log = NodeLog(d, segment_bytes=600)
            journals = {g: log.journal(g) for g in range(3)}
            synced: dict[int, list[tuple[int, bytes]]] = {g: [] for g in range(3)}
            for step, (g, op, n) in enumerate(ops):
                j = journals[g]
                if op == "add":
                    nxt = j[-1][1] + 1 if len(j) else 1
                    for k in range(n + 1):
                        j.add(b"\x00" + bytes([step % 256]) * 40, nxt + k, 1)
                elif op == "truncate" and len(j) > n:
                    j.deleteEntriesFrom(n)
                elif op == "compact" and len(j) > n + 1:
                    j.deleteEntriesTo(n + 1)
                elif op == "clear":
                    j.clear()
                elif op == "drop":
                    log.drop_group(g)
                    journals[g] = log.journal(g)
                    synced[g] = []
                    continue
                elif op == "restart":
                    for other in journals.values():
                        other.sync()
                    log.close()
                    log = NodeLog(d, segment_bytes=600)
                    journals = {h: log.journal(h) for h in range(3)}
                    for h in range(3):
                        assert [(e[1], e[0]) for e in journals[h]] == synced[h], (step, h)
                    continue
                j.sync()
                synced[g] = [(e[1], e[0]) for e in j]
            for j in journals.values():
                j.sync()
            expected = {g: [(e[1], e[0]) for e in j] for g, j in journals.items()}
            log.close()
            again = NodeLog(d)
            for g in range(3):
                assert [(e[1], e[0]) for e in again.journal(g)] == expected[g], g
            again.close()
    finally:
        journal_mod.COPY_BYTES = default


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
