"""TLS of the node's one gRPC port: what it serves with, and what it dials its peers with.

With ``tls_cert_file`` and ``tls_key_file`` set, the port accepts TLS only:
clients, and peers carrying Raft and internal calls alike. With
``tls_client_ca_file`` it also requires a client certificate signed by that
CA (mutual TLS). A node dials its peers with TLS, checks their certificates
against ``tls_ca_file`` (or the client CA, or the system's roots) and
presents its own certificate, so the same certificate serves both ends;
peers still prove cluster membership with the cluster secret on top.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from mqds.server.config import NodeConfig


@dataclass(frozen=True)
class NodeTls:
    """The PEM material of a node with TLS on."""

    cert_chain: bytes
    private_key: bytes
    peer_ca: bytes | None
    client_ca: bytes | None

    @classmethod
    def from_config(cls, config: NodeConfig) -> NodeTls | None:
        """The node's TLS material (files read now; validate() checked them), or None without TLS."""
        if not config.tls:
            return None
        client_ca = _read(config.tls_client_ca_file)
        return cls(
            cert_chain=_read(config.tls_cert_file) or b"",
            private_key=_read(config.tls_key_file) or b"",
            peer_ca=_read(config.tls_ca_file) or client_ca,
            client_ca=client_ca,
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )

    def peer_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.peer_ca, private_key=self.private_key, certificate_chain=self.cert_chain
        )


def _read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as fh:
        return fh.read()
