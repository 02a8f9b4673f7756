"""Futures: what a caller holds while Raft works on its request.

A :class:`Proposal` waits for a command to be committed and applied, and
carries the state machine's result (or pysyncobj's failure reason, turned
into an ``MqdsError``); a :class:`PendingRead` waits for a read index to be
confirmed (see ``reads.py``). Both are completed by the thread running the group's cycle and
waited on by the caller's (a gRPC handler), so they only hold an event and a
result, and know nothing of the group beyond its id.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from pysyncobj import FAIL_REASON

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.server.raft.names import group_name


@dataclass
class PendingRead:
    """A linearizable read waiting for its read index; ``wait`` returns once it may be served."""

    group: int
    done: threading.Event = field(default_factory=threading.Event)
    round: int = 0
    term: int = 0
    read_index: int = 0
    error: errors.MqdsError | None = None

    def wait(self, timeout_s: float) -> None:
        if not self.done.wait(timeout_s):
            raise errors.error(
                Reason.DEADLINE_EXCEEDED, f"{group_name(self.group)}: could not confirm leadership in time"
            )
        if self.error is not None:
            raise self.error


@dataclass
class Proposal:
    """A command handed to Raft; ``wait`` returns the machine's result."""

    group: int
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    fail: int | None = None

    def on_result(self, result: Any, fail: int) -> None:
        if fail == FAIL_REASON.SUCCESS:
            self.result = result
        else:
            self.fail = fail
        self.done.set()

    def failed(self) -> errors.MqdsError | None:
        """The error it ended with, if it ended and failed (None while in flight, or when it succeeded)."""
        if not self.done.is_set():
            return None
        if self.fail is not None:
            return _fail_error(self.group, self.fail)
        return self.result if isinstance(self.result, errors.MqdsError) else None

    def wait(self, timeout_s: float) -> Any:
        if not self.done.wait(timeout_s):
            raise errors.error(
                Reason.DEADLINE_EXCEEDED,
                f"{group_name(self.group)}: not committed within {timeout_s:g}s; it may still be applied",
            )
        if self.fail is not None:
            raise _fail_error(self.group, self.fail)
        if isinstance(self.result, errors.MqdsError):
            raise self.result
        return self.result


def _fail_error(group: int, fail: int) -> errors.MqdsError:
    name = group_name(group)
    if fail == FAIL_REASON.QUEUE_FULL:
        return errors.error(Reason.OVERLOADED, f"{name}: too many commands waiting; retry later")
    if fail in (FAIL_REASON.MISSING_LEADER, FAIL_REASON.NOT_LEADER):
        return errors.error(Reason.NO_LEADER, f"{name}: no leader now (election in progress); retry")
    if fail == FAIL_REASON.DISCARDED:
        return errors.error(Reason.NO_LEADER, f"{name}: leader changed before the command committed; retry")
    if fail == FAIL_REASON.REQUEST_DENIED:
        return errors.error(
            Reason.MEMBERSHIP_CHANGE_IN_PROGRESS, f"{name}: another membership change is not committed yet; retry"
        )
    return errors.error(
        Reason.DEADLINE_EXCEEDED, f"{name}: leader changed while the command was in flight; it may have been applied"
    )
