"""What a backup and a restore decide and keep, shared by both clients: no call to the cluster.

Each driver's ``backup`` module (one source, :mod:`mqds.client.aio.backup`,
generated into the synchronous driver) only makes the calls and waits; everything else is here, written
once: which replica a shard is exported from and when to give up on one
(:class:`ExportTries`), how an export's answers become record files
(:class:`ShardExport`), the run's manifest and report (:class:`BackupRun`),
the backup checked against the cluster and a restore's bookkeeping, down to
what a failed one says (:class:`RestoreRun`), and a record file cut into
``ImportShard`` chunks (:func:`import_chunks`).

These read and write the backup's place (blocking file I/O: the asyncio
driver runs them in a thread), never the cluster.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any, NoReturn

import grpc
from google.protobuf import json_format

from mqds.client.core.backup_files import (
    BackupError,
    FileEntry,
    GenerationEntry,
    Manifest,
    Place,
    RecordWriter,
    ShardEntry,
    check_file,
    read_records,
    verify,
)
from mqds.client.core.retry import NodeRounds
from mqds.client.core.routing_table import MapLookups
from mqds.protocol.errors import MqdsError, Reason
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import storage_pb2 as pb

Progress = Callable[[int, int, bool], None]
"""progress(shard, bytes done in that shard so far, shard finished)."""
CallError = Callable[[grpc.RpcError], MqdsError]

IMPORT_CHUNK_BYTES = 1024 * 1024
"""Records per ImportShard call, in key and value bytes: well under any node's entry limit."""
IMPORT_CALL_S = 120.0
"""The longest one ImportShard step is retried (an election, a busy or full node), within the restore's deadline:
a restore refused for good (STORAGE_FULL on every try) fails, and abandons what it began, instead of waiting for
the whole restore's deadline."""
FOLLOWER_WAIT_S = 2.0
"""How long an export asks only the followers of a shard (one behind its fence answers REPLICA_BEHIND, and is
asked again shortly) before the leader is asked too."""
ABANDON_S = 60.0
"""The least time a failed restore takes to abandon what it began, even when its own deadline has passed."""
START_S = 60.0
"""The longest a backup waits for what it starts from: the shards' fences and the retention policy."""


def quiet(shard: int, done: int, finished: bool) -> None:
    """The progress of a caller that asked for none."""


@dataclass
class BackupReport:
    """What a backup did."""

    place: str
    run: str
    n_shards: int
    seconds: float
    files_written: int = 0
    bytes_written: int = 0
    records: int = 0
    files_skipped: int = 0
    bytes_skipped: int = 0
    fences: dict[int, int] = field(default_factory=dict)
    nodes: dict[int, str] = field(default_factory=dict)
    """The node that exported each shard."""
    removed_files: int = 0
    """Files of earlier runs that the new manifest no longer lists, removed."""

    @property
    def mb_per_s(self) -> float:
        return self.bytes_written / 1e6 / self.seconds if self.seconds > 0 else 0.0


@dataclass
class RestoreReport:
    """What a restore did."""

    place: str
    n_shards: int
    seconds: float
    files: int = 0
    records: int = 0
    bytes: int = 0
    generations: int = 0
    retention_set: bool = False

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


# -- exports ---------------------------------------------------------------------


def export_order(routes: MapLookups, shard: int, with_leader: bool) -> list[str]:
    """The shard's replicas to ask: its followers, then (``with_leader``) its leader; every known node when
    the map names none (a node that holds no replica says so, NOT_HOSTED, and the next is asked)."""
    leader = routes.leader_of(shard)
    replicas = routes.replica_addresses(shard)
    if not replicas:
        return routes.known_addresses()
    followers = [a for a in replicas if a != leader]
    return followers + ([leader] if leader in replicas and (with_leader or not followers) else [])


class ExportTries(NodeRounds):
    """The retry rules of one shard's export: its followers first, its leader too after ``FOLLOWER_WAIT_S``.

    A round asks :meth:`addresses` in turn; after a round no replica
    answered, the map is refreshed first (:meth:`wants_refresh`) unless the
    replicas were only behind the fence (REPLICA_BEHIND: they catch up).
    """

    def __init__(self, routes: MapLookups, shard: int, deadline: float) -> None:
        super().__init__(deadline, first_pause_s=0.05, max_pause_s=1.0)
        self.routes = routes
        self.shard = shard
        self._leader_after = time.monotonic() + FOLLOWER_WAIT_S

    def addresses(self) -> list[str]:
        return export_order(self.routes, self.shard, time.monotonic() >= self._leader_after)

    def wants_refresh(self) -> bool:
        return self.last is None or self.last.reason is not Reason.REPLICA_BEHIND

    def final(self) -> MqdsError:
        return self.error(f"shard {self.shard}: no replica exported it in time")


