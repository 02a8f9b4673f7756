"""The retry rules of a call to one shard, and of waiting for a first cluster map; no I/O.

:class:`Backoff` gives the pauses (exponential, full jitter). :class:`MapWait`
asks for the map again and again while no node answers, so a client started
before its cluster (or one that lost every node at once) waits for it until
the call's deadline; only then does the call fail, with UNAVAILABLE naming
the endpoints tried and the last cause. :class:`ShardRetry` decides, after
each failure of a call to one shard, whether to retry (NOT_LEADER, NO_LEADER,
OVERLOADED, an unreachable node), where (the hinted leader, the next
replica), whether to refresh the map first, and how long to back off.
:class:`NodeRounds` is a call any of several nodes may answer (setting the
retention policy, exporting a shard for a backup): the nodes asked in
turn, round after round, with a pause between rounds.

The callers do the I/O and the waiting: :class:`mqds.client.sync.routing.Router`
with threads, :class:`mqds.client.aio.routing.AsyncRouter` with tasks.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

from mqds.client.core.routing_table import RoutingTable
from mqds.protocol import errors
from mqds.protocol.errors import BUSY, MqdsError, Reason

__all__ = ["MIN_RETRY_S", "Backoff", "MapWait", "NodeRounds", "ShardRetry", "time_left"]

# While waiting for a first map, a refresh is not started with less time than this.
_MIN_MAP_WAIT_TRY_S = 0.1

# A retry after a pause is not started with less time than this: the call fails with the error it was
# retrying (STORAGE_FULL, NO_LEADER, ...), not with a DEADLINE_EXCEEDED of an attempt that had no time to work.
MIN_RETRY_S = 0.1

# Errors after which the node asked may be down: try another replica, refresh.
_UNREACHABLE = (Reason.UNAVAILABLE, Reason.SHUTTING_DOWN, Reason.DEADLINE_EXCEEDED)
_REDIRECTS = (Reason.NOT_LEADER, Reason.NOT_HOSTED)


def time_left(deadline: float) -> float:
    """What is left of a call's deadline, 0.1 s at least (the call's next part still gets a try)."""
    return max(0.1, deadline - time.monotonic())


@dataclass
class Backoff:
    """Exponential backoff with full jitter, in seconds."""

    initial_s: float = 0.05
    max_s: float = 1.0
    multiplier: float = 2.0

    def delays(self) -> Iterator[float]:
        delay = self.initial_s
        while True:
            yield random.uniform(0, delay)
            delay = min(delay * self.multiplier, self.max_s)


class MapWait:
    """The retry rules of getting the cluster map while no node answers; the caller does the I/O.

    A refresh that no node answered (every one refused the connection, was
    unreachable, or is not part of a cluster yet) is tried again after the
    backoff, until ``deadline``: a client started before its cluster waits
    for it. ``timeout_s`` gives the next refresh's time (or raises the final
    error once the deadline has passed); after a failed refresh, ``failed``
    gives the pause, or raises: at once for an error retrying cannot help
    (a refused credential), else the final error when the deadline would
    pass first. The final error is UNAVAILABLE, naming the endpoints tried
    and the last cause, and how long it waited.

    >>> wait = MapWait(time.monotonic() + 60, Backoff(initial_s=0.01))
    >>> refused = errors.error(Reason.UNAVAILABLE, "no mqds node answered at a:1 (a:1: connection refused)")
    >>> 0 <= wait.failed(refused) <= 0.01
    True
    >>> MapWait(time.monotonic(), Backoff()).failed(refused)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    mqds.protocol.errors.UnavailableError: UNAVAILABLE: no mqds node ... refused); still none after 1 attempt in 0.0 s
    """

    def __init__(self, deadline: float, backoff: Backoff) -> None:
        self.deadline = deadline
        self.started = time.monotonic()
        self.attempts = 0
        self.last: MqdsError | None = None
        self._delays = backoff.delays()

    def timeout_s(self) -> float:
        """The time the next refresh may take; raises the final error when the deadline has passed."""
        remaining = self.deadline - time.monotonic()
        if self.attempts == 0:
            return max(remaining, _MIN_MAP_WAIT_TRY_S)  # one try, however short the deadline
        if remaining <= 0:
            raise self.final()
        return remaining

    def failed(self, err: MqdsError) -> float:
        """A refresh failed with ``err``: the pause before the next one, or raises."""
        self.attempts += 1
        if not err.retriable:
            raise err
        self.last = err
        delay = next(self._delays)
        remaining = self.deadline - time.monotonic()
        if remaining < _MIN_MAP_WAIT_TRY_S:
            raise self.final()
        # Leave the last refresh time enough to tell why it failed.
        return min(delay, remaining - _MIN_MAP_WAIT_TRY_S)

    def final(self) -> MqdsError:
        """The error that ends the wait: the last refresh's, with how long it waited."""
        elapsed = time.monotonic() - self.started
        tries = f"{self.attempts} attempt" + ("s" if self.attempts != 1 else "")
        last = self.last or errors.error(Reason.UNAVAILABLE, "no mqds node answered")
        return errors.error(last.reason, f"{last.message}; still none after {tries} in {elapsed:.1f} s")


