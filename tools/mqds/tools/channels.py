"""gRPC channels through which the harness calls nodes as a member of the cluster (with the cluster secret)."""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc

from mqds.server.raft.cluster_auth import NODE_HEADER, SECRET_HEADER


class SecretMetadata(grpc.UnaryUnaryClientInterceptor):
    """Adds the cluster secret to every unary call of a channel."""

    def __init__(self, secret: str) -> None:
        self._metadata = ((SECRET_HEADER, secret), (NODE_HEADER, "harness"))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        metadata = tuple(details.metadata or ()) + self._metadata
        return continuation(_CallDetails(details.method, details.timeout, metadata, details.credentials), request)


@dataclasses.dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None = None
    compression: Any = None
