"""The cluster secret between nodes: sent with every internal call, checked on every one received.

On gRPC the secret travels in the call metadata (``SECRET_HEADER``, compared in
constant time) with the caller's id and address; the Raft TCP link proves it
with an HMAC in its handshake (``secret``, :mod:`mqds.server.raft.tcp_link`).
Without a secret a node accepts internal calls only in ``dev_mode``.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

import grpc

from mqds.protocol import errors
from mqds.protocol.errors import Reason

SECRET_HEADER = "x-mqds-cluster-secret"
NODE_HEADER = "x-mqds-node-id"
ADDRESS_HEADER = "x-mqds-node-address"


class ClusterAuth:
    """The cluster secret: checked on every internal call, sent with every outgoing one."""

    def __init__(self, node_id: str, address: str, secret: str, dev_mode: bool) -> None:
        self.node_id = node_id
        self.address = address
        self._secret = secret.encode("utf-8")
        self.dev_mode = dev_mode

    @property
    def secret(self) -> bytes:
        """The cluster secret (empty: none), for the Raft TCP handshake's proof."""
        return self._secret

    def metadata(self) -> list[tuple[str, str]]:
        md = [(NODE_HEADER, self.node_id), (ADDRESS_HEADER, self.address)]
        if self._secret:
            md.append((SECRET_HEADER, self._secret.decode("utf-8")))
        return md

    def is_node(self, metadata: Mapping[str, str]) -> bool:
        """Whether a call's metadata carries the cluster secret (the caller is a node of this cluster)."""
        return bool(self._secret) and hmac.compare_digest(metadata.get(SECRET_HEADER, "").encode("utf-8"), self._secret)

    def check(self, context: grpc.ServicerContext) -> tuple[str, str]:
        """The calling node's (id, address); raises UNAUTHENTICATED unless it proved it is one of us."""
        md = {key: value for key, value in context.invocation_metadata()}
        if self._secret:
            given = md.get(SECRET_HEADER, "")
            if not hmac.compare_digest(given.encode("utf-8"), self._secret):
                raise errors.error(
                    Reason.UNAUTHENTICATED, "internal call without the right cluster secret (cluster_secret)"
                )
        elif not self.dev_mode:
            raise errors.error(
                Reason.UNAUTHENTICATED,
                "this node has no cluster_secret and is not in dev_mode: it accepts no internal calls",
            )
        return str(md.get(NODE_HEADER, "")), str(md.get(ADDRESS_HEADER, ""))
