"""The fault filesystem's bookkeeping of unsynced file data, on plain files (no FUSE needed).

A :class:`FileRecord` must turn any sequence of writes, truncates, good and
failed fsyncs into exactly what a disk would hold after a power loss: the
property test drives a real file and a byte-by-byte model of the durable
contents side by side, then restores the file and compares.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from mqds.chaos.faultfs.files import FileRecord

WRITE = st.tuples(st.just("write"), st.integers(0, 48), st.binary(min_size=1, max_size=24))
TRUNCATE = st.tuples(st.just("truncate"), st.integers(0, 64), st.just(b""))
SYNC = st.tuples(st.sampled_from(["fsync", "failed-fsync"]), st.just(0), st.just(b""))
STEPS = st.lists(st.one_of(WRITE, WRITE, TRUNCATE, SYNC), max_size=25)


class Model:
    """What a disk holds, byte by byte: durable contents, and the bytes failed fsyncs lost for good."""

    def __init__(self, initial: bytes) -> None:
        self.live = bytearray(initial)
        self.durable = bytes(initial)
        self.written: set[int] = set()
        self.lost: dict[int, int] = {}

    def write(self, offset: int, data: bytes) -> None:
        if offset > len(self.live):
            self.live.extend(bytes(offset - len(self.live)))
        self.live[offset : offset + len(data)] = data
        for pos in range(offset, offset + len(data)):
            self.written.add(pos)
            self.lost.pop(pos, None)

    def truncate(self, size: int) -> None:
        if size < len(self.live):
            del self.live[size:]
        else:
            self.live.extend(bytes(size - len(self.live)))
        self.written = {p for p in self.written if p < size}

    def fsync(self) -> None:
        out = bytearray(self.live)
        for pos, byte in self.lost.items():
            if pos < len(out):
                out[pos] = byte
        self.durable = bytes(out)
        self.lost = {p: b for p, b in self.lost.items() if p < len(self.live)}
        self.written = set()

    def failed_fsync(self) -> None:
        for pos in self.written:
            self.lost[pos] = self.durable[pos] if pos < len(self.durable) else 0
        self.written = set()


@settings(max_examples=300, deadline=None)
@given(initial=st.binary(max_size=40), steps=STEPS)
def test_a_power_loss_leaves_exactly_what_was_synced(tmp_path_factory, initial: bytes, steps) -> None:  # type: ignore[no-untyped-def]
    where = tmp_path_factory.mktemp("record")
    path = where / "file"
    path.write_bytes(initial)
    model = Model(initial)
    record = FileRecord(1, len(initial), str(where / "undo"))
    fd = os.open(path, os.O_RDWR)
    try:
        for op, offset, data in steps:
            if op == "write":
                record.before_write(fd, offset, len(data))
                os.pwrite(fd, data, offset)
                model.write(offset, data)
            elif op == "truncate":
                record.before_truncate(fd, os.fstat(fd).st_size, offset)
                os.ftruncate(fd, offset)
                model.truncate(offset)
            elif op == "fsync":
                record.commit(os.fstat(fd).st_size)
                model.fsync()
            else:
                record.fail()
                model.failed_fsync()
            assert os.pread(fd, 1 << 16, 0) == bytes(model.live)
        record.restore(fd)
        assert os.pread(fd, 1 << 16, 0) == model.durable
    finally:
        os.close(fd)
        record.close()


def test_a_torn_write_keeps_a_prefix_of_the_last_run_of_writes(tmp_path: Path) -> None:
    path = tmp_path / "wal"
    path.write_bytes(b"D" * 10)
    record = FileRecord(1, 10, str(tmp_path / "undo"))
    fd = os.open(path, os.O_RDWR)
    try:
        record.before_write(fd, 0, 1)  # an overwrite, then a run of appends
        os.pwrite(fd, b"x", 0)
        for i, chunk in enumerate([b"aaaa", b"bbbb", b"cccc"]):
            record.before_write(fd, 10 + 4 * i, 4)
            os.pwrite(fd, chunk, 10 + 4 * i)
        assert record.last_write == (10, 12)
        # Never nothing, never the whole run.
        assert record.torn_bytes(fd, 22, 0.0) == (10, b"a")
        assert record.torn_bytes(fd, 22, 1.0) == (10, b"aaaabbbbccc")
        tear = record.torn_bytes(fd, 22, 0.5)
        assert tear == (10, b"aaaabb")
        record.restore(fd)
        os.pwrite(fd, tear[1], tear[0])
        assert os.pread(fd, 100, 0) == b"D" * 10 + b"aaaabb"
    finally:
        os.close(fd)
        record.close()
