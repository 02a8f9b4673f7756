"""Backup and restore of a whole cluster (``mqds backup`` / ``mqds restore``), through the public API.

A backup pins one fence per shard (``GetFences``, on the leaders: the
cluster's cut, taken at about the same moment for every shard), then exports
every shard (``Storage.ExportShard``, a few shards at a time) from a replica
that has applied up to its fence, followers first so the leaders keep their
time for writes, and writes what comes into record files with their
checksums (``backup_files.py``); the manifest goes last. An incremental
backup into a place that holds one already asks the nodes to skip the
closed generations the previous manifest lists with the same identity and
change count, and lists its files again.

A restore checks the whole backup first (manifest, every file's size and
checksum), then that the cluster has the backup's shard count and that every
shard is empty (``ImportShard`` begin, on every shard before any record is
written: it puts the shard in restore mode, where it takes no other write),
then writes each shard's records through its leader (logged in the shard's
Raft group, so any cluster size and placement work), and once every shard's
records are in, finishes each shard (its last timestamp is its fence); the
backup's retention policy is set before the records are written. A restore
that fails (a refused begin, a call that fails, an interrupt) abandons every
shard it began and did not finish (``ImportShard`` abandon: the shard is
empty and writable again) and says so; ``abandon_restore`` (``mqds restore
--abandon``) ends the restores a stopped process left behind.

Messages are exact at the fence; broker state (client state, subscriptions,
retained messages, read positions) is as each shard's export found it, a
moment after its fence.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import json_format

from mqds.client.backup_files import (
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
from mqds.client.retention import set_policy
from mqds.client.routing import Router
from mqds.protocol import errors
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


FOLLOWER_WAIT_S = 2.0
"""How long an export asks only the followers of a shard (one behind its fence answers REPLICA_BEHIND, and is
asked again shortly) before the leader is asked too."""


def _export_order(router: Router, shard: int, with_leader: bool) -> list[str]:
    """The shard's replicas to ask: its followers, then (``with_leader``) its leader; every known node when
    the map names none (a node that holds no replica says so, NOT_HOSTED, and the next is asked)."""
    leader = router.leader_of(shard)
    replicas = router.replica_addresses(shard)
    if not replicas:
        return router.known_addresses()
    followers = [a for a in replicas if a != leader]
    return followers + ([leader] if leader in replicas and (with_leader or not followers) else [])


def _skips(place: Place, previous: Manifest | None, shard: int) -> dict[int, FileEntry]:
    """The closed generations of ``shard`` the previous backup in this place holds, by number.

    Only those whose file is there with the size the manifest gives: a file
    lost or cut since is copied again (``--verify`` checks the checksums).
    """
    if previous is None:
        return {}
    skips: dict[int, FileEntry] = {}
    for s in previous.shards:
        if s.shard == shard:
            for f in s.files:
                if f.generation is not None and f.generation.until_us and check_file(place, f, False) is None:
                    skips[f.generation.generation] = f
    return skips


class _ShardExport:
    """One shard's export into record files, from one node's answers."""

    def __init__(self, place: Place, run: str, shard: int, skips: dict[int, FileEntry], progress: Progress) -> None:
        self.place = place
        self.run = run
        self.shard = shard
        self.skips = skips
        self.progress = progress
        self.entry = ShardEntry(shard=shard, fence_us=0, applied_index=0, node="")
        self.written = 0

    def run_stream(self, answers: Iterator[pb.ExportShardResponse]) -> ShardEntry:
        writer: RecordWriter | None = None
        handle: Any = None
        section: pb.ExportSection | None = None
        done = False
        try:
            for answer in answers:
                kind = answer.WhichOneof("kind")
                if kind == "section":
                    if writer is not None:
                        handle.close()
                        self._add(section, writer)
                        writer = handle = None
                    section = answer.section
                    if section.skipped:
                        self.entry.files.append(self._skipped(section))
                        continue
                    handle = self.place.open(self._path(section.column_family), "wb")
                    writer = RecordWriter(handle)
                elif kind == "records":
                    if writer is None:
                        raise BackupError(f"shard {self.shard}: the node sent records outside a section")
                    writer.write(list(answer.records.keys), list(answer.records.values))
                    self.progress(self.shard, self.written + writer.bytes, False)
                elif kind == "done":
                    d = answer.done
                    self.entry.fence_us, self.entry.applied_index, self.entry.node = d.fence_us, d.applied_index, d.node
                    done = True
            if writer is not None:
                handle.close()
                self._add(section, writer)
                handle = None
        finally:
            if handle is not None:
                handle.close()
        if not done:
            raise BackupError(f"shard {self.shard}: the export ended before its end")
        self.progress(self.shard, self.written, True)
        return self.entry

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


def export_shard(
    router: Router,
    call_error: CallError,
    place: Place,
    run: str,
    shard: int,
    fence_us: int,
    skips: dict[int, FileEntry],
    deadline: float,
    progress: Progress,
) -> ShardEntry:
    """Export one shard into ``place``: from its followers first, any replica that reached the fence."""
    request = pb.ExportShardRequest(
        shard=shard, fence_us=fence_us, stale_ok=True, skip=[_skip_message(f) for f in skips.values()]
    )
    last: MqdsError | None = None
    pause = 0.05
    leader_after = time.monotonic() + FOLLOWER_WAIT_S
    while time.monotonic() < deadline:
        for address in _export_order(router, shard, time.monotonic() >= leader_after):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            job = _ShardExport(place, run, shard, skips, progress)
            try:
                answers = router.storage(address).ExportShard(request, timeout=remaining, metadata=router.metadata)
                return job.run_stream(answers)
            except grpc.RpcError as err:
                last = call_error(err)
                if not last.retriable:
                    raise last from None
        if last is None or last.reason is not Reason.REPLICA_BEHIND:
            router.refresh_quietly(max(0.1, deadline - time.monotonic()))
        time.sleep(pause)
        pause = min(pause * 2, 1.0)
    raise last or errors.error(Reason.DEADLINE_EXCEEDED, f"shard {shard}: no replica exported it in time")


def backup(
    router: Router,
    call_error: CallError,
    to: str,
    *,
    fences: dict[int, int],
    retention: clpb.RetentionPolicy | None,
    deadline: float,
    parallel: int = 2,
    incremental: bool = True,
    progress: Progress | None = None,
) -> BackupReport:
    """Back up every shard at its fence into ``to`` (a directory or fsspec URL); see the module's docstring."""
    started = time.monotonic()
    place = Place(to)
    n_shards = len(fences)
    previous: Manifest | None = None
    if incremental and place.exists("manifest.json"):
        try:
            previous = place.read_manifest()
        except BackupError:
            previous = None  # a damaged manifest: copy everything
        if previous is not None and previous.n_shards != n_shards:
            previous = None
    run = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:8]
    report = BackupReport(place=to, run=run, n_shards=n_shards, seconds=0.0)
    tell = progress or (lambda shard, done, finished: None)
    settings: dict[str, Any] = {}
    if retention is not None:
        settings["retention"] = json_format.MessageToDict(retention)
    manifest = Manifest(run=run, created_at_us=time.time_ns() // 1000, n_shards=n_shards, settings=settings)
    with futures.ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="mqds-backup") as pool:
        jobs = {
            shard: pool.submit(
                export_shard,
                router,
                call_error,
                place,
                run,
                shard,
                fence,
                _skips(place, previous, shard),
                deadline,
                tell,
            )
            for shard, fence in sorted(fences.items())
        }
        for shard, job in jobs.items():
            entry = job.result()
            manifest.shards.append(entry)
            report.fences[shard] = entry.fence_us
            report.nodes[shard] = entry.node
            for f in entry.files:
                if f.run == run:
                    report.files_written += 1
                    report.bytes_written += f.bytes
                    report.records += f.records
                else:
                    report.files_skipped += 1
                    report.bytes_skipped += f.bytes
    place.write_manifest(manifest)
    report.removed_files = place.remove_unlisted(manifest)
    report.seconds = time.monotonic() - started
    return report