def _generation(section: pb.ExportSection) -> GenerationEntry:
    g = section.generation
    return GenerationEntry(g.generation, g.since_us, g.until_us, g.created_at_us, g.changes)


def _skip_message(entry: FileEntry) -> pb.ExportedGeneration:
    g = entry.generation
    assert g is not None
    return pb.ExportedGeneration(
        generation=g.generation,
        since_us=g.since_us,
        until_us=g.until_us,
        created_at_us=g.created_at_us,
        changes=g.changes,
    )


class ShardExport:
    """One shard's export into record files, from one node's answers (each handed to :meth:`take`)."""

    def __init__(self, place: Place, run: str, shard: int, skips: dict[int, FileEntry]) -> None:
        self.place = place
        self.run = run
        self.shard = shard
        self.skips = skips
        self.entry = ShardEntry(shard=shard, fence_us=0, applied_index=0, node="")
        self.written = 0
        """The bytes of the files finished so far."""
        self._writer: RecordWriter | None = None
        self._handle: Any = None
        self._section: pb.ExportSection | None = None
        self._done = False

    @property
    def done_bytes(self) -> int:
        """The bytes written so far, the open file's included (what progress reports)."""
        return self.written + (self._writer.bytes if self._writer is not None else 0)

    def take(self, answer: pb.ExportShardResponse) -> bool:
        """Write one answer (a section opens a file, records go into it, done ends the export); whether it
        wrote records."""
        kind = answer.WhichOneof("kind")
        if kind == "section":
            self._close_file()
            self._section = answer.section
            if self._section.skipped:
                self.entry.files.append(self._skipped(self._section))
            else:
                self._handle = self.place.open(self._path(self._section.column_family), "wb")
                self._writer = RecordWriter(self._handle)
        elif kind == "records":
            if self._writer is None:
                raise BackupError(f"shard {self.shard}: the node sent records outside a section")
            self._writer.write(list(answer.records.keys), list(answer.records.values))
            return True
        elif kind == "done":
            d = answer.done
            self.entry.fence_us, self.entry.applied_index, self.entry.node = d.fence_us, d.applied_index, d.node
            self._done = True
        return False

    def finish(self) -> ShardEntry:
        """The shard's entry once the answers ended: its last file closed; BackupError if the export was cut."""
        self._close_file()
        if not self._done:
            raise BackupError(f"shard {self.shard}: the export ended before its end")
        return self.entry

    def close(self) -> None:
        """Close a file an export that failed left open (a later export of the shard writes it again)."""
        handle, self._handle, self._writer = self._handle, None, None
        if handle is not None:
            handle.close()

    def _close_file(self) -> None:
        if self._writer is not None:
            writer = self._writer
            self._handle.close()
            self._handle = self._writer = None
            self._add(self._section, writer)

    def _path(self, column_family: str) -> str:
        return f"data/{self.run}/shard-{self.shard:04d}/{column_family}.rec"

    def _add(self, section: pb.ExportSection | None, writer: RecordWriter) -> None:
        assert section is not None
        self.written += writer.bytes
        self.entry.files.append(
            FileEntry(
                path=self._path(section.column_family),
                column_family=section.column_family,
                records=writer.records,
                bytes=writer.bytes,
                sha256=writer.sha256,
                run=self.run,
                generation=_generation(section) if section.HasField("generation") else None,
            )
        )

    def _skipped(self, section: pb.ExportSection) -> FileEntry:
        number = section.generation.generation
        previous = self.skips.get(number)
        if previous is None:
            raise BackupError(f"shard {self.shard}: the node skipped generation {number}, which was not offered")
        return previous


