"""The stubs a router calls nodes through: one of each service per node address, built once.

A stub builds a callable for every method of its service when it is made
(about 0.1 ms for Storage's); made anew for every call, that was a tenth of a
millisecond of the client's CPU on each one. They live as long as the
router's channels (``forget_stubs`` when those close). Shared by the sync and
asyncio routers, whose ``channel`` gives the channel to build them on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mqds.client.connection import ConnectionSettings
from mqds.client.core.next_answer import with_next_results
from mqds.client.core.retry import Backoff
from mqds.client.core.routing_table import RoutingTable
from mqds.v1 import cluster_pb2_grpc as clpb_grpc
from mqds.v1 import sessions_pb2_grpc as spb_grpc
from mqds.v1 import storage_pb2_grpc as pb_grpc


class StubCache:
    """``storage``, ``sessions`` and ``cluster`` stubs of a node, from the router's ``channel(address)``.

    It keeps what both routers are made of: the settings, the routing table,
    the backoff, the metadata every call carries, the credentials and the
    channel options (``channel_options`` adds or overrides raw gRPC channel
    arguments); each router adds its own state in ``_open``.
    """

    def __init__(
        self,
        seeds: Sequence[str],
        *,
        settings: ConnectionSettings | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        backoff: Backoff | None = None,
    ) -> None:
        self.settings = settings or ConnectionSettings()
        self.table = RoutingTable(seeds)
        self.backoff = backoff or Backoff()
        self.metadata = list(self.settings.call_metadata())
        # Read the PEM files now: a missing or bad one fails the constructor.
        self._credentials = self.settings.channel_credentials()
        self._options = list({**dict(self.settings.channel_options()), **dict(channel_options)}.items())
        self._stubs: dict[tuple[str, str], Any] = {}
        self._open()

    def _open(self) -> None:
        """The driver's own state (its channels, locks, threads), made last by the constructor."""
        raise NotImplementedError

    def channel(self, address: str) -> Any:
        raise NotImplementedError

    def _stub(self, service: str, address: str, build: Callable[[Any], Any]) -> Any:
        stub = self._stubs.get((service, address))
        if stub is None:  # two threads may both build one: the same stub either way
            stub = self._stubs.setdefault((service, address), build(self.channel(address)))
        return stub

    def storage(self, address: str) -> pb_grpc.StorageStub:
        return self._stub("storage", address, lambda channel: with_next_results(pb_grpc.StorageStub(channel), channel))

    def sessions(self, address: str) -> spb_grpc.SessionsStub:
        return self._stub("sessions", address, spb_grpc.SessionsStub)

    def cluster(self, address: str) -> clpb_grpc.ClusterStub:
        return self._stub("cluster", address, clpb_grpc.ClusterStub)

    def forget_stubs(self) -> None:
        """Drop every stub (their channels are closing)."""
        self._stubs.clear()
