"""The retry rules of a call that touches several shards at once (one request per leader); no I/O.

A batch write, a read of every shard, a fence per shard: :class:`Fanout`
groups the pending shards by the node that leads them (or, with
``stale_ok``, hosts them), and after each round regroups the shards that
failed retriably by their new leaders, refreshing the map and backing off
when no error named one. A request that succeeded for some of its shards and
failed for others raises :class:`ShardFailures`, so only those are retried.

The callers send the requests: :class:`mqds.client.sync.routing.Router` (the
synchronous client) with a thread pool, and
:class:`mqds.client.aio.routing.AsyncRouter` with ``asyncio.gather``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from mqds.client.core.retry import MIN_RETRY_S, Backoff
from mqds.client.core.routing_table import RoutingTable
from mqds.protocol import errors
from mqds.protocol.errors import BUSY, MqdsError, Reason

__all__ = ["Fanout", "ShardFailures"]


class ShardFailures(MqdsError):
    """Raised inside a per-leader call: these shards failed, the call's other shards succeeded."""

    def __init__(self, failed: dict[int, MqdsError]) -> None:
        first = next(iter(failed.values()))
        super().__init__(first.reason, first.message, first.metadata)
        self.errors = failed


class Fanout:
    """The retry rules of a call that touches several shards; the caller does the I/O.

    Each round sends one request per node that leads some of the pending
    shards (or, with ``stale_ok``, hosts them), in parallel: ``next_round``
    gives the groups and the time left, ``failed`` records a group's (or,
    through :class:`ShardFailures`, some shards') failure, and ``end_round``
    decides what is retried: shards that failed retriably are regrouped by
    their (new) leaders; without a leader hint the map is refreshed and the
    caller backs off (``backoff_s``) first. Shards that cannot succeed end in
    ``failures`` with their final error: DEADLINE_EXCEEDED, or the last
    retriable error when the deadline would pass during a pause or less than
    :data:`~mqds.client.core.retry.MIN_RETRY_S` would be left after it (also when
    the pause overran).
    """

    def __init__(
        self, table: RoutingTable, shards: Iterable[int], deadline: float, backoff: Backoff, *, stale_ok: bool = False
    ) -> None:
        self.table = table
        self.deadline = deadline
        self.stale_ok = stale_ok
        self.pending = sorted(set(shards))
        self.failures: dict[int, MqdsError] = {}
        self._delays = backoff.delays()
        self._failed: dict[int, MqdsError] = {}
        self._paused = False
        self.refresh_map = False
        """After a round that backs off: whether to refresh the cluster map first (not when all were OVERLOADED)."""

    def next_round(self) -> tuple[dict[str, list[int]], float] | None:
        """The next round's requests (address -> shards) and the time left; None when nothing is left to try."""
        if not self.pending:
            return None
        remaining = self.deadline - time.monotonic()
        paused, self._paused = self._paused, False
        if paused and remaining < MIN_RETRY_S:
            self.failures.update((shard, self._failed[shard]) for shard in self.pending)
            self.pending = []
            return None
        if remaining <= 0:
            timeout = errors.error(Reason.DEADLINE_EXCEEDED, "the call did not succeed before its deadline")
            self.failures.update((shard, timeout) for shard in self.pending)
            self.pending = []
            return None
        groups: dict[str, list[int]] = {}
        for shard in self.pending:
            if self.stale_ok:
                address = (self.table.replica_addresses(shard) or self.table.known_addresses())[0]
            else:
                address = self.table.leader_of(shard) or self.table.known_addresses()[0]
            groups.setdefault(address, []).append(shard)
        self._failed = {}
        return groups, remaining

    def failed(self, group: Sequence[int], err: MqdsError) -> None:
        """A request of this round failed: for all of ``group``, or for the shards a ShardFailures names."""
        if isinstance(err, ShardFailures):
            self._failed.update(err.errors)
        else:
            self._failed.update((shard, err) for shard in group)

    def end_round(self) -> bool:
        """Settle the round's failures; True when the caller must back off before the next.

        ``refresh_map`` then says whether to refresh the map first: not when
        the only trouble was OVERLOADED (busy nodes keep their leaderships).
        """
        retry: list[int] = []
        hinted = True
        busy = False
        for problem, shards in _by_error(self._failed).items():
            if not problem.retriable:
                self.failures.update((shard, problem) for shard in shards)
                continue
            retry.extend(shards)
            if problem.reason in BUSY:
                busy = True
                continue
            shard_hint = problem.metadata.get("shard")
            if shard_hint is not None and self.table.learn(problem, int(shard_hint)):
                continue
            # No usable hint: forget the leaders, refresh the map and back off.
            for shard in shards:
                self.table.forget_leader(shard)
            hinted = False
        self.pending = sorted(retry)
        self.refresh_map = not hinted
        return bool(self.pending) and (busy or not hinted)

    def backoff_s(self) -> float | None:
        """The pause before the next round; None (the pending shards failed) if under MIN_RETRY_S would be left."""
        delay = next(self._delays)
        if time.monotonic() + delay + MIN_RETRY_S >= self.deadline:
            self.failures.update((shard, self._failed[shard]) for shard in self.pending)
            self.pending = []
            return None
        self._paused = True
        return delay


def _by_error(failed: dict[int, MqdsError]) -> dict[MqdsError, list[int]]:
    grouped: dict[MqdsError, list[int]] = {}
    for shard, err in failed.items():
        grouped.setdefault(err, []).append(shard)
    return grouped