def _import(router: Router, call_error: CallError, request: pb.ImportShardRequest, deadline: float) -> Any:
    def attempt(address: str, remaining: float) -> Any:
        try:
            return router.storage(address).ImportShard(request, timeout=remaining, metadata=router.metadata)
        except grpc.RpcError as err:
            raise call_error(err) from None

    return router.call(request.shard, attempt, min(deadline, time.monotonic() + IMPORT_CALL_S))


ABANDON_S = 60.0
"""The least time a failed restore takes to abandon what it began, even when its own deadline has passed."""


class _Stopped(Exception):
    """Another shard's restore failed: this one stops between calls."""


def _abandon(router: Router, call_error: CallError, shards: list[int], deadline: float) -> str:
    """Abandon the restore of ``shards`` (each empty and writable again); what was done, for the error message."""
    deadline = max(deadline, time.monotonic() + ABANDON_S)
    failed: list[str] = []
    for shard in shards:
        try:
            _import(router, call_error, pb.ImportShardRequest(shard=shard, abandon=pb.ImportAbandon()), deadline)
        except MqdsError as err:
            if err.reason is not Reason.NOT_RESTORING:  # a retry of one that was abandoned
                failed.append(f"shard {shard} ({err})")
    if not shards:
        return "no shard had been begun: the cluster is as it was"
    if failed:
        return (
            f"abandoning the restore of {len(failed)} of the {len(shards)} shards it began failed: "
            + "; ".join(failed)
            + "; they take no writes until `mqds restore --abandon` (Client.abandon_restore) ends their restore"
        )
    return f"the restore of the {len(shards)} shards it began was abandoned: they are empty and take writes again"


