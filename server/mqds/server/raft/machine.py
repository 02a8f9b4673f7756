"""The replicated state machine: its contract with a group, and how committed entries reach it.

Like hashicorp/raft's ``fsm.go``: :class:`StateMachine` is all a group knows of
what it replicates, and :class:`CommandApplier` (held by ``RaftGroup``)
is what ``RaftCore`` calls, through the group, to read and apply commands, so the log holds
bytes, never pickles: ``0x00 + body`` goes to ``machine.apply``, ``0x02 +
MembershipChange`` changes the members. Applying is made total here: an
entry whose command fails the same way on every replica is recorded as
applied with an error for its proposer, so one bad entry never wedges a shard.
It also tells how far apply trails the commit index, and for how long it has
not moved (``apply_stalled_s``, which readiness reads).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, cast

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.server.raft import batching, codec
from mqds.server.raft.clock import now as raft_clock

log = logging.getLogger(__name__)


class StateMachine(Protocol):
    """What a group replicates. Apply must be deterministic: same entries, same state, on every replica."""

    @property
    def applied_index(self) -> int:
        """The last log index whose effect is in the machine's storage (0 if none)."""

    def apply(self, command: bytes, index: int) -> Any:
        """Apply one regular entry; skip it if ``index <= applied_index``. The result goes to the proposer.

        Must be total: a command that cannot be applied is answered with an
        ``MqdsError`` as its result, the same on every replica. Only a failure
        of this replica's environment (``STORAGE_ERROR``, ``OSError``,
        ``MemoryError``) may be raised: the group then retries the entry,
        and readiness reports the stall. Anything else raised is taken as the
        entry's deterministic failure (see ``CommandApplier._apply_regular``).
        """

    # Optional: ``apply_batch(bodies, index) -> list`` applies the regular
    # commands of a group-committed entry (``batching.py``) in order, each
    # result (or MqdsError) in the list; a machine without it gets no batches.

    def skip(self, index: int) -> None:
        """Record entry ``index`` as applied though it changed nothing here.

        An election's no-op, a membership change, or a command whose apply
        failed: the machine's applied index must still reach it, or a restart
        compares a lower applied index with a snapshot manifest taken at the
        entry and asks for a snapshot that no replica can serve.
        """

    def snapshot(self) -> bytes:
        """Make everything applied durable and return the manifest payload describing it."""

    def install(self, payload: bytes, index: int, source: str, members: list[str]) -> None:
        """Replace the state with one that includes log index ``index`` (from ``source``'s manifest).

        Blocks until done; called inside the group's cycle (on the scheduler's long lane), only when
        ``applied_index < index``. Must not return before the state is installed.
        """


class AppliedLog(Protocol):
    """What the applier reads and asks of the group's Raft (``RaftCore`` meets it)."""

    @property
    def commit_index(self) -> int: ...

    @property
    def last_applied(self) -> int: ...

    @property
    def leader_commit_index(self) -> int: ...

    def change_cluster(self, request: tuple[str, str]) -> None: ...


