"""The chaos suite's fault filesystem (mqds.chaos.faultfs) on a real FUSE mount.

Each test mounts its own filesystem over a backing directory in tmp_path,
does what a program does (open, write, fsync, rename, unlink), injects a
fault through the control socket, and checks what a program sees after it:
what was not synced is gone after a power loss, what was synced is there; a
full disk answers ENOSPC, a failing one EIO, a slow one takes its time; and a
real RocksDB written with sync writes loses nothing it acknowledged. They
need /dev/fuse, libfuse and mfusepy, and are skipped with the reason where
one is missing.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mqds.chaos.faultfs import FaultFs, FaultFsError, unavailable_reason

UNAVAILABLE = unavailable_reason()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no fault filesystem here: {UNAVAILABLE}"),
]


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[FaultFs]:
    with FaultFs(tmp_path / "backing", tmp_path / "mnt") as mounted:
        yield mounted


def put(path: Path, data: bytes, *, sync: bool, append: bool = False) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def test_a_file_written_without_fsync_is_gone_after_a_power_loss(fs: FaultFs) -> None:
    mnt = fs.mountpoint
    put(mnt / "entry-synced", b"hello", sync=False)
    sync_dir(mnt)  # the name is durable, the data is not
    put(mnt / "entry-synced", b" world", sync=False, append=True)
    put(mnt / "never-synced", b"hello", sync=False)
    assert (mnt / "never-synced").read_bytes() == b"hello"
    assert fs.status()["files_with_unsynced_data"] == 2

    report = fs.power_loss()

    assert not (mnt / "never-synced").exists()
    assert (mnt / "entry-synced").read_bytes() == b""
    assert sorted(os.listdir(mnt)) == ["entry-synced"]
    assert report["entries_removed"] == 1 and report["files_reverted"] == 1
    assert fs.status()["files_with_unsynced_data"] == 0


def test_the_status_names_the_entries_no_directory_sync_made_durable(fs: FaultFs) -> None:
    mnt = fs.mountpoint
    (mnt / "sub").mkdir()
    put(mnt / "sub" / "f", b"f", sync=True)
    assert fs.status()["unsynced_entries"] == {
        ".": {"not_durable": ["sub"], "durable_but_gone": []},
        "sub": {"not_durable": ["f"], "durable_but_gone": []},
    }
    sync_dir(mnt / "sub")
    sync_dir(mnt)
    os.unlink(mnt / "sub" / "f")
    assert fs.status()["unsynced_entries"] == {"sub": {"not_durable": [], "durable_but_gone": ["f"]}}


def test_with_journal_metadata_any_sync_makes_every_earlier_name_durable(tmp_path: Path) -> None:
    with FaultFs(tmp_path / "backing", tmp_path / "mnt", metadata="journal") as fs:
        mnt = fs.mountpoint
        (mnt / "db").mkdir()
        put(mnt / "db" / "CURRENT", b"MANIFEST-1", sync=False)
        put(mnt / "other", b"synced", sync=True)  # syncs no directory, but the journal commits every name
        put(mnt / "late", b"after the last sync", sync=False)
        assert fs.status()["metadata"] == "journal"

        fs.power_loss()

        assert sorted(os.listdir(mnt)) == ["db", "other"]
        assert (mnt / "db" / "CURRENT").read_bytes() == b""  # its name is durable, its data never was
        assert (mnt / "other").read_bytes() == b"synced"


def test_the_same_file_written_with_fsync_survives(fs: FaultFs) -> None:
    mnt = fs.mountpoint
    (mnt / "dir").mkdir()
    sync_dir(mnt)
    put(mnt / "dir" / "log", b"first,", sync=True)
    sync_dir(mnt / "dir")
    # An O_APPEND log as the Raft journal writes it: fdatasync after each record; the last one is not synced.
    fd = os.open(mnt / "dir" / "log", os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"second,")
    os.fdatasync(fd)
    os.write(fd, b"third")
    os.close(fd)
    assert (mnt / "dir" / "log").read_bytes() == b"first,second,third"

    fs.power_loss()

    assert (mnt / "dir" / "log").read_bytes() == b"first,second,"
    # Written and synced after the power loss, it stays.
    put(mnt / "dir" / "log", b"third", sync=True, append=True)
    fs.power_loss()
    assert (mnt / "dir" / "log").read_bytes() == b"first,second,third"


def test_a_rename_without_a_directory_fsync_is_undone(fs: FaultFs) -> None:
    mnt = fs.mountpoint
    put(mnt / "state", b"old", sync=True)
    sync_dir(mnt)
    # Replacing a file whole as mqds does (write_atomically), but without the directory's fsync at the end.
    put(mnt / "state.tmp", b"new", sync=True)
    os.replace(mnt / "state.tmp", mnt / "state")
    (mnt / "moved").mkdir()
    os.rename(mnt / "state", mnt / "moved" / "state")
    os.rename(mnt / "moved" / "state", mnt / "state")
    assert (mnt / "state").read_bytes() == b"new"

    fs.power_loss()

    assert (mnt / "state").read_bytes() == b"old"
    assert sorted(os.listdir(mnt)) == ["state"]

    # With the directory synced, the new file is the one that stays.
    put(mnt / "state.tmp", b"new", sync=True)
    os.replace(mnt / "state.tmp", mnt / "state")
    sync_dir(mnt)
    fs.power_loss()
    assert (mnt / "state").read_bytes() == b"new"
    assert sorted(os.listdir(mnt)) == ["state"]
    assert fs.status()["graveyard"] == 0


def test_an_unlink_without_a_directory_fsync_is_undone(fs: FaultFs) -> None:
    mnt = fs.mountpoint
    put(mnt / "a", b"durable a", sync=True)
    put(mnt / "b", b"durable b", sync=True)
    (mnt / "sub").mkdir()
    sync_dir(mnt)
    os.unlink(mnt / "a")
    # Unlinked while open, written on: the node lives on (the graveyard) with its durable contents.
    fd = os.open(mnt / "b", os.O_WRONLY | os.O_APPEND)
    os.unlink(mnt / "b")
    os.write(fd, b" and more")
    os.rmdir(mnt / "sub")
    assert os.listdir(mnt) == []
    assert fs.status()["graveyard"] == 3

    fs.power_loss()

    with pytest.raises(OSError) as dead:
        os.write(fd, b"after the power loss")
    assert dead.value.errno == errno.EIO
    os.close(fd)
    assert (mnt / "a").read_bytes() == b"durable a"
    assert (mnt / "b").read_bytes() == b"durable b"
    assert (mnt / "sub").is_dir()

    os.unlink(mnt / "a")
    sync_dir(mnt)
    fs.power_loss()
    assert sorted(os.listdir(mnt)) == ["b", "sub"]
    assert fs.status()["graveyard"] == 0


def test_hard_links_are_names_like_any_other(fs: FaultFs) -> None:
    mnt = fs.mountpoint
    (mnt / "db").mkdir()
    (mnt / "checkpoint").mkdir()
    put(mnt / "db" / "000011.sst", b"table", sync=True)
    for directory in (mnt, mnt / "db"):
        sync_dir(directory)
    # A checkpoint as RocksDB makes one: the table linked into another directory, synced there.
    os.link(mnt / "db" / "000011.sst", mnt / "checkpoint" / "000011.sst")
    os.link(mnt / "db" / "000011.sst", mnt / "db" / "unsynced-link")
    sync_dir(mnt / "checkpoint")
    os.unlink(mnt / "db" / "000011.sst")  # compacted away, the directory not synced yet
    put(mnt / "db" / "unsynced-link", b" and more", sync=False, append=True)

    fs.power_loss()

    assert sorted(os.listdir(mnt / "db")) == ["000011.sst"]
    assert (mnt / "db" / "000011.sst").read_bytes() == b"table"
    assert (mnt / "db" / "000011.sst").stat().st_ino == (mnt / "checkpoint" / "000011.sst").stat().st_ino
    assert (mnt / "db" / "000011.sst").stat().st_nlink == 2


def test_overwrites_and_truncates_are_undone_and_new_directories_vanish(fs: FaultFs) -> None:
    mnt = fs.mountpoint
    original = bytes(range(256)) * 64
    put(mnt / "data", original, sync=True)
    sync_dir(mnt)
    with open(mnt / "data", "r+b") as fh:
        fh.seek(1000)
        fh.write(b"x" * 3000)
        fh.truncate(5000)
        fh.seek(9000)
        fh.write(b"past the old end" * 1000)
    (mnt / "new" / "deeper").mkdir(parents=True)
    put(mnt / "new" / "deeper" / "f", b"f", sync=True)
    sync_dir(mnt / "new" / "deeper")
    sync_dir(mnt / "new")  # but never the mount's root: new/ itself is not durable

    fs.power_loss()

    assert (mnt / "data").read_bytes() == original
    assert sorted(os.listdir(mnt)) == ["data"]


def test_a_torn_write_leaves_a_prefix_of_the_last_unsynced_write(fs: FaultFs) -> None:
    mnt = fs.mountpoint
    put(mnt / "wal", b"D" * 100, sync=True)
    sync_dir(mnt)
    record = bytes((i * 7) % 251 for i in range(8000))
    put(mnt / "wal", record, sync=False, append=True)

    report = fs.power_loss(torn=True, seed=3)

    data = (mnt / "wal").read_bytes()
    assert report["torn"] == [{"path": "wal", "offset": 100, "kept_bytes": len(data) - 100}]
    assert 100 < len(data) < 100 + len(record)
    assert data == b"D" * 100 + record[: len(data) - 100]
    # Another seed tears it elsewhere; a file not matched by the pattern is cut back whole.
    put(mnt / "wal", record, sync=False, append=True)
    assert fs.power_loss(torn=True, torn_pattern="*.log", seed=3)["torn"] == []
    assert (mnt / "wal").read_bytes() == data


def test_a_full_disk_fails_writes_and_creates_with_enospc_until_lifted(fs: FaultFs) -> None:
    mnt = fs.mountpoint
    put(mnt / "existing", b"e" * 10_000, sync=True)
    limit = fs.disk_full(free_bytes=4096)
    assert limit == {"limit_bytes": 14_096, "used_bytes": 10_000}
    assert os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize <= 4096

    fd = os.open(mnt / "existing", os.O_WRONLY)
    try:
        os.pwrite(fd, b"a" * 4096, 10_000)  # exactly fills it
        with pytest.raises(OSError) as full:
            os.pwrite(fd, b"b", 14_096)
        assert full.value.errno == errno.ENOSPC
        os.pwrite(fd, b"overwriting needs no new space", 0)
        with pytest.raises(OSError) as full:
            os.open(mnt / "new-file", os.O_WRONLY | os.O_CREAT, 0o644)
        assert full.value.errno == errno.ENOSPC
        with pytest.raises(OSError) as full:
            os.mkdir(mnt / "new-dir")
        assert full.value.errno == errno.ENOSPC
        # Cutting makes room.
        os.ftruncate(fd, 10_000)
        os.pwrite(fd, b"c" * 4000, 10_000)
        assert fs.status()["faults"]["counts"]["enospc"] == 3

        fs.heal()
        os.pwrite(fd, b"d" * 100_000, 14_000)
    finally:
        os.close(fd)
    put(mnt / "new-file", b"fine", sync=True)
    assert (mnt / "existing").stat().st_size == 114_000
    assert fs.status()["used_bytes"] == 114_004


def test_io_errors_on_chosen_files_until_lifted(fs: FaultFs) -> None:
    mnt = fs.mountpoint
    put(mnt / "seg.log", b"log", sync=True)
    put(mnt / "table.sst", b"sst", sync=True)
    sync_dir(mnt)
    fs.fail("*.log", ops=["write"])
    fs.fail("*.sst", ops=["read"])

    fd = os.open(mnt / "seg.log", os.O_WRONLY | os.O_APPEND)
    try:
        with pytest.raises(OSError) as failed:
            os.write(fd, b"more")
        assert failed.value.errno == errno.EIO
        with pytest.raises(OSError) as failed:
            (mnt / "table.sst").read_bytes()
        assert failed.value.errno == errno.EIO
        assert (mnt / "seg.log").read_bytes() == b"log"
        put(mnt / "other", b"unaffected", sync=True)
        counts = fs.status()["faults"]["counts"]
        # The kernel tries a failed read again, a page at a time.
        assert counts["eio_write"] == 1 and counts["eio_read"] >= 1

        fs.heal()
        os.write(fd, b"more")
    finally:
        os.close(fd)
    assert (mnt / "table.sst").read_bytes() == b"sst"


def test_a_failed_fsync_loses_its_data_even_when_a_later_fsync_succeeds(fs: FaultFs) -> None:
    mnt = fs.mountpoint
    put(mnt / "journal", b"synced|", sync=True)
    sync_dir(mnt)
    fs.fail("journal", ops=["fsync"])
    fd = os.open(mnt / "journal", os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"lost|")
    with pytest.raises(OSError) as failed:
        os.fdatasync(fd)
    assert failed.value.errno == errno.EIO
    fs.heal()
    # Retrying the fsync "succeeds", as on Linux, but the failed writeback's pages are not written again.
    os.write(fd, b"after|")
    os.fsync(fd)
    os.close(fd)
    assert fs.status()["bytes_lost_to_failed_syncs"] == 5

    fs.power_loss()

    assert (mnt / "journal").read_bytes() == b"synced|" + bytes(5) + b"after|"


def test_a_slow_disk_delays_every_fsync(fs: FaultFs) -> None:
    mnt = fs.mountpoint
    fd = os.open(mnt / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"x")
    fs.slow(0.3)
    timings = []
    for sync in (os.fsync, os.fdatasync):
        start = time.monotonic()
        sync(fd)
        timings.append(time.monotonic() - start)
    start = time.monotonic()
    sync_dir(mnt)
    timings.append(time.monotonic() - start)
    fs.heal()
    start = time.monotonic()
    os.fsync(fd)
    fast = time.monotonic() - start
    os.close(fd)
    assert all(0.3 <= t < 2.0 for t in timings), timings
    assert fast < 0.2, fast
    assert fs.status()["faults"]["counts"]["delayed_syncs"] == 3


def test_bad_commands_are_refused(fs: FaultFs) -> None:
    with pytest.raises(FaultFsError, match="unknown command"):
        fs.call("format-the-disk")
    with pytest.raises(FaultFsError, match="operations must be some of"):
        fs.fail("*", ops=["unlink"])
    with pytest.raises(FaultFsError, match="needs limit_bytes or free_bytes"):
        fs.disk_full()


def test_unmounting_leaves_the_live_files_in_the_backing_directory(tmp_path: Path) -> None:
    fs = FaultFs(tmp_path / "backing", tmp_path / "mnt").mount()
    try:
        put(fs.mountpoint / "unsynced", b"still here", sync=False)
    finally:
        fs.unmount()
    assert not fs.mounted()
    assert (tmp_path / "backing" / "unsynced").read_bytes() == b"still here"
    assert not fs.state_dir.exists()


# A RocksDB that writes with sync=True, each key printed once its write returned (acknowledged); small
# memtables, so tables are flushed and compacted (new files, the MANIFEST, CURRENT renamed) as it goes.
ROCKSDB_WRITER = """
import sys
from rocksdict import Options, Rdict, WriteOptions
opts = Options(raw_mode=True)
opts.create_if_missing(True)
opts.set_write_buffer_size(64 * 1024)
db = Rdict(sys.argv[1], opts)
sync = WriteOptions()
sync.sync = True
start = int(sys.argv[2])
for i in range(start, start + 100_000):
    db.put(b"key%08d" % i, b"value%08d" % i * 20, sync)
    print(i, flush=True)
