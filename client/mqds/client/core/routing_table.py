"""The client's map of the cluster: the seeds and the cluster view, and one refresh of it.

The map is learned from any node (``Cluster.GetClusterMap``) and kept fresh
three ways: a NOT_LEADER error names the leader, which patches the map at
once (:meth:`RoutingTable.learn`); a node that cannot be reached, or a shard
without a leader, makes the caller forget that leader and refresh the map
from every known node (:class:`MapRefresh`); and concurrent callers that need
a refresh share one (the first does it, the others wait for its result,
success or failure: :meth:`RoutingTable.can_share_refresh`,
:meth:`RoutingTable.shared_failure`).

Nothing here does I/O: the synchronous router (:mod:`mqds.client.sync.routing`)
and the asyncio one (:mod:`mqds.client.aio.routing`) fetch the maps and hand
the answers to a :class:`MapRefresh`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Sequence

import grpc

from mqds.protocol import errors
from mqds.protocol.cluster_view import ClusterView
from mqds.protocol.errors import MqdsError, Reason
from mqds.v1 import cluster_pb2 as clpb

__all__ = ["CREDENTIAL_CODES", "MapLookups", "MapRefresh", "RoutingTable"]

# Refresh at most this often when nothing is wrong (a NOT_LEADER hint or a
# failure always allows one).
_MIN_REFRESH_INTERVAL_S = 0.1

# A map fetch refused with one of these ends the refresh at once: every node
# checks the same credentials, so asking the others cannot help.
CREDENTIAL_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class RoutingTable:
    """The seeds and the cluster view, patched from errors and refreshes; safe to share between threads."""

    def __init__(self, seeds: Sequence[str]) -> None:
        self.seeds = list(seeds)
        self.view = ClusterView()
        self.refreshed_at = 0.0
        # The last refresh that no node answered, and when it ended.
        self.last_failure: MqdsError | None = None
        self.failed_at = 0.0
        self._lock = threading.Lock()
        self._turns = itertools.count()

    def next_turn(self) -> int:
        """A new number for each call that may read any replica: calls start at replicas in turn.

        Consecutive reads of one stream (a replay's, a Spark task's) then go
        to each replica in turn, and many readers spread evenly, whichever
        shards hold their data. Reads up to a fence return the same from any
        replica, so nothing depends on which one answers.
        """
        return next(self._turns)

    def known_addresses(self) -> list[str]:
        with self._lock:
            return sorted(set(self.seeds) | set(self.view.addresses.values()))

    def leader_of(self, shard: int) -> str | None:
        """The address of the shard's leader (or, without a known leader, its first replica)."""
        with self._lock:
            view = self.view
            leader = view.leaders.get(shard)
            node = leader[1] if leader else next(iter(view.replicas.get(shard, [])), None)
            return view.addresses.get(node) if node else None

    def replica_addresses(self, shard: int) -> list[str]:
        with self._lock:
            return [self.view.addresses[n] for n in self.view.replicas.get(shard, []) if n in self.view.addresses]

    def address_for(self, shard: int | None, *, any_replica: bool = False, attempt: int = 0) -> str:
        """Where to send a request for ``shard``: its leader, or (``any_replica``) its replicas in turn.

        The turn starts at a replica chosen by ``attempt`` and the shard
        number, so that reads spread over the nodes (see :meth:`next_turn`).
        """
        if shard is None:
            return self.known_addresses()[0]
        if any_replica:
            candidates = self.replica_addresses(shard) or self.known_addresses()
            return candidates[(shard + attempt) % len(candidates)]
        return self.leader_of(shard) or self.known_addresses()[0]

    def learn(self, err: MqdsError, shard: int | None) -> bool:
        """Patch the map from a NOT_LEADER hint; True when it named a leader."""
        leader = err.metadata.get("leader")
        if not leader or shard is None:
            return False
        address = err.metadata.get("leader_address")
        with self._lock:
            if address:
                self.view.addresses[leader] = address
            term = self.view.leaders.get(shard, (0, ""))[0]
            self.view.leaders[shard] = (term, leader)
        return True

    def forget_leader(self, shard: int) -> None:
        with self._lock:
            self.view.leaders.pop(shard, None)

    def merge(self, maps: Iterable[clpb.ClusterMap]) -> None:
        with self._lock:
            for cmap in maps:
                self.view.merge(cmap)

    def cluster_map(self) -> clpb.ClusterMap:
        with self._lock:
            return self.view.to_pb()

    def can_share_refresh(self, started: float, force: bool) -> bool:
        """Whether a caller that wanted a refresh at ``started`` can use the map as it is now.

        True when a refresh finished after ``started`` (someone refreshed
        while this caller waited its turn) or, unless ``force``, a moment
        before it.
        """
        if self.view.version < 0:
            return False
        if self.refreshed_at >= started:
            return True
        return not force and self.refreshed_at >= started - _MIN_REFRESH_INTERVAL_S

    def shared_failure(self, started: float) -> MqdsError | None:
        """The failure of a refresh that ended after ``started`` (while this caller waited its turn), if any.

        A caller queued behind a refresh that no node answered gets that
        answer instead of asking the same nodes again at once.
        """
        if self.last_failure is not None and self.failed_at >= started and self.failed_at > self.refreshed_at:
            return self.last_failure
        return None

    def refresh_busy(self) -> MqdsError:
        """The error of a caller that could not start a refresh in time: another one held it that long."""
        last = f" (last: {self.last_failure.message})" if self.last_failure is not None else ""
        return errors.error(
            Reason.UNAVAILABLE,
            f"no mqds node answered at {', '.join(self.known_addresses())} in time: "
            f"another call's refresh of the cluster map was still waiting for them{last}",
        )


