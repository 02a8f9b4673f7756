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

This module makes the calls of the synchronous client, with threads;
:mod:`mqds.client.backup_aio` makes the same calls with tasks, and both
leave every decision and the files to :mod:`mqds.client.backup_runs`.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Any

import grpc

from mqds.client.backup_files import ShardEntry
from mqds.client.backup_runs import (
    ABANDON_S,
    FOLLOWER_WAIT_S,
    IMPORT_CALL_S,
    IMPORT_CHUNK_BYTES,
    BackupReport,
    BackupRun,
    CallError,
    ExportTries,
    Progress,
    RestoreReport,
    RestoreRun,
    abandon_note,
    abandon_request,
    import_chunks,
    import_deadline,
    quiet,
)
from mqds.client.retention import set_policy
from mqds.client.routing import Router
from mqds.protocol.errors import MqdsError, Reason
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import storage_pb2 as pb

__all__ = [
    "ABANDON_S",
    "FOLLOWER_WAIT_S",
    "IMPORT_CALL_S",
    "IMPORT_CHUNK_BYTES",
    "BackupReport",
    "CallError",
    "Progress",
    "RestoreReport",
    "abandon_restore",
    "backup",
    "export_shard",
    "restore",
]


def export_shard(
    router: Router, call_error: CallError, run: BackupRun, shard: int, deadline: float, progress: Progress
) -> ShardEntry:
    """Export one shard into the run's place at its fence: from its followers first, any replica that reached it."""
    skips = run.skips(shard)
    request = run.request(shard, skips)
    tries = ExportTries(router, shard, deadline)
    while tries.going_on():
        for address in tries.addresses():
            if (remaining := tries.remaining()) is None:
                break
            job = run.export(shard, skips)
            try:
                for answer in router.storage(address).ExportShard(request, timeout=remaining, metadata=router.metadata):
                    if job.take(answer):
                        progress(shard, job.done_bytes, False)
                entry = job.finish()
            except grpc.RpcError as err:
                tries.failed(call_error(err))
                continue
            finally:
                job.close()
            progress(shard, job.written, True)
            return entry
        if tries.wants_refresh():
            router.refresh_quietly(max(0.1, deadline - time.monotonic()))
        time.sleep(tries.pause_s())
    raise tries.final()


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
    run = BackupRun(to, fences, retention, incremental)
    tell = progress or quiet
    with futures.ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="mqds-backup") as pool:
        jobs = [pool.submit(export_shard, router, call_error, run, shard, deadline, tell) for shard in run.fences]
        for job in jobs:
            run.record(job.result())
    return run.finish()


def _import(router: Router, call_error: CallError, request: pb.ImportShardRequest, deadline: float) -> Any:
    def attempt(address: str, remaining: float) -> Any:
        try:
            return router.storage(address).ImportShard(request, timeout=remaining, metadata=router.metadata)
        except grpc.RpcError as err:
            raise call_error(err) from None

    return router.call(request.shard, attempt, import_deadline(deadline))


class _Stopped(Exception):
    """Another shard's restore failed: this one stops between calls."""


def _abandon(router: Router, call_error: CallError, shards: list[int], deadline: float) -> str:
    """Abandon the restore of ``shards`` (each empty and writable again); what was done, for the error message."""
    deadline = max(deadline, time.monotonic() + ABANDON_S)
    failed: list[str] = []
    for shard in shards:
        try:
            _import(router, call_error, abandon_request(shard), deadline)
        except MqdsError as err:
            if err.reason is not Reason.NOT_RESTORING:  # a retry of one that was abandoned
                failed.append(f"shard {shard} ({err})")
    return abandon_note(shards, failed)


def abandon_restore(router: Router, call_error: CallError, n_shards: int, deadline: float) -> list[int]:
    """End every restore under way in the cluster (``ImportShard`` abandon on each shard); the shards it ended.

    A shard not in restore mode (NOT_RESTORING) is left as it is: a shard
    that holds data is never cleared.
    """
    ended: list[int] = []
    for shard in range(n_shards):
        try:
            _import(router, call_error, abandon_request(shard), deadline)
        except MqdsError as err:
            if err.reason is Reason.NOT_RESTORING:
                continue
            raise
        ended.append(shard)
    return ended


def _restore_shard(
    router: Router,
    call_error: CallError,
    run: RestoreRun,
    shard: ShardEntry,
    deadline: float,
    progress: Progress,
    stop: threading.Event,
) -> tuple[int, int]:
    """Write one shard's records (stopping between calls once ``stop`` is set); (records, bytes)."""
    records = size = 0
    for entry in shard.files:
        with run.place.open(entry.path, "rb") as fh:
            for chunk in import_chunks(fh, entry):
                if stop.is_set():
                    raise _Stopped
                _import(router, call_error, pb.ImportShardRequest(shard=shard.shard, records=chunk), deadline)
                records += len(chunk.keys)
        size += entry.bytes
        progress(shard.shard, size, False)
    return records, size


def _write_all(
    router: Router, call_error: CallError, run: RestoreRun, deadline: float, parallel: int, tell: Progress
) -> None:
    """Write every shard's records, ``parallel`` shards at a time; the first failure stops the others."""
    stop = threading.Event()
    shards = run.manifest.shards
    with futures.ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="mqds-restore") as pool:
        jobs = [pool.submit(_restore_shard, router, call_error, run, s, deadline, tell, stop) for s in shards]
        try:
            for job, shard in zip(jobs, shards, strict=True):
                run.written(shard, *job.result())
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
    run = RestoreRun(source, n_shards)
    tell = progress or quiet
    try:
        for shard in run.manifest.shards:
            try:
                _import(router, call_error, run.begin_request(shard), deadline)
            except MqdsError as err:
                run.begin_failed(shard, err)
            else:
                run.begun_shard(shard)
        run.check_begun()
        # The policy first: the leaders then keep what it keeps from the moment each shard is finished.
        if run.policy is not None:
            set_policy(router, call_error, run.policy, deadline)
            run.report.retention_set = True
        _write_all(router, call_error, run, deadline, parallel, tell)
        # Finished only once every shard's records are in: a restore that fails before leaves no shard holding
        # part of the backup.
        for shard in run.manifest.shards:
            run.finished_shard(shard, _import(router, call_error, run.finish_request(shard), deadline))
            tell(shard.shard, sum(f.bytes for f in shard.files), True)
    except BaseException as err:
        run.fail(err, _abandon(router, call_error, run.unfinished(), deadline))
    return run.done()
