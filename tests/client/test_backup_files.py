"""A backup's files: record files with counts and checksums, the manifest written last, verify naming what is wrong."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from mqds.client.core.backup_files import (
    MANIFEST,
    BackupError,
    FileEntry,
    GenerationEntry,
    Manifest,
    Place,
    RecordWriter,
    ShardEntry,
    read_records,
    verify,
)

RECORDS = [(b"m:format", b"\x00\x02"), (b"D" + bytes(12), b"payload"), (b"k", b"")]


def write_file(place: Place, path: str, records: list[tuple[bytes, bytes]], run: str = "r1") -> FileEntry:
    with place.open(path, "wb") as fh:
        writer = RecordWriter(fh)
        writer.write([k for k, _ in records], [v for _, v in records])
    family = path.rsplit("/", 1)[-1].removesuffix(".rec")
    generation = None if family == "default" else GenerationEntry(1, 0, 10, 5, 0)
    return FileEntry(path, family, writer.records, writer.bytes, writer.sha256, run, generation)


def backup(tmp_path: Path, n_shards: int = 2) -> tuple[Place, Manifest]:
    place = Place(str(tmp_path / "b"))
    manifest = Manifest(run="r1", created_at_us=1, n_shards=n_shards, settings={"retention": {"defaultS": "60"}})
    for shard in range(n_shards):
        entry = ShardEntry(shard=shard, fence_us=100 + shard, applied_index=7, node="n1")
        entry.files.append(write_file(place, f"data/r1/shard-{shard:04d}/default.rec", RECORDS))
        entry.files.append(write_file(place, f"data/r1/shard-{shard:04d}/gen-00000001.rec", RECORDS[1:]))
        manifest.shards.append(entry)
    place.write_manifest(manifest)
    return place, manifest


def test_records_read_back_as_written_and_the_manifest_round_trips(tmp_path: Path) -> None:
    place, manifest = backup(tmp_path)
    assert Place(place.url).read_manifest() == manifest
    entry = manifest.shards[0].files[0]
    with place.open(entry.path, "rb") as fh:
        assert list(read_records(fh, entry.path)) == RECORDS
    report = verify(place)
    assert report.ok and report.files == 4 and report.records == 2 * (3 + 2)
    assert not place.exists(MANIFEST + ".tmp")


def test_a_changed_byte_a_short_file_and_a_missing_file_are_named(tmp_path: Path) -> None:
    place, manifest = backup(tmp_path)
    flipped, short, gone = (f for _, f in list(manifest.files())[1:])
    data = bytearray(Path(place.path(flipped.path)).read_bytes())
    data[len(data) // 2] ^= 1
    Path(place.path(flipped.path)).write_bytes(bytes(data))
    Path(place.path(short.path)).write_bytes(Path(place.path(short.path)).read_bytes()[:-1])
    Path(place.path(gone.path)).unlink()
    report = verify(place)
    assert not report.ok
    assert report.problems == [
        f"{flipped.path}: SHA-256 {report.problems[0].split('SHA-256 ')[1][:16]}... differs from the manifest's "
        f"{flipped.sha256[:16]}...",
        f"{short.path} is {short.bytes - 1:,} bytes, the manifest says {short.bytes:,}",
        f"{gone.path} is missing",
    ]
    # Sizes only: the flipped byte goes unnoticed, the others not.
    assert len(verify(place, checksums=False).problems) == 2


def test_a_backup_without_its_manifest_or_with_a_damaged_one_is_refused(tmp_path: Path) -> None:
    place, _ = backup(tmp_path)
    text = Path(place.path(MANIFEST)).read_text()
    Path(place.path(MANIFEST)).write_text(text[: len(text) // 2])
    assert verify(place).problems[0].startswith(f"{MANIFEST} is damaged")
    Path(place.path(MANIFEST)).write_text(text.replace('"version": 1', '"version": 9'))
    assert "version 9" in verify(place).problems[0]
    Path(place.path(MANIFEST)).unlink()
    (problem,) = verify(place).problems
    assert "no manifest.json" in problem and "did not finish" in problem
    with pytest.raises(BackupError, match="no manifest"):
        place.read_manifest()


def test_a_manifest_missing_a_shard_or_its_metadata_is_refused(tmp_path: Path) -> None:
    place, manifest = backup(tmp_path, 3)
    del manifest.shards[1]
    place.write_manifest(manifest)
    assert "missing [1]" in verify(place).problems[0]
    place, manifest = backup(tmp_path / "x", 2)
    del manifest.shards[0].files[0]
    place.write_manifest(manifest)
    assert "shard 0 has no metadata file" in verify(place).problems[0]


def test_a_record_file_cut_in_a_record_or_of_another_kind_is_refused() -> None:
    buffer = io.BytesIO()
    writer = RecordWriter(buffer)
    writer.write([b"key"], [b"value"])
    data = buffer.getvalue()
    with pytest.raises(BackupError, match="ends in the middle of a record"):
        list(read_records(io.BytesIO(data[:-2]), "f"))
    with pytest.raises(BackupError, match="not an mqds record file"):
        list(read_records(io.BytesIO(b"PK\x03\x04" + data), "f"))


def test_files_no_manifest_names_are_removed(tmp_path: Path) -> None:
    place, manifest = backup(tmp_path)
    stale = write_file(place, "data/r0/shard-0000/gen-00000009.rec", RECORDS)
    assert place.exists(stale.path)
    assert place.remove_unlisted(manifest) == 1
    assert not place.exists(stale.path) and not place.exists("data/r0") and verify(place).ok


@pytest.mark.parametrize("scheme", ["file://", "memory://"])
def test_a_place_may_be_any_fsspec_url(tmp_path: Path, scheme: str) -> None:
    root = f"{scheme}{tmp_path}/u" if scheme == "file://" else f"memory://mqds-test-{tmp_path.name}"
    place = Place(root)
    manifest = Manifest(run="r1", created_at_us=1, n_shards=1, settings={})
    shard = ShardEntry(shard=0, fence_us=1, applied_index=1, node="n1")
    entry = write_file(place, "data/r1/shard-0000/default.rec", RECORDS)
    shard.files.append(entry)
    manifest.shards.append(shard)
    place.write_manifest(manifest)
    stale = write_file(place, "data/r0/shard-0000/default.rec", RECORDS)
    assert place.remove_unlisted(manifest) == 1 and not place.exists(stale.path)
    report = verify(Place(root))
    assert report.ok and report.records == len(RECORDS)
    with place.open(entry.path, "wb") as fh:
        fh.write(b"MQDSREC1")
    assert verify(Place(root)).problems == [
        f"{entry.path} is 8 bytes, the manifest says {entry.bytes:,}",
    ]
