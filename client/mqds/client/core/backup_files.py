"""A backup's place: its record files, their checksums and the manifest that lists them.

A backup (``mqds backup --to PLACE``) is a directory, or any fsspec URL::

    PLACE/manifest.json                               written last, atomically (by rename)
    PLACE/data/<run>/shard-NNNN/default.rec           a shard's metadata family
    PLACE/data/<run>/shard-NNNN/gen-NNNNNNNN.rec      one generation's messages

``<run>`` names the backup run that wrote the file: an incremental backup
into the same place lists files of earlier runs for the closed generations
it did not copy again, and writes its own files beside them, so a run that
fails half-way leaves the previous manifest and every file it names as they
were. Files no manifest names any more are removed after the new manifest
is in place.

A record file is ``MQDSREC1`` and then, per record, a u32 key length, the
key, a u32 value length and the value (big-endian). The manifest gives each
file's record count, size and SHA-256; a backup without a manifest (one
interrupted before its end) is not a backup, and :func:`verify` names every
file that is missing, of the wrong size or whose checksum differs.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import IO, Any

MAGIC = b"MQDSREC1"
FORMAT = "mqds-backup"
VERSION = 1
MANIFEST = "manifest.json"
_LEN = struct.Struct(">I")
_READ_BYTES = 1024 * 1024


class BackupError(Exception):
    """A backup that cannot be used (or written): the message says what is wrong, naming the file."""


@dataclass(frozen=True)
class GenerationEntry:
    """A generation as the backup holds it (its identity: a closed one with the same is not copied again)."""

    generation: int
    since_us: int
    until_us: int
    """0: the generation was open at the fence."""
    created_at_us: int
    changes: int


@dataclass
class FileEntry:
    """One record file of a backup."""

    path: str
    """Relative to the backup's place, with ``/``."""
    column_family: str
    records: int
    bytes: int
    sha256: str
    run: str
    """The backup run that wrote it."""
    generation: GenerationEntry | None = None


@dataclass
class ShardEntry:
    """One shard of a backup: where it was cut and its files (``default`` first, then generations in order)."""

    shard: int
    fence_us: int
    applied_index: int
    node: str
    files: list[FileEntry] = field(default_factory=list)


@dataclass
class Manifest:
    """What a backup holds; the last file a backup writes."""

    run: str
    created_at_us: int
    n_shards: int
    settings: dict[str, Any]
    """The cluster map's settings: ``retention`` (a RetentionPolicy as JSON, absent when none was set)."""
    shards: list[ShardEntry] = field(default_factory=list)
    format: str = FORMAT
    version: int = VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST) -> Manifest:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise BackupError(f"{where} is not an mqds backup manifest (format {raw.get('format')!r})")
            if raw.get("version") != VERSION:
                raise BackupError(f"{where} has version {raw.get('version')!r}; this mqds reads version {VERSION}")
            shards = [
                ShardEntry(
                    shard=int(s["shard"]),
                    fence_us=int(s["fence_us"]),
                    applied_index=int(s["applied_index"]),
                    node=str(s["node"]),
                    files=[
                        FileEntry(
                            path=str(f["path"]),
                            column_family=str(f["column_family"]),
                            records=int(f["records"]),
                            bytes=int(f["bytes"]),
                            sha256=str(f["sha256"]),
                            run=str(f["run"]),
                            generation=GenerationEntry(**f["generation"]) if f.get("generation") else None,
                        )
                        for f in s["files"]
                    ],
                )
                for s in raw["shards"]
            ]
            return cls(
                run=str(raw["run"]),
                created_at_us=int(raw["created_at_us"]),
                n_shards=int(raw["n_shards"]),
                settings=dict(raw.get("settings") or {}),
                shards=shards,
            )
        except BackupError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise BackupError(f"{where} is damaged: {type(err).__name__}: {err}") from None

    def files(self) -> Iterator[tuple[ShardEntry, FileEntry]]:
        for shard in self.shards:
            for entry in shard.files:
                yield shard, entry

    def check_complete(self) -> None:
        """Refuse a manifest that does not list every shard once, each with its metadata file first."""
        numbers = sorted(s.shard for s in self.shards)
        if numbers != list(range(self.n_shards)):
            missing = sorted(set(range(self.n_shards)) - set(numbers))
            raise BackupError(
                f"{MANIFEST} lists shards {numbers[:10]}{'...' if len(numbers) > 10 else ''} of {self.n_shards}: "
                f"{'missing ' + str(missing[:10]) if missing else 'a shard twice or out of range'}"
            )
        for s in self.shards:
            if not s.files or s.files[0].column_family != "default":
                raise BackupError(f"{MANIFEST}: shard {s.shard} has no metadata file (default)")


