"""The storage administration calls of the asyncio client: generations, deletes, backup and restore.

A part of :class:`mqds.client.aio.Client` (it inherits
:class:`AsyncStorageAdminCalls`), as :mod:`mqds.client.storage_admin` is of
the synchronous client, method for method: the requests are built by
``operations.py`` and :class:`~mqds.client.deletes.DeleteRun`, a backup's and
a restore's steps run by :mod:`mqds.client.backup_aio` on the rules of
:mod:`mqds.client.backup_runs`, as the synchronous client's are.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import TypeVar

from mqds.client import backup_aio as backups
from mqds.client import operations as ops
from mqds.client.aio_routing import AsyncRouter
from mqds.client.backup_runs import START_S, BackupReport, CallError, RestoreReport
from mqds.client.backup_runs import Progress as BackupProgress
from mqds.client.deletes import DeleteReport, DeleteRun, Progress
from mqds.client.model import Fence, Generation
from mqds.client.operations import FanoutCall, ShardCall
from mqds.v1 import cluster_pb2 as clpb

T = TypeVar("T")


class AsyncStorageAdminCalls(abc.ABC):
    """Generations, deletes, backup and restore; :class:`mqds.client.aio.Client` implements the calls below."""

    @abc.abstractmethod
    def _deadline(self, timeout_s: float | None) -> float:
        """The monotonic time a call of ``timeout_s`` (None: the client's default) must end by."""

    @abc.abstractmethod
    async def _shard_call(self, call: ShardCall[T], timeout_s: float | None, deadline: float | None = None) -> T:
        """A call to one shard's leader."""

    @abc.abstractmethod
    async def _fanout_call(self, call: FanoutCall[T], timeout_s: float | None) -> list[T]:
        """A call to every shard's leader, merged."""

    @abc.abstractmethod
    async def _n_shards(self, deadline: float) -> int:
        """The cluster's shard count (waiting for a first map until ``deadline``)."""

    @abc.abstractmethod
    def _routing(self) -> tuple[AsyncRouter, CallError]:
        """The client's router and its translation of failed calls."""

    @abc.abstractmethod
    async def get_fences(
        self, shards: Iterable[int] | None = None, *, stale_ok: bool = False, timeout_s: float | None = None
    ) -> list[Fence]:
        """The read fence of each shard."""

    @abc.abstractmethod
    async def retention(self, timeout_s: float | None = None) -> clpb.RetentionPolicy | None:
        """The cluster's retention policy."""

    # -- generations ---------------------------------------------------------

    async def add_generation(self, shard: int | None = None, timeout_s: float | None = None) -> list[Generation]:
        """Start a new generation in ``shard``, or in every shard; return the new ones."""
        return await self._fanout_call(ops.add_generation(shard), timeout_s)

    async def list_generations(
        self, shard: int | None = None, *, stale_ok: bool = False, timeout_s: float | None = None
    ) -> list[Generation]:
        """The generations of ``shard``, or of every shard, in order."""
        return await self._fanout_call(ops.list_generations(shard, stale_ok), timeout_s)

    async def drop_generation(self, shard: int, generation: int, timeout_s: float | None = None) -> Generation:
        """Drop a closed generation of a shard and free its disk; return it as it was."""
        return await self._shard_call(ops.drop_generation(shard, generation), timeout_s)

    # -- deletes -------------------------------------------------------------

    async def delete_messages(
        self,
        topic_filter: str,
        *,
        sender: str = "",
        since_us: int = 0,
        until_us: int = 0,
        confirm_all: bool = False,
        timeout_s: float | None = None,
        progress: Progress | None = None,
    ) -> DeleteReport:
        """As :meth:`mqds.client.Client.delete_messages`: a sender's or a filter's messages, shard by shard."""
        run = DeleteRun(
            await self._n_shards(self._deadline(timeout_s)),
            topic_filter,
            sender,
            since_us,
            until_us,
            confirm_all,
            progress,
        )
        while (call := run.next_call()) is not None:
            run.record(await self._shard_call(call, timeout_s))
        return run.report

    # -- backup and restore --------------------------------------------------

    async def backup(
        self,
        to: str,
        *,
        parallel: int = 2,
        incremental: bool = True,
        timeout_s: float = 3600.0,
        progress: BackupProgress | None = None,
    ) -> BackupReport:
        """As :meth:`mqds.client.Client.backup`: the whole cluster into ``to`` (a directory or an fsspec URL),
        every shard at a fence pinned now, ``parallel`` shards at a time, the manifest written last. The
        exports are tasks; the files (the previous manifest read, each answer's records written, the manifest
        written, files of earlier runs removed) are read and written in a worker thread (``asyncio.to_thread``),
        so the event loop is not blocked by them. ``progress`` is called on the event loop. Needs the admin
        role."""
        deadline = self._deadline(timeout_s)
        fences = {f.shard: f.timestamp_us for f in await self.get_fences(timeout_s=min(timeout_s, START_S))}
        router, call_error = self._routing()
        return await backups.backup(
            router,
            call_error,
            to,
            fences=fences,
            retention=await self.retention(min(timeout_s, START_S)),
            deadline=deadline,
            parallel=parallel,
            incremental=incremental,
            progress=progress,
        )

    async def restore(
        self,
        source: str,
        *,
        parallel: int = 2,
        timeout_s: float = 3600.0,
        progress: BackupProgress | None = None,
    ) -> RestoreReport:
        """As :meth:`mqds.client.Client.restore`: the backup at ``source`` into this empty cluster of the
        backup's shard count, the whole backup checked first; a failed restore abandons what it began and
        raises ``BackupError``. Checking the backup (reading every file for its checksum) and reading the
        records run in a worker thread (``asyncio.to_thread``), so the event loop is not blocked by them;
        ``progress`` is called on the event loop. Needs the admin role."""
        deadline = self._deadline(timeout_s)
        router, call_error = self._routing()
        return await backups.restore(
            router,
            call_error,
            source,
            n_shards=await self._n_shards(deadline),
            deadline=deadline,
            parallel=parallel,
            progress=progress,
        )

    async def abandon_restore(self, *, timeout_s: float = 60.0) -> list[int]:
        """As :meth:`mqds.client.Client.abandon_restore`: end every restore under way in this cluster (each
        shard's writes cleared, writable again); the shards whose restore was ended. Needs the admin role."""
        deadline = self._deadline(timeout_s)
        router, call_error = self._routing()
        return await backups.abandon_restore(router, call_error, await self._n_shards(deadline), deadline)