def abandon_restore(router: Router, call_error: CallError, n_shards: int, deadline: float) -> list[int]:
    """End every restore under way in the cluster (``ImportShard`` abandon on each shard); the shards it ended.

    A shard not in restore mode (NOT_RESTORING) is left as it is: a shard
    that holds data is never cleared.
    """
    ended: list[int] = []
    for shard in range(n_shards):
        try:
            _import(router, call_error, pb.ImportShardRequest(shard=shard, abandon=pb.ImportAbandon()), deadline)
        except MqdsError as err:
            if err.reason is Reason.NOT_RESTORING:
                continue
            raise
        ended.append(shard)
    return ended


def _restore_shard(
    router: Router,
    call_error: CallError,
    place: Place,
    shard: ShardEntry,
    deadline: float,
    progress: Progress,
    stop: threading.Event,
) -> tuple[int, int]:
    """Write one shard's records (stopping between calls once ``stop`` is set); (records, bytes)."""
    records = size = 0

    def send(chunk: pb.ImportRecords) -> None:
        if stop.is_set():
            raise _Stopped
        _import(router, call_error, pb.ImportShardRequest(shard=shard.shard, records=chunk), deadline)

    for entry in shard.files:
        with place.open(entry.path, "rb") as fh:
            chunk = pb.ImportRecords(column_family=entry.column_family)
            chunk_bytes = 0
            for key, value in read_records(fh, entry.path):
                chunk.keys.append(key)
                chunk.values.append(value)
                chunk_bytes += len(key) + len(value)
                if chunk_bytes >= IMPORT_CHUNK_BYTES:
                    send(chunk)
                    records += len(chunk.keys)
                    chunk = pb.ImportRecords(column_family=entry.column_family)
                    chunk_bytes = 0
            if chunk.keys:
                send(chunk)
                records += len(chunk.keys)
        size += entry.bytes
        progress(shard.shard, size, False)
    return records, size