class CommandApplier:
    """A group's parsing and applying of commands that are bytes, and how far apply trails the commits.

    Its ``apply_entry`` and ``parse_membership`` are what ``RaftCore`` calls
    back (``CoreHooks``, through the group).
    """

    def __init__(
        self,
        name: str,
        machine: StateMachine,
        raft: AppliedLog,
        on_disk_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._name = name
        self._machine = machine
        self._raft = raft
        self.on_disk_failure = on_disk_failure
        """Told of a failure of this replica's storage (its disk): the node fences its log and restarts from disk."""
        self.apply_failures = 0
        """Committed entries whose command could not be applied (recorded as failed on every replica)."""
        self._applied_seen = 0
        self._applied_moved_at = raft_clock()

    def _disk_failed(self, err: BaseException) -> None:
        # RocksDB refuses every write after one failed ("Writer has previous error"): retrying
        # cannot help, reopening from what is durable can.
        if self.on_disk_failure is not None:
            self.on_disk_failure(err)

    def catch_up_lag(self) -> int:
        """Entries committed (as far as this replica knows from its leader) that it has not applied yet.

        Cheaper than ``status()``: readiness asks it of every group several times a second.
        """
        raft = self._raft
        return max(0, max(raft.leader_commit_index, raft.commit_index) - raft.last_applied)

    def note_progress(self) -> None:
        """After each cycle: remember when the applied index last moved, or had nothing to catch up."""
        applied = self._raft.last_applied
        if applied != self._applied_seen or self.catch_up_lag() == 0:
            self._applied_seen = applied
            self._applied_moved_at = raft_clock()

    def apply_stalled_s(self) -> float:
        """How long committed entries have waited here while none was applied (0 when none waits).

        A group whose apply keeps failing (its disk), or whose thread is stuck,
        reports a growing figure, so readiness can tell it from a replica that
        is merely busy catching up. Accurate to a cycle (at most a second idle).
        """
        if self.catch_up_lag() == 0:
            return 0.0
        return max(0.0, raft_clock() - self._applied_moved_at)

    def parse_membership(self, command: bytes) -> tuple[str, str] | None:
        """Whether a command is a membership change: ``0x02 + MembershipChange``, never a pickle."""
        if not command or command[0] != codec.COMMAND_MEMBERSHIP:
            return None
        return codec.decode_membership(command[1:])

    def apply_entry(self, command: bytes, index: int) -> Any:
        """Apply committed entry ``index``: its result goes to its proposer."""
        kind = command[0]
        if kind == codec.COMMAND_REGULAR:
            return self._apply_regular(command[1:], index)
        if kind == codec.COMMAND_BATCH:
            # A view: the batch is split into its commands, which copies them anyway.
            return self._apply_regular(memoryview(command)[1:], index, batch=True)
        if kind == codec.COMMAND_MEMBERSHIP:
            # After a restart the journal is replayed: apply the change again
            # (a no-op when already in effect).
            self._raft.change_cluster(codec.decode_membership(command[1:]))
        if index > self._machine.applied_index:
            self._machine.skip(index)
        return None

    def _apply_regular(self, body: bytes | memoryview, index: int, batch: bool = False) -> Any:
        """``machine.apply`` (or ``apply_batch``), made total: a deterministic failure becomes the result.

        Whatever a committed entry holds, every replica must get past it the
        same way. An exception from the command itself (a bug, or input the
        leader's checks let through) would otherwise fail the cycle, and the
        group would retry the same entry forever, on every replica and after
        every restart: the shard dead for good. So it is logged, the entry is
        recorded as applied, and the proposer gets an error. A failure of
        this replica's environment (its disk, its memory) is not the entry's
        fault and is raised: the cycle retries it, and readiness reports a
        group whose applied index stopped behind its commit index.
        """
        try:
            if batch:
                apply_batch = getattr(self._machine, "apply_batch", None)
                if apply_batch is None:
                    raise errors.error(
                        Reason.INTERNAL, f"{self._name}: a batch entry, but the machine takes no batches"
                    )
                result = apply_batch(batching.decode(body), index)
            else:
                result = self._machine.apply(cast(bytes, body), index)  # a view only ever comes with batch
        except errors.MqdsError as err:
            if err.reason is Reason.STORAGE_ERROR:
                self._disk_failed(err)
                raise
            failure: BaseException = err
        except OSError as err:
            self._disk_failed(err)
            raise
        except MemoryError:
            raise
        except Exception as err:  # any other failure is the entry's own
            failure = err
        else:
            if index > self._machine.applied_index:
                # A refusal the machine answered without writing (a reused
                # sequence number, a generation already dropped): applied all the same.
                self._machine.skip(index)
            return result
        log.error("%s: log entry %d could not be applied; recorded as failed", self._name, index, exc_info=failure)
        self.apply_failures += 1
        if index > self._machine.applied_index:
            self._machine.skip(index)
        if isinstance(failure, errors.MqdsError):
            return failure
        return errors.error(
            Reason.INTERNAL,
            f"{self._name}: log entry {index} could not be applied ({type(failure).__name__}); "
            "every replica recorded it as failed and went on",
        )