class BackupRun:
    """One backup into a place: the run's name, the fences, the previous manifest, the manifest and report built.

    Made before the exports (it reads the previous manifest of an
    incremental backup); each shard's entry goes to :meth:`record` in shard
    order; :meth:`finish` writes the manifest and removes what no manifest
    names any more.
    """

    def __init__(
        self, to: str, fences: dict[int, int], retention: clpb.RetentionPolicy | None, incremental: bool
    ) -> None:
        self.started = time.monotonic()
        self.place = Place(to)
        self.fences = dict(sorted(fences.items()))
        n_shards = len(fences)
        self.previous: Manifest | None = None
        if incremental and self.place.exists("manifest.json"):
            try:
                self.previous = self.place.read_manifest()
            except BackupError:
                self.previous = None  # a damaged manifest: copy everything
            if self.previous is not None and self.previous.n_shards != n_shards:
                self.previous = None
        self.run = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:8]
        self.report = BackupReport(place=to, run=self.run, n_shards=n_shards, seconds=0.0)
        settings: dict[str, Any] = {}
        if retention is not None:
            settings["retention"] = json_format.MessageToDict(retention)
        created_at_us = time.time_ns() // 1000
        self.manifest = Manifest(run=self.run, created_at_us=created_at_us, n_shards=n_shards, settings=settings)

    def skips(self, shard: int) -> dict[int, FileEntry]:
        """The closed generations of ``shard`` the previous backup in this place holds, by number.

        Only those whose file is there with the size the manifest gives: a
        file lost or cut since is copied again (``--verify`` checks the
        checksums).
        """
        if self.previous is None:
            return {}
        skips: dict[int, FileEntry] = {}
        for s in self.previous.shards:
            if s.shard == shard:
                for f in s.files:
                    if f.generation is not None and f.generation.until_us and check_file(self.place, f, False) is None:
                        skips[f.generation.generation] = f
        return skips

    def request(self, shard: int, skips: dict[int, FileEntry]) -> pb.ExportShardRequest:
        """The shard's export at its fence, from any replica that applied it, the ``skips`` offered."""
        return pb.ExportShardRequest(
            shard=shard, fence_us=self.fences[shard], stale_ok=True, skip=[_skip_message(f) for f in skips.values()]
        )

    def export(self, shard: int, skips: dict[int, FileEntry]) -> ShardExport:
        """One try of the shard's export (a new one per node asked)."""
        return ShardExport(self.place, self.run, shard, skips)

    def record(self, entry: ShardEntry) -> None:
        """A shard exported: into the manifest and the report."""
        report = self.report
        self.manifest.shards.append(entry)
        report.fences[entry.shard] = entry.fence_us
        report.nodes[entry.shard] = entry.node
        for f in entry.files:
            if f.run == self.run:
                report.files_written += 1
                report.bytes_written += f.bytes
                report.records += f.records
            else:
                report.files_skipped += 1
                report.bytes_skipped += f.bytes

    def finish(self) -> BackupReport:
        """Write the manifest (last: now the place holds this backup), remove the files it does not name."""
        self.place.write_manifest(self.manifest)
        self.report.removed_files = self.place.remove_unlisted(self.manifest)
        self.report.seconds = time.monotonic() - self.started
        return self.report


# -- restores ----------------------------------------------------------------------


def import_deadline(deadline: float) -> float:
    """The deadline of one ImportShard step: ``IMPORT_CALL_S`` at most, within the restore's."""
    return min(deadline, time.monotonic() + IMPORT_CALL_S)


def abandon_request(shard: int) -> pb.ImportShardRequest:
    return pb.ImportShardRequest(shard=shard, abandon=pb.ImportAbandon())


def abandon_note(shards: list[int], failed: list[str]) -> str:
    """What abandoning ``shards`` did (``failed``: those it could not abandon, with why), for an error message."""
    if not shards:
        return "no shard had been begun: the cluster is as it was"
    if failed:
        return (
            f"abandoning the restore of {len(failed)} of the {len(shards)} shards it began failed: "
            + "; ".join(failed)
            + "; they take no writes until `mqds restore --abandon` (Client.abandon_restore) ends their restore"
        )
    return f"the restore of the {len(shards)} shards it began was abandoned: they are empty and take writes again"


def import_chunks(fh: IO[bytes], entry: FileEntry) -> Iterator[pb.ImportRecords]:
    """A record file's records in ImportShard chunks of about ``IMPORT_CHUNK_BYTES`` (reading ``fh`` as it goes)."""
    chunk = pb.ImportRecords(column_family=entry.column_family)
    chunk_bytes = 0
    for key, value in read_records(fh, entry.path):
        chunk.keys.append(key)
        chunk.values.append(value)
        chunk_bytes += len(key) + len(value)
        if chunk_bytes >= IMPORT_CHUNK_BYTES:
            yield chunk
            chunk = pb.ImportRecords(column_family=entry.column_family)
            chunk_bytes = 0
    if chunk.keys:
        yield chunk


