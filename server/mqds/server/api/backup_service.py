"""Storage.ExportShard and Storage.ImportShard: a shard copied out for a backup, and written in by a restore.

An export takes a RocksDB checkpoint of the answering replica under its
reader guard (a moment: hard links and a memtable flush), then reads the
checkpoint with nothing held, so the replica goes on applying and a
snapshot install is not kept waiting by a slow reader. The checkpoint goes
into the node's scratch directory (on the data directory's file system, so
its files are hard links) and is removed when the call ends, however it
ends. ``storage/export.py`` decides what of it is exported; answers are
bounded by ``max_chunk_bytes``, the node's ``max_answer_bytes`` and 1 MiB.

An import is logged on the shard's leader as a command applied by every
replica (``storage/restore.py``); records are checked here first, so a
command in the log is one every replica applies the same way. Whether a
step is taken (a ``records``, ``finish`` or ``abandon`` only in restore
mode, a ``finish`` at or after the records' timestamps) is decided when it
is applied, by the shard's replicated state, never by what this node
believes: a leader elected a moment ago may not have applied the ``begin``
yet. What needs no state is checked here: the records' shape, and
timestamps (records' and ``finish``'s) at most ``RESTORE_AHEAD_US`` after
this node's clock.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.server.api.shards_api import ShardsAPI
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.storage.export import CheckpointExport, ExportedGeneration
from mqds.server.storage.restore import check_records
from mqds.v1 import storage_pb2 as pb

CHUNK_BYTES = 1024 * 1024
"""The largest export answer by default."""
_RECORD_OVERHEAD = 8
"""Bytes an answer adds to a record's key and value (two field tags and lengths)."""
_FENCE_AHEAD_US = 86_400 * 1_000_000
RESTORE_AHEAD_US = 300 * 1_000_000
"""How far after this node's clock a restore's timestamps may be: a backup's fence is the source cluster's
clock when the backup began, before the restore, so only the two clusters' clock difference puts it ahead."""


def _generation(gen: ExportedGeneration) -> pb.ExportedGeneration:
    return pb.ExportedGeneration(
        generation=gen.number,
        since_us=gen.since_us,
        until_us=gen.until_us or 0,
        created_at_us=gen.created_at_us,
        changes=gen.changes,
    )


def _skips(request: pb.ExportShardRequest) -> dict[int, ExportedGeneration]:
    skip: dict[int, ExportedGeneration] = {}
    for g in request.skip:
        if not g.until_us:
            raise errors.error(
                Reason.INVALID_REQUEST, f"skip names generation {g.generation} as open: only closed ones are skipped"
            )
        skip[g.generation] = ExportedGeneration(g.generation, g.since_us, g.until_us, g.created_at_us, g.changes)
    return skip


def export_shard(
    service: ShardsAPI, request: pb.ExportShardRequest, scratch_dir: str, node_id: str, clock: Callable[[], int]
) -> Iterator[pb.ExportShardResponse]:
    """The answers of one ExportShard call (see the module's docstring); ``clock`` is the node's (microseconds)."""
    (shard,) = service._shard_numbers(request.shard, False)
    fence = request.fence_us or None
    if fence is not None and fence > clock() + _FENCE_AHEAD_US:
        raise errors.error(
            Reason.INVALID_REQUEST,
            f"fence_us {fence} is more than a day after this node's clock: pass a fence that GetFences returned",
        )
    skip = _skips(request)
    limit = min(request.max_chunk_bytes or CHUNK_BYTES, CHUNK_BYTES)
    if service.max_answer_bytes is not None:
        limit = min(limit, service.max_answer_bytes - 256)
    limit = max(limit, 4096)
    (vnode,) = service._read([shard], request.stale_ok)
    directory = os.path.join(scratch_dir, f"export-{shard}-{uuid.uuid4().hex}")
    try:
        with vnode.replica.reading() as storage:
            if fence is not None and storage.last_ts < fence:
                raise errors.error(
                    Reason.REPLICA_BEHIND,
                    f"this replica of shard {shard} has applied up to timestamp {storage.last_ts}, "
                    f"not yet the fence {fence}",
                )
            storage.checkpoint(directory)
        export = CheckpointExport(directory, fence, skip)
        try:
            yield from _answers(export, shard, limit, node_id)
        finally:
            export.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _answers(export: CheckpointExport, shard: int, limit: int, node_id: str) -> Iterator[pb.ExportShardResponse]:
    records = 0
    total = 0
    for section in export.sections():
        head = pb.ExportSection(column_family=section.column_family, skipped=section.skipped)
        if section.generation is not None:
            head.generation.CopyFrom(_generation(section.generation))
        yield pb.ExportShardResponse(section=head)
        chunk = pb.ExportRecords()
        size = 0
        for key, value in section.records:
            if size and size + len(key) + len(value) + _RECORD_OVERHEAD > limit:
                yield pb.ExportShardResponse(records=chunk)
                chunk = pb.ExportRecords()
                size = 0
            chunk.keys.append(key)
            chunk.values.append(value)
            size += len(key) + len(value) + _RECORD_OVERHEAD
            records += 1
            total += len(key) + len(value)
        if size:
            yield pb.ExportShardResponse(records=chunk)
    done = pb.ExportDone(
        shard=shard,
        fence_us=export.fence_us,
        applied_index=export.applied_index,
        records=records,
        bytes=total,
        node=node_id,
    )
    yield pb.ExportShardResponse(done=done)


def import_shard(
    service: ShardsAPI, request: pb.ImportShardRequest, clock: Callable[[], int]
) -> pb.ImportShardResponse:
    """Log one restore step on the shard's leader; what it wrote (``clock``: the node's, in microseconds)."""
    (shard,) = service._shard_numbers(request.shard, False)
    kind = request.WhichOneof("kind")
    if kind is None:
        raise errors.error(Reason.INVALID_REQUEST, "ImportShard needs one of begin, records, finish or abandon")
    now = clock()
    if kind == "records":
        r = request.records
        check_records(shard, r.column_family, r.keys, r.values, now + RESTORE_AHEAD_US)
    if kind == "finish" and request.finish.last_ts > now + RESTORE_AHEAD_US:
        raise errors.error(
            Reason.INVALID_REQUEST,
            f"last_ts {request.finish.last_ts} is {(request.finish.last_ts - now) / 1e6:,.0f} s after this node's "
            f"clock, more than the {RESTORE_AHEAD_US // 60_000_000} minutes it takes: a backup's fence is a time "
            "its cluster had already assigned; check the clocks of both clusters, or abandon the restore",
        )
    body = cpb.VnodeCommand(import_shard=request).SerializeToString()
    (result,) = service._propose_all([(shard, body)])
    response = pb.ImportShardResponse(shard=shard)
    if kind == "records":
        response.records = int(result)
    elif isinstance(result, list):
        response.generations.extend(service._generation(info) for info in result)
    return response