class Place:
    """A backup's place: a directory or an fsspec URL."""

    def __init__(self, url: str) -> None:
        import fsspec  # here: it takes a good part of a second to import, and most clients never back up

        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)

    def path(self, relative: str) -> str:
        return posixpath.join(self.root, relative)

    def exists(self, relative: str) -> bool:
        return bool(self.fs.exists(self.path(relative)))

    def open(self, relative: str, mode: str) -> IO[Any]:
        if "w" in mode:
            self.fs.makedirs(posixpath.dirname(self.path(relative)), exist_ok=True)
        handle: IO[Any] = self.fs.open(self.path(relative), mode)
        return handle

    def read_manifest(self) -> Manifest:
        if not self.exists(MANIFEST):
            raise BackupError(
                f"{self.url} has no {MANIFEST}: not a backup, or one that did not finish (the manifest is written last)"
            )
        with self.open(MANIFEST, "rb") as fh:
            text = fh.read().decode("utf-8", errors="replace")
        return Manifest.from_json(text)

    def write_manifest(self, manifest: Manifest) -> None:
        """Write the manifest under a temporary name, then rename it into place."""
        tmp = MANIFEST + ".tmp"
        with self.open(tmp, "wb") as fh:
            fh.write(manifest.to_json().encode("utf-8"))
        self.fs.mv(self.path(tmp), self.path(MANIFEST))

    def remove_unlisted(self, manifest: Manifest) -> int:
        """Remove the record files under ``data/`` the manifest does not name; how many."""
        listed = {self.path(f.path) for _, f in manifest.files()}
        data = self.path("data")
        if not self.fs.exists(data):
            return 0
        removed = 0
        for found in self.fs.find(data):
            if found.rstrip("/") not in listed:
                self.fs.rm(found)
                removed += 1
        for run_dir in self.fs.ls(data, detail=False):  # the directories of runs no file is left of
            if not any(path.startswith(run_dir.rstrip("/") + "/") for path in listed):
                self.fs.rm(run_dir, recursive=True)
        return removed


class RecordWriter:
    """Writes one record file, counting its records and hashing its bytes as they go."""

    def __init__(self, fh: IO[bytes]) -> None:
        self._fh = fh
        self._hash = hashlib.sha256()
        self.records = 0
        self.bytes = 0
        self._put(MAGIC)

    def _put(self, data: bytes) -> None:
        self._fh.write(data)
        self._hash.update(data)
        self.bytes += len(data)

    def write(self, keys: list[bytes], values: list[bytes]) -> None:
        parts = []
        for key, value in zip(keys, values, strict=True):
            parts += [_LEN.pack(len(key)), key, _LEN.pack(len(value)), value]
        self._put(b"".join(parts))
        self.records += len(keys)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()


def read_records(fh: IO[bytes], where: str) -> Iterator[tuple[bytes, bytes]]:
    """The records of a record file, in order; BackupError when it is not one or ends short."""
    if fh.read(len(MAGIC)) != MAGIC:
        raise BackupError(f"{where} is not an mqds record file")
    while True:
        head = fh.read(4)
        if not head:
            return
        key = _exact(fh, _LEN.unpack(_exact(fh, 4, where, head))[0], where)
        value = _exact(fh, _LEN.unpack(_exact(fh, 4, where))[0], where)
        yield key, value


def _exact(fh: IO[bytes], n: int, where: str, start: bytes = b"") -> bytes:
    data = start + fh.read(n - len(start))
    if len(data) != n:
        raise BackupError(f"{where} ends in the middle of a record")
    return data


@dataclass
class VerifyReport:
    """What :func:`verify` found: the manifest, and every problem (none: the backup is whole)."""

    manifest: Manifest | None
    problems: list[str]
    files: int = 0
    bytes: int = 0
    records: int = 0

    @property
    def ok(self) -> bool:
        return self.manifest is not None and not self.problems


def verify(place: Place, *, checksums: bool = True) -> VerifyReport:
    """Check a backup: its manifest, every file it names there with its size, and (``checksums``) their SHA-256."""
    try:
        manifest = place.read_manifest()
        manifest.check_complete()
    except BackupError as err:
        return VerifyReport(None, [str(err)])
    report = VerifyReport(manifest, [])
    for _, entry in manifest.files():
        report.files += 1
        report.bytes += entry.bytes
        report.records += entry.records
        problem = check_file(place, entry, checksums)
        if problem:
            report.problems.append(problem)
    return report


def verify_place(url: str, *, checksums: bool = True) -> VerifyReport:
    """Check the backup at ``url`` (a directory or fsspec URL) without restoring it: see :func:`verify`."""
    return verify(Place(url), checksums=checksums)


def check_file(place: Place, entry: FileEntry, checksum: bool) -> str | None:
    """What is wrong with one file of a backup, or None."""
    if not place.exists(entry.path):
        return f"{entry.path} is missing"
    size = int(place.fs.size(place.path(entry.path)))
    if size != entry.bytes:
        return f"{entry.path} is {size:,} bytes, the manifest says {entry.bytes:,}"
    if not checksum:
        return None
    digest = hashlib.sha256()
    with place.open(entry.path, "rb") as fh:
        while chunk := fh.read(_READ_BYTES):
            digest.update(chunk)
    if digest.hexdigest() != entry.sha256:
        return f"{entry.path}: SHA-256 {digest.hexdigest()[:16]}... differs from the manifest's {entry.sha256[:16]}..."
    return None