class ShardRetry:
    """The retry rules of one call to a shard's leader (or any replica); the caller does the I/O.

    ``next_attempt`` says where to send and how long is left; after a
    failure, ``failed`` raises the error when retrying cannot help and
    otherwise says whether to back off before the next attempt (False when a
    NOT_LEADER hint already named the leader), and ``refresh_map`` whether
    the map must be refreshed first (not for OVERLOADED: the node is busy,
    not gone, and stays the leader); then ``backoff_s`` gives the pause, or
    raises the error when the deadline would pass first.
    ``retry_unavailable=False`` gives up on an unreachable node (for writes
    whose first attempt may have been applied).
    """

    def __init__(
        self,
        table: RoutingTable,
        shard: int | None,
        deadline: float,
        backoff: Backoff,
        *,
        any_replica: bool = False,
        retry_unavailable: bool = True,
    ) -> None:
        self.table = table
        self.shard = shard
        self.deadline = deadline
        self.any_replica = any_replica
        self.retry_unavailable = retry_unavailable
        self._delays = backoff.delays()
        # Which replica an any-replica call asks: its first turn (RoutingTable.next_turn), then the next.
        self._replica_turn = table.next_turn() if any_replica else 0
        self.refresh_map = True
        """After a failure that backs off: whether to refresh the cluster map first."""
        self._paused_after: MqdsError | None = None

    def next_attempt(self) -> tuple[str, float]:
        remaining = self.deadline - time.monotonic()
        paused_after, self._paused_after = self._paused_after, None
        if paused_after is not None and remaining < MIN_RETRY_S:
            raise paused_after
        if remaining <= 0:
            raise errors.error(Reason.DEADLINE_EXCEEDED, "the call did not succeed before its deadline")
        address = self.table.address_for(self.shard, any_replica=self.any_replica, attempt=self._replica_turn)
        return address, remaining

    def failed(self, err: MqdsError) -> bool:
        if not err.retriable:
            raise err
        self.refresh_map = err.reason not in BUSY
        if err.reason in BUSY:
            pass  # the same node, after a pause: forgetting it made a busy cluster refresh its map again and again
        elif err.reason in _UNREACHABLE:
            if not self.retry_unavailable:
                raise err
            self._replica_turn += 1
            if self.shard is not None:
                self.table.forget_leader(self.shard)
        elif err.reason is Reason.REPLICA_BEHIND:
            self._replica_turn += 1  # the next replica may have applied further
        elif err.reason in _REDIRECTS and self.any_replica:
            # A node the map lists as a replica does not host the shard (moved away): the next replica,
            # after a map refresh. Going back to the same node on a leader hint would ask it again and again.
            self.table.learn(err, self.shard)
            self._replica_turn += 1
        elif err.reason in _REDIRECTS:
            if self.table.learn(err, self.shard):
                return False
        elif self.shard is not None:  # NO_LEADER, OVERLOADED, ...
            self.table.forget_leader(self.shard)
        return True

    def backoff_s(self, err: MqdsError) -> float:
        delay = next(self._delays)
        if time.monotonic() + delay + MIN_RETRY_S >= self.deadline:
            raise err
        self._paused_after = err
        return delay


class NodeRounds:
    """The retry rules of a call that any of several nodes may answer; the caller does the I/O.

    The caller asks the nodes of a round one after the other, each with
    ``remaining()`` seconds (None: the deadline has passed, the round
    ends); a node that fails goes to ``failed``, which raises at once what
    retrying cannot help (a refused credential, an invalid request). After
    a round that no node answered, the caller pauses ``pause_s()`` (from
    ``first_pause_s``, doubling up to ``max_pause_s``) and starts the next
    while ``going_on()``; at the end it raises ``error()``: the last
    failure, or DEADLINE_EXCEEDED when no node was asked.

    >>> rounds = NodeRounds(time.monotonic() + 60, first_pause_s=0.05, max_pause_s=0.1)
    >>> rounds.failed(errors.error(Reason.UNAVAILABLE, "a:1 is down"))
    >>> [rounds.pause_s() for _ in range(3)], rounds.error("no node answered in time").reason
    ([0.05, 0.1, 0.1], <Reason.UNAVAILABLE: 'UNAVAILABLE'>)
    >>> NodeRounds(time.monotonic(), first_pause_s=0.05, max_pause_s=0.1).error("no node answered in time")
    DeadlineExceededError('no node answered in time')
    """

    def __init__(self, deadline: float, *, first_pause_s: float, max_pause_s: float) -> None:
        self.deadline = deadline
        self.last: MqdsError | None = None
        """The last failure of a node."""
        self._pause = first_pause_s
        self._max_pause = max_pause_s

    def going_on(self) -> bool:
        """Whether another round may start."""
        return time.monotonic() < self.deadline

    def remaining(self) -> float | None:
        """The time the next node of the round may take; None once the deadline has passed."""
        left = self.deadline - time.monotonic()
        return left if left > 0 else None

    def failed(self, err: MqdsError) -> None:
        """A node failed with ``err``: raised when retrying cannot help, else kept as the last failure."""
        self.last = err
        if not err.retriable:
            raise err from None

    def pause_s(self) -> float:
        """The pause after a round no node answered."""
        pause, self._pause = self._pause, min(self._pause * 2, self._max_pause)
        return pause

    def error(self, what: str) -> MqdsError:
        """The error that ends the call: the last node's failure, else DEADLINE_EXCEEDED saying ``what``."""
        return self.last or errors.error(Reason.DEADLINE_EXCEEDED, what)