class RestoreRun:
    """One restore: the backup checked whole and against the cluster, the shards begun and finished, the report.

    Made first: it reads the whole backup (:func:`verify`: manifest, sizes,
    checksums) and refuses, with ``BackupError``, a damaged or partial one
    or one of another shard count than the cluster's ``n_shards``. Then
    each shard's begin goes to :meth:`begun_shard` or :meth:`begin_failed`,
    and :meth:`check_begun` refuses a cluster that is not empty; after the
    records, each finish to :meth:`finished_shard`. A failure is raised by
    :meth:`fail`, with what abandoning the :meth:`unfinished` shards did.
    """

    def __init__(self, source: str, n_shards: int) -> None:
        self.started = time.monotonic()
        self.place = Place(source)
        checked = verify(self.place)
        if not checked.ok or checked.manifest is None:
            raise BackupError(f"{source} cannot be restored: " + "; ".join(checked.problems))
        self.manifest = checked.manifest
        if self.manifest.n_shards != n_shards:
            raise BackupError(
                f"the backup has {self.manifest.n_shards} shards and the cluster {n_shards}: restore into a cluster "
                f"made with the backup's shard count (n_shards = {self.manifest.n_shards})"
            )
        self.policy: clpb.RetentionPolicy | None = None
        """The backup's retention policy, set before the records are written (None: it had none)."""
        if self.manifest.settings.get("retention") is not None:
            try:
                self.policy = json_format.ParseDict(self.manifest.settings["retention"], clpb.RetentionPolicy())
            except json_format.ParseError as err:
                raise BackupError(f"manifest.json: the retention policy is damaged: {err}") from None
        self.report = RestoreReport(place=source, n_shards=n_shards, seconds=0.0)
        self.begun: list[int] = []
        self.finished: list[int] = []
        self._refused: list[str] = []

    def begin_request(self, shard: ShardEntry) -> pb.ImportShardRequest:
        return pb.ImportShardRequest(shard=shard.shard, begin=pb.ImportBegin())

    def begun_shard(self, shard: ShardEntry) -> None:
        self.begun.append(shard.shard)

    def begin_failed(self, shard: ShardEntry, err: MqdsError) -> None:
        """A begin failed: a shard that holds data is noted (:meth:`check_begun`); any other failure is raised."""
        if err.reason is not Reason.SHARD_NOT_EMPTY:
            self.begun.append(shard.shard)  # it may have been applied (a deadline): an abandon changes nothing else
            raise err
        self._refused.append(err.message)

    def check_begun(self) -> None:
        """Refuse a cluster some shard of which holds data (``BackupError`` naming them)."""
        if self._refused:
            raise BackupError("the cluster is not empty, nothing was restored: " + "; ".join(self._refused))

    def written(self, shard: ShardEntry, records: int, size: int) -> None:
        """A shard's records are all in (the shards in the manifest's order)."""
        self.report.files += len(shard.files)
        self.report.records += records
        self.report.bytes += size

    def finish_request(self, shard: ShardEntry) -> pb.ImportShardRequest:
        """The shard's finish: its last timestamp is the backup's fence."""
        return pb.ImportShardRequest(shard=shard.shard, finish=pb.ImportFinish(last_ts=shard.fence_us))

    def finished_shard(self, shard: ShardEntry, answer: pb.ImportShardResponse) -> None:
        self.finished.append(shard.shard)
        self.report.generations += len(answer.generations)

    def unfinished(self) -> list[int]:
        """The shards begun and not finished: what a failed restore abandons."""
        return [s for s in self.begun if s not in self.finished]

    def done(self) -> RestoreReport:
        self.report.seconds = time.monotonic() - self.started
        return self.report

    def fail(self, err: BaseException, note: str) -> NoReturn:
        """Raise what a restore that failed with ``err`` raises, from inside the handler of ``err``.

        ``note`` says what abandoning the unfinished shards did. A failure
        becomes a ``BackupError`` saying both; an interrupt (``KeyboardInterrupt``,
        a cancelled task) goes on as it is, with the note added.
        """
        if self.finished:
            note += (
                f"; shards {', '.join(map(str, self.finished))} had finished and hold the backup's data: make a new, "
                "empty cluster to restore into"
            )
        if isinstance(err, BackupError):
            raise BackupError(f"{err}; {note}") from err.__cause__
        if isinstance(err, Exception):
            raise BackupError(f"the restore failed: {err}; {note}") from err
        err.add_note(note)
        raise err