class MapLookups:
    """What a router answers from its :class:`RoutingTable` (``self.table``) without I/O.

    Shared by the synchronous and the asyncio router, so callers that only
    look at the map (a backup choosing the replica to export from, a push
    subscription choosing where to follow) ask either the same way.
    """

    table: RoutingTable

    @property
    def seeds(self) -> list[str]:
        return self.table.seeds

    @property
    def view(self) -> ClusterView:
        return self.table.view

    def known_addresses(self) -> list[str]:
        """Every node address known: the seeds and the map's."""
        return self.table.known_addresses()

    def leader_of(self, shard: int) -> str | None:
        """The address of the shard's leader (or, without a known leader, its first replica)."""
        return self.table.leader_of(shard)

    def replica_addresses(self, shard: int) -> list[str]:
        """The addresses of the shard's replicas, as the map has them."""
        return self.table.replica_addresses(shard)

    def learn(self, err: MqdsError, shard: int | None) -> bool:
        """Patch the map from a NOT_LEADER hint; True when it named a leader."""
        return self.table.learn(err, shard)

    def forget_leader(self, shard: int) -> None:
        """Forget the shard's leader (it failed): the next call refreshes the map or asks a replica."""
        self.table.forget_leader(shard)


class MapRefresh:
    """One refresh: ask every known node for its map, then the nodes those maps name, and merge the answers.

    >>> table = RoutingTable(["a:1"])
    >>> refresh = MapRefresh(table)
    >>> refresh.next_addresses()
    ['a:1']
    >>> refresh.answer("a:1", None, "connection refused")
    >>> refresh.next_addresses()
    []
    >>> refresh.finish()
    Traceback (most recent call last):
    mqds.protocol.errors.UnavailableError: UNAVAILABLE: no mqds node answered at a:1 (a:1: connection refused)
    """

    @classmethod
    def begin(cls, table: RoutingTable, started: float, force: bool) -> MapRefresh | None:
        """A refresh for a caller that began waiting for one at ``started``; None when the refresh another
        caller finished meanwhile will do (its map is ``table.view``); raises the failure of one that failed."""
        if table.can_share_refresh(started, force):
            return None
        if (failure := table.shared_failure(started)) is not None:
            raise failure
        return cls(table)

    def __init__(self, table: RoutingTable) -> None:
        self.table = table
        self._asked: set[str] = set()
        self._answered = 0
        self._failures: dict[str, str] = {}

    def next_addresses(self) -> list[str]:
        """The nodes to ask next (all at once); empty when every known node was asked."""
        addresses = [a for a in self.table.known_addresses() if a not in self._asked]
        self._asked.update(addresses)
        return addresses

    def answer(self, address: str, cmap: clpb.ClusterMap | None, failure: str = "") -> None:
        """What ``address`` answered: its map, or None and why not (a map without shards counts as none)."""
        if cmap is not None and cmap.n_shards <= 0:
            cmap, failure = None, "it has no cluster map yet"
        if cmap is None:
            self._failures[address] = failure
            return
        self._answered += 1
        self.table.merge([cmap])

    def answers(self, results: dict[str, tuple[clpb.ClusterMap | None, str] | None]) -> None:
        """A round's answers, by address: each ``(map or None, why not)``, or None for a node that did not
        answer before the round's wait ended."""
        for address, result in results.items():
            if result is None:
                self.answer(address, None, "no answer in time")
            else:
                self.answer(address, *result)

    def finish(self) -> ClusterView:
        """The refreshed view; UNAVAILABLE, with each node's failure, when no node answered."""
        if not self._answered:
            why = "; ".join(f"{a}: {f}" for a, f in sorted(self._failures.items()) if f)
            failure = errors.error(
                Reason.UNAVAILABLE,
                f"no mqds node answered at {', '.join(sorted(self._asked))}" + (f" ({why})" if why else ""),
            )
            self.table.last_failure, self.table.failed_at = failure, time.monotonic()
            raise failure
        self.table.refreshed_at = time.monotonic()
        return self.table.view
