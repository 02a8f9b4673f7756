"""The node's write-ahead log (``NodeLog``, ``RaftJournal``): durability, segments, replay and damage."""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqds.server.raft import journal as journal_mod
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