def _write_all(
    router: Router,
    call_error: CallError,
    place: Place,
    manifest: Manifest,
    report: RestoreReport,
    deadline: float,
    parallel: int,
    tell: Progress,
) -> None:
    """Write every shard's records, ``parallel`` shards at a time; the first failure stops the others."""
    stop = threading.Event()
    with futures.ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="mqds-restore") as pool:
        jobs = [
            pool.submit(_restore_shard, router, call_error, place, s, deadline, tell, stop) for s in manifest.shards
        ]
        try:
            for job, shard in zip(jobs, manifest.shards, strict=True):
                records, size = job.result()
                report.files += len(shard.files)
                report.records += records
                report.bytes += size
        except BaseException:
            stop.set()
            for job in jobs:
                job.cancel()
            raise


def restore(
    router: Router,
    call_error: CallError,
    source: str,
    *,
    n_shards: int,
    deadline: float,
    parallel: int = 2,
    progress: Progress | None = None,
) -> RestoreReport:
    """Restore the backup at ``source`` into the (empty) cluster behind ``router``; see the module's docstring."""
    started = time.monotonic()
    place = Place(source)
    checked = verify(place)
    if not checked.ok or checked.manifest is None:
        raise BackupError(f"{source} cannot be restored: " + "; ".join(checked.problems))
    manifest = checked.manifest
    if manifest.n_shards != n_shards:
        raise BackupError(
            f"the backup has {manifest.n_shards} shards and the cluster {n_shards}: restore into a cluster made "
            f"with the backup's shard count (n_shards = {manifest.n_shards})"
        )
    policy = None
    if manifest.settings.get("retention") is not None:
        try:
            policy = json_format.ParseDict(manifest.settings["retention"], clpb.RetentionPolicy())
        except json_format.ParseError as err:
            raise BackupError(f"manifest.json: the retention policy is damaged: {err}") from None
    begun: list[int] = []
    finished: list[int] = []
    try:
        refused: list[str] = []
        for shard in manifest.shards:
            try:
                _import(router, call_error, pb.ImportShardRequest(shard=shard.shard, begin=pb.ImportBegin()), deadline)
                begun.append(shard.shard)
            except MqdsError as err:
                if err.reason is not Reason.SHARD_NOT_EMPTY:
                    begun.append(shard.shard)  # it may have been applied (a deadline): an abandon changes nothing else
                    raise
                refused.append(err.message)
        if refused:
            raise BackupError("the cluster is not empty, nothing was restored: " + "; ".join(refused))
        report = RestoreReport(place=source, n_shards=n_shards, seconds=0.0)
        # The policy first: the leaders then keep what it keeps from the moment each shard is finished.
        if policy is not None:
            set_policy(router, call_error, policy, deadline)
            report.retention_set = True
        tell = progress or (lambda shard, done, finished: None)
        _write_all(router, call_error, place, manifest, report, deadline, parallel, tell)
        # Finished only once every shard's records are in: a restore that fails before leaves no shard holding
        # part of the backup.
        for shard in manifest.shards:
            finish = pb.ImportShardRequest(shard=shard.shard, finish=pb.ImportFinish(last_ts=shard.fence_us))
            answer = _import(router, call_error, finish, deadline)
            finished.append(shard.shard)
            report.generations += len(answer.generations)
            tell(shard.shard, sum(f.bytes for f in shard.files), True)
    except BaseException as err:
        note = _abandon(router, call_error, [s for s in begun if s not in finished], deadline)
        if finished:
            note += (
                f"; shards {', '.join(map(str, finished))} had finished and hold the backup's data: make a new, "
                "empty cluster to restore into"
            )
        if isinstance(err, BackupError):
            raise BackupError(f"{err}; {note}") from err.__cause__
        if isinstance(err, Exception):
            raise BackupError(f"the restore failed: {err}; {note}") from err
        err.add_note(note)  # an interrupt goes on as it is
        raise
    report.seconds = time.monotonic() - started
    return report