"""

ROCKSDB_READER = """
import sys
from rocksdict import Options, Rdict
db = Rdict(sys.argv[1], Options(raw_mode=True))
count = 0
for i in range(int(sys.argv[2])):
    assert db.get(b"key%08d" % i) == b"value%08d" % i * 20, i
    count += 1
print(count, sum(1 for _ in db.keys()))
db.close()
"""


def _write_until(db: Path, start: int, acked: int) -> int:
    """Run the writer until ``acked`` keys were acknowledged, then kill -9 it; the last key acknowledged."""
    writer = subprocess.Popen(
        [sys.executable, "-c", ROCKSDB_WRITER, str(db), str(start)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout is not None
    last = -1
    for line in writer.stdout:
        last = int(line)
        if last >= start + acked - 1:
            break
    writer.kill()
    writer.wait()
    return last


def test_rocksdb_loses_no_synced_write_to_a_power_loss(fs: FaultFs) -> None:
    db = fs.mountpoint / "db"
    # RocksDB syncs its directory, not the one above it: the directory's own name is the caller's to sync.
    db.mkdir()
    sync_dir(fs.mountpoint)
    last = _write_until(db, 0, 1500)
    assert fs.status()["files_with_unsynced_data"] > 0
    report = fs.power_loss(torn=True, seed=11)
    assert report["files_reverted"] + report["entries_removed"] > 0, report
    # Opened again, written again (on what the power loss left), lost power again.
    last = _write_until(db, last + 1, 1500)
    fs.power_loss(torn=True, seed=12)

    reader = subprocess.run(
        [sys.executable, "-c", ROCKSDB_READER, str(db), str(last + 1)], capture_output=True, text=True, timeout=60
    )
    assert reader.returncode == 0, reader.stderr[-3000:]
    found, total = map(int, reader.stdout.split())
    assert found == last + 1 and total >= found
    assert any(name.endswith(".sst") for name in os.listdir(db)), "no table was flushed: the test tests less"
