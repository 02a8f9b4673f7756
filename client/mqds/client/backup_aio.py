"""Backup and restore of a whole cluster from the asyncio client: the calls of :mod:`mqds.client.backup`, as tasks.

The same steps, in the same order, with the same rules and the same files
(:mod:`mqds.client.backup_runs` decides and keeps everything): a backup
exports ``parallel`` shards at a time, each from a replica that reached its
fence, and writes the manifest last; a restore checks the whole backup,
begins every shard, writes the records, finishes every shard, and abandons
what it began when it fails. The calls go over ``grpc.aio``; what reads or
writes the backup's place (fsspec files: the manifest, the record files,
their checksums) runs in a worker thread (``asyncio.to_thread``), so the
event loop goes on meanwhile. ``progress`` is called on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import grpc

from mqds.client.aio_routing import AsyncRouter
from mqds.client.backup_files import ShardEntry
from mqds.client.backup_runs import (
    ABANDON_S,
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
from mqds.client.retention import set_policy_aio
from mqds.protocol.errors import MqdsError, Reason
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import storage_pb2 as pb

__all__ = ["abandon_restore", "backup", "export_shard", "restore"]

T = TypeVar("T")


async def export_shard(
    router: AsyncRouter, call_error: CallError, run: BackupRun, shard: int, deadline: float, progress: Progress
) -> ShardEntry:
    """Export one shard into the run's place at its fence: from its followers first, any replica that reached it.

    Each answer is written to its file in a worker thread.
    """
    skips = await asyncio.to_thread(run.skips, shard)
    request = run.request(shard, skips)
    tries = ExportTries(router, shard, deadline)
    while tries.going_on():
        for address in tries.addresses():
            if (remaining := tries.remaining()) is None:
                break
            job = run.export(shard, skips)
            call = router.storage(address).ExportShard(request, timeout=remaining, metadata=router.metadata)
            try:
                async for answer in call:
                    if await asyncio.to_thread(job.take, answer):
                        progress(shard, job.done_bytes, False)
                entry = await asyncio.to_thread(job.finish)
            except grpc.RpcError as err:
                tries.failed(call_error(err))
                continue
            finally:
                call.cancel()  # an export given up (a damaged answer, a cancelled task) ends on the node too
                await asyncio.to_thread(job.close)
            progress(shard, job.written, True)
            return entry
        if tries.wants_refresh():
            await router.refresh_quietly(max(0.1, deadline - time.monotonic()))
        await asyncio.sleep(tries.pause_s())
    raise tries.final()


async def _in_order(jobs: Sequence[Awaitable[T]], parallel: int) -> list[T]:
    """Await ``jobs``, at most ``parallel`` at a time, their results in order; the first failure cancels the rest."""
    room = asyncio.Semaphore(max(1, parallel))

    async def one(job: Awaitable[T]) -> T:
        async with room:
            return await job

    tasks = [asyncio.ensure_future(one(job)) for job in jobs]
    try:
        return [await task for task in tasks]
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def backup(
    router: AsyncRouter,
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
    """Back up every shard at its fence into ``to``; see :func:`mqds.client.backup.backup`."""
    run = await asyncio.to_thread(BackupRun, to, fences, retention, incremental)
    tell = progress or quiet
    jobs = [export_shard(router, call_error, run, shard, deadline, tell) for shard in run.fences]
    for entry in await _in_order(jobs, parallel):
        run.record(entry)
    return await asyncio.to_thread(run.finish)


async def _import(router: AsyncRouter, call_error: CallError, request: pb.ImportShardRequest, deadline: float) -> Any:
    async def attempt(address: str, remaining: float) -> Any:
        try:
            return await router.storage(address).ImportShard(request, timeout=remaining, metadata=router.metadata)
        except grpc.RpcError as err:
            raise call_error(err) from None

    return await router.call(request.shard, attempt, import_deadline(deadline))


async def _abandon(router: AsyncRouter, call_error: CallError, shards: list[int], deadline: float) -> str:
    """Abandon the restore of ``shards`` (each empty and writable again); what was done, for the error message."""
    deadline = max(deadline, time.monotonic() + ABANDON_S)
    failed: list[str] = []
    for shard in shards:
        try:
            await _import(router, call_error, abandon_request(shard), deadline)
        except MqdsError as err:
            if err.reason is not Reason.NOT_RESTORING:  # a retry of one that was abandoned
                failed.append(f"shard {shard} ({err})")
    return abandon_note(shards, failed)


async def abandon_restore(router: AsyncRouter, call_error: CallError, n_shards: int, deadline: float) -> list[int]:
    """End every restore under way in the cluster; the shards it ended (:func:`mqds.client.backup.abandon_restore`)."""
    ended: list[int] = []
    for shard in range(n_shards):
        try:
            await _import(router, call_error, abandon_request(shard), deadline)
        except MqdsError as err:
            if err.reason is Reason.NOT_RESTORING:
                continue
            raise
        ended.append(shard)
    return ended


async def _restore_shard(
    router: AsyncRouter, call_error: CallError, run: RestoreRun, shard: ShardEntry, deadline: float, progress: Progress
) -> tuple[int, int]:
    """Write one shard's records, each chunk read from its file in a worker thread; (records, bytes)."""
    records = size = 0
    for entry in shard.files:
        fh = await asyncio.to_thread(run.place.open, entry.path, "rb")
        try:
            chunks = import_chunks(fh, entry)
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                await _import(router, call_error, pb.ImportShardRequest(shard=shard.shard, records=chunk), deadline)
                records += len(chunk.keys)
        finally:
            await asyncio.to_thread(fh.close)
        size += entry.bytes
        progress(shard.shard, size, False)
    return records, size


async def restore(
    router: AsyncRouter,
    call_error: CallError,
    source: str,
    *,
    n_shards: int,
    deadline: float,
    parallel: int = 2,
    progress: Progress | None = None,
) -> RestoreReport:
    """Restore the backup at ``source`` into the (empty) cluster; see :func:`mqds.client.backup.restore`."""
    run = await asyncio.to_thread(RestoreRun, source, n_shards)
    tell = progress or quiet
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
            await set_policy_aio(router, call_error, run.policy, deadline)
            run.report.retention_set = True
        shards = run.manifest.shards
        jobs = [_restore_shard(router, call_error, run, s, deadline, tell) for s in shards]
        written = await _in_order(jobs, parallel)
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
