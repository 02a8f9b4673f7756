"""The storage administration calls of the synchronous client: generations, deletes, backup and restore.

A part of :class:`mqds.client.Client` (it inherits :class:`StorageAdminCalls`),
kept apart so the client's module holds its calls' machinery and reads and
writes, and this one the calls an operator makes.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import TypeVar

from mqds.client import backup as backups
from mqds.client import operations as ops
from mqds.client.backup import BackupReport, RestoreReport
from mqds.client.backup_runs import START_S, CallError
from mqds.client.backup_runs import Progress as BackupProgress
from mqds.client.deletes import DeleteReport, DeleteRun, Progress
from mqds.client.model import Fence, Generation
from mqds.client.operations import FanoutCall, ShardCall
from mqds.client.routing import Router
from mqds.v1 import cluster_pb2 as clpb

T = TypeVar("T")


class StorageAdminCalls(abc.ABC):
    """Generations, deletes, backup and restore; :class:`mqds.client.Client` implements the calls below.

    :class:`mqds.client.aio_storage_admin.AsyncStorageAdminCalls` is its
    asyncio twin, method for method.
    """

    @abc.abstractmethod
    def _deadline(self, timeout_s: float | None) -> float:
        """The monotonic time a call of ``timeout_s`` (None: the client's default) must end by."""

    @abc.abstractmethod
    def _shard_call(self, call: ShardCall[T], timeout_s: float | None, deadline: float | None = None) -> T:
        """A call to one shard's leader."""

    @abc.abstractmethod
    def _fanout_call(self, call: FanoutCall[T], timeout_s: float | None) -> list[T]:
        """A call to every shard's leader, merged."""

    @abc.abstractmethod
    def _n_shards(self, deadline: float) -> int:
        """The cluster's shard count (waiting for a first map until ``deadline``)."""

    @abc.abstractmethod
    def _routing(self) -> tuple[Router, CallError]:
        """The client's router and its translation of failed calls."""

    @abc.abstractmethod
    def get_fences(
        self, shards: Iterable[int] | None = None, *, stale_ok: bool = False, timeout_s: float | None = None
    ) -> list[Fence]:
        """The read fence of each shard."""

    @abc.abstractmethod
    def retention(self, timeout_s: float | None = None) -> clpb.RetentionPolicy | None:
        """The cluster's retention policy."""

    # -- generations ---------------------------------------------------------

    def add_generation(self, shard: int | None = None, timeout_s: float | None = None) -> list[Generation]:
        """Start a new generation in ``shard``, or in every shard; return the new ones."""
        return self._fanout_call(ops.add_generation(shard), timeout_s)

    def list_generations(
        self, shard: int | None = None, *, stale_ok: bool = False, timeout_s: float | None = None
    ) -> list[Generation]:
        """The generations of ``shard``, or of every shard, in order."""
        return self._fanout_call(ops.list_generations(shard, stale_ok), timeout_s)

    def drop_generation(self, shard: int, generation: int, timeout_s: float | None = None) -> Generation:
        """Drop a closed generation of a shard and free its disk; return it as it was."""
        return self._shard_call(ops.drop_generation(shard, generation), timeout_s)

    # -- deletes -------------------------------------------------------------

    def delete_messages(
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
        """Delete stored messages: those matching ``topic_filter``, of ``sender`` if given, stored in
        ``[since_us, until_us)`` (0: no bound; without ``until_us``, what each shard stored before the
        delete reached it). Needs the admin role (a node's cluster secret or an admin token).

        A sender's messages are deleted in its one shard, others in every shard, one after another;
        each shard's leader logs the delete in bounded steps that every replica applies, so readers,
        iterators and push subscribers see the messages gone at once. ``timeout_s`` bounds each call,
        not the whole delete: a node answers within it with what it did and where to go on, and
        ``progress(shard, answer)`` is called with each answer. Deleting everything (``#``, no sender,
        no time range) needs ``confirm_all``. Returns what was deleted, per shard.
        """
        run = DeleteRun(
            self._n_shards(self._deadline(timeout_s)), topic_filter, sender, since_us, until_us, confirm_all, progress
        )
        while (call := run.next_call()) is not None:
            run.record(self._shard_call(call, timeout_s))
        return run.report

    # -- backup and restore --------------------------------------------------

    def backup(
        self,
        to: str,
        *,
        parallel: int = 2,
        incremental: bool = True,
        timeout_s: float = 3600.0,
        progress: BackupProgress | None = None,
    ) -> BackupReport:
        """Back up the whole cluster into ``to`` (a directory or an fsspec URL): every shard at a fence
        pinned now, the broker state and the retention policy, with a manifest of checksums written
        last. ``parallel`` shards are exported at a time, each from a follower where one has reached
        its fence. Into a place that holds a backup already, closed generations it has (unchanged
        since) are not copied again unless ``incremental`` is False. Needs the admin role; see
        :mod:`mqds.client.backup`."""
        deadline = self._deadline(timeout_s)
        fences = {f.shard: f.timestamp_us for f in self.get_fences(timeout_s=min(timeout_s, START_S))}
        router, call_error = self._routing()
        return backups.backup(
            router,
            call_error,
            to,
            fences=fences,
            retention=self.retention(min(timeout_s, START_S)),
            deadline=deadline,
            parallel=parallel,
            incremental=incremental,
            progress=progress,
        )

    def restore(
        self,
        source: str,
        *,
        parallel: int = 2,
        timeout_s: float = 3600.0,
        progress: BackupProgress | None = None,
    ) -> RestoreReport:
        """Restore the backup at ``source`` into this cluster, which must be empty and have the backup's
        shard count (any size and placement). The whole backup is checked first (checksums), and a
        damaged or partial one is refused (``BackupError`` naming what is wrong). A restore that fails
        abandons what it began (the shards are empty and writable again) and raises ``BackupError`` saying
        what failed and what was abandoned. Needs the admin role."""
        deadline = self._deadline(timeout_s)
        router, call_error = self._routing()
        return backups.restore(
            router,
            call_error,
            source,
            n_shards=self._n_shards(deadline),
            deadline=deadline,
            parallel=parallel,
            progress=progress,
        )

    def abandon_restore(self, *, timeout_s: float = 60.0) -> list[int]:
        """End every restore under way in this cluster (one a stopped ``mqds restore`` left behind): what each
        wrote is cleared and the shard takes writes again; the shards whose restore was ended. A shard not being
        restored is left as it is. Needs the admin role."""
        deadline = self._deadline(timeout_s)
        router, call_error = self._routing()
        return backups.abandon_restore(router, call_error, self._n_shards(deadline), deadline)
