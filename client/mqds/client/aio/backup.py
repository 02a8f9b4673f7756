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

This module is written once, for the asyncio driver, and
``client/generate_sync.py`` writes the synchronous driver's from it; what
waits is each driver's ``concurrency`` module (exports and restores as tasks
or in a thread pool, file reads and writes in a worker thread or the
caller's). Every decision and the files are :mod:`mqds.client.core.backup_runs`'s.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import grpc

from mqds.client.aio import concurrency
from mqds.client.aio.retention import set_policy
from mqds.client.aio.routing import AsyncRouter
from mqds.client.core import backup_runs as runs
from mqds.client.core.backup_files import ShardEntry
from mqds.protocol.errors import MqdsError, Reason
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import storage_pb2 as pb

__all__ = ["abandon_restore", "backup", "export_shard", "restore"]


async def export_shard(
    router: AsyncRouter,
    call_error: runs.CallError,
    run: runs.BackupRun,
    shard: int,
    deadline: float,
    progress: runs.Progress,
) -> ShardEntry:
    """Export one shard into the run's place at its fence: from its followers first, any replica that reached it."""
    skips = await concurrency.to_thread(run.skips, shard)
    request = run.request(shard, skips)
    tries = runs.ExportTries(router, shard, deadline)
    while tries.going_on():
        for address in tries.addresses():
            if (remaining := tries.remaining()) is None:
                break
            job = run.export(shard, skips)
            call = router.storage(address).ExportShard(request, timeout=remaining, metadata=router.metadata)
            try:
                async for answer in call:
                    if await concurrency.to_thread(job.take, answer):
                        progress(shard, job.done_bytes, False)
                entry = await concurrency.to_thread(job.finish)
            except grpc.RpcError as err:
                tries.failed(call_error(err))
                continue
            finally:
                call.cancel()  # an export given up (a damaged answer, a stopped job) ends on the node too
                await concurrency.to_thread(job.close)
            progress(shard, job.written, True)
            return entry
        if tries.wants_refresh():
            await router.refresh_quietly(max(0.1, deadline - time.monotonic()))
        await concurrency.sleep(tries.pause_s())
    raise tries.final()


async def backup(
    router: AsyncRouter,
    call_error: runs.CallError,
    to: str,
    *,
    fences: dict[int, int],
    retention: clpb.RetentionPolicy | None,
    deadline: float,
    parallel: int = 2,
    incremental: bool = True,
    progress: runs.Progress | None = None,
) -> runs.BackupReport:
    """Back up every shard at its fence into ``to`` (a directory or fsspec URL); see the module's docstring."""
    run = await concurrency.to_thread(runs.BackupRun, to, fences, retention, incremental)
    tell = progress or runs.quiet
    jobs = [functools.partial(export_shard, router, call_error, run, shard, deadline, tell) for shard in run.fences]
    for entry in await concurrency.in_order(jobs, parallel):
        run.record(entry)
    return await concurrency.to_thread(run.finish)


async def _import(
    router: AsyncRouter, call_error: runs.CallError, request: pb.ImportShardRequest, deadline: float
) -> Any:
    async def attempt(address: str, remaining: float) -> Any:
        try:
            return await router.storage(address).ImportShard(request, timeout=remaining, metadata=router.metadata)
        except grpc.RpcError as err:
            raise call_error(err) from None

    return await router.call(request.shard, attempt, runs.import_deadline(deadline))


async def _abandon(router: AsyncRouter, call_error: runs.CallError, shards: list[int], deadline: float) -> str:
    """Abandon the restore of ``shards`` (each cleared, writable again); a note of what was abandoned."""
    deadline = max(deadline, time.monotonic() + runs.ABANDON_S)  # even after the restore's deadline passed
    failed: list[str] = []
    for shard in shards:
        try:
            await _import(router, call_error, runs.abandon_request(shard), deadline)
        except MqdsError as err:
            if err.reason is not Reason.NOT_RESTORING:  # a retry of one that was abandoned
                failed.append(f"shard {shard} ({err})")
    return runs.abandon_note(shards, failed)


async def abandon_restore(router: AsyncRouter, call_error: runs.CallError, n_shards: int, deadline: float) -> list[int]:
    """End every restore under way in the cluster (``ImportShard`` abandon on each shard); the shards it ended.

    A shard not in restore mode (NOT_RESTORING) is left as it is: a shard
    that holds data is never cleared.
    """
    ended: list[int] = []
    for shard in range(n_shards):
        try:
            await _import(router, call_error, runs.abandon_request(shard), deadline)
        except MqdsError as err:
            if err.reason is Reason.NOT_RESTORING:
                continue
            raise
        ended.append(shard)
    return ended


async def _restore_shard(
    router: AsyncRouter,
    call_error: runs.CallError,
    run: runs.RestoreRun,
    shard: ShardEntry,
    deadline: float,
    progress: runs.Progress,
) -> tuple[int, int]:
    """Write one shard's records, stopping between calls once another shard's failed; (records, bytes)."""
    records = size = 0
    for entry in shard.files:
        fh = await concurrency.to_thread(run.place.open, entry.path, "rb")
        try:
            chunks = runs.import_chunks(fh, entry)
            while (chunk := await concurrency.to_thread(next, chunks, None)) is not None:
                await concurrency.checkpoint()
                await _import(router, call_error, pb.ImportShardRequest(shard=shard.shard, records=chunk), deadline)
                records += len(chunk.keys)
        finally:
            await concurrency.to_thread(fh.close)
        size += entry.bytes
        progress(shard.shard, size, False)
    return records, size


async def restore(
    router: AsyncRouter,
    call_error: runs.CallError,
    source: str,
    *,
    n_shards: int,
    deadline: float,
    parallel: int = 2,
    progress: runs.Progress | None = None,
) -> runs.RestoreReport:
    """Restore the backup at ``source`` into the (empty) cluster behind ``router``; see the module's docstring."""
    run = await concurrency.to_thread(runs.RestoreRun, source, n_shards)
    tell = progress or runs.quiet
    try:
        for shard in run.manifest.shards:
            try:
                await _import(router, call_error, run.begin_request(shard), deadline)
            except MqdsError as err:
                run.begin_failed(shard, err)
            else:
                run.begun_shard(shard)
        run.check_begun()
        # The policy first: the leaders then keep what it keeps from the moment each shard is finished.
        if run.policy is not None:
            await set_policy(router, call_error, run.policy, deadline)
            run.report.retention_set = True
        shards = run.manifest.shards
        jobs = [functools.partial(_restore_shard, router, call_error, run, s, deadline, tell) for s in shards]
        written = await concurrency.in_order(jobs, parallel)
        for shard, (records, size) in zip(shards, written, strict=True):
            run.written(shard, records, size)
        # Finished only once every shard's records are in: a restore that fails before leaves no shard holding
        # part of the backup.
        for shard in shards:
            run.finished_shard(shard, await _import(router, call_error, run.finish_request(shard), deadline))
            tell(shard.shard, sum(f.bytes for f in shard.files), True)
    except BaseException as err:
        run.fail(err, await _abandon(router, call_error, run.unfinished(), deadline))
    return run.done()
