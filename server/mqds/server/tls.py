"""TLS of the node's gRPC port and Raft TCP port: what it serves with, and what it dials its peers with.

With ``tls_cert_file`` and ``tls_key_file`` set, the port accepts TLS only:
clients, and peers carrying Raft and internal calls alike. With
``tls_client_ca_file`` it also requires a client certificate signed by that
CA (mutual TLS). A node dials its peers with TLS, checks their certificates
against ``tls_ca_file`` (or the client CA, or the system's roots) and
presents its own certificate, so the same certificate serves both ends;
peers still prove cluster membership with the cluster secret on top.
"""

from __future__ import annotations

import ssl
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
    cert_file: str = ""
    key_file: str = ""

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
            cert_file=config.tls_cert_file,
            key_file=config.tls_key_file,
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

    def raft_server_context(self) -> ssl.SSLContext:
        """TLS of the Raft TCP listener: the node's certificate; a peer's required when clients' are (mTLS)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_file, self.key_file)
        if self.client_ca is not None:
            context.load_verify_locations(cadata=self.client_ca.decode("ascii"))
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def raft_client_context(self) -> ssl.SSLContext:
        """TLS of Raft TCP connections to peers: their certificates checked as the gRPC channels check them."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.peer_ca is not None:
            context.load_verify_locations(cadata=self.peer_ca.decode("ascii"))
        else:
            context.load_default_certs()
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


def _read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as fh:
        return fh.read()
