"""How the ExHook provider authenticates EMQX: mutual TLS, required wherever another machine can connect.

EMQX's ExHook client sends no credentials of its own: its server settings
(``exhook.servers``: url, request_timeout, failed_action, ssl,
socket_options, auto_reconnect, pool_size) have no header, metadata or token
to send. What it can do is TLS with a client certificate (``ssl { enable,
certfile, keyfile, cacertfile, verify }`` with an ``https://`` url). So the
provider authenticates its caller by mutual TLS: it serves TLS and requires a
client certificate signed by ``client_ca``; a caller without one, or with one
of another CA, fails the handshake before any call is read.

Whoever may call the provider stores messages and client state with its
token, so an unauthenticated listener (plaintext, or TLS without a client
CA) is allowed on a loopback address only (:func:`check_listener`), unless
the caller of :class:`~mqds.broker.exhook.provider.ExhookServer` asks for it
by name (``mqds exhook --insecure-no-client-auth``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from mqds.protocol.addresses import is_loopback

__all__ = ["INSECURE_FLAG", "ProviderTLS", "check_listener"]

INSECURE_FLAG = "--insecure-no-client-auth"


@dataclass(frozen=True)
class ProviderTLS:
    """The provider's certificate and key (PEM), and the CA that must have signed EMQX's client certificate."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None
    """None: TLS without client certificates, which authenticates no caller."""

    @classmethod
    def from_files(cls, cert_file: str, key_file: str, client_ca_file: str | None = None) -> ProviderTLS:
        """Read the PEM files; ValueError naming the file that cannot be read or holds no PEM."""

        def read(path: str, option: str, marker: bytes, what: str) -> bytes:
            try:
                data = Path(path).read_bytes()
            except OSError as err:
                raise ValueError(f"{option} {path}: cannot read it: {err.strerror}") from None
            if marker not in data:
                raise ValueError(f"{option} {path} holds no PEM {what}")
            return data

        certificate = b"-----BEGIN CERTIFICATE-----"
        return cls(
            cert_chain=read(cert_file, "--server-cert", certificate, "certificate"),
            private_key=read(key_file, "--server-key", b"PRIVATE KEY-----", "private key"),
            client_ca=read(client_ca_file, "--client-ca", certificate, "CA certificate") if client_ca_file else None,
        )

    @property
    def mutual(self) -> bool:
        """Whether a caller must present a client certificate ``client_ca`` signed."""
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)], root_certificates=self.client_ca, require_client_auth=self.mutual
        )

    def describe(self) -> str:
        return "mutual TLS" if self.mutual else "TLS, no client certificates"


def describe(tls: ProviderTLS | None) -> str:
    """How a listener with ``tls`` serves: ``mutual TLS``, ``TLS, no client certificates`` or ``plaintext``."""
    return tls.describe() if tls is not None else "plaintext"


def check_listener(listen: str, tls: ProviderTLS | None, *, insecure_no_client_auth: bool = False) -> bool:
    """ValueError unless a listener on ``listen`` with ``tls`` authenticates its callers or is private.

    Returns True when the listener is reachable from other machines and
    authenticates nobody: allowed only because ``insecure_no_client_auth``
    says so (the caller warns loudly).
    """
    if (tls is not None and tls.mutual) or is_loopback(listen):
        return False
    if insecure_no_client_auth:
        return True
    raise ValueError(
        f"--listen {listen} can be reached from other machines, and {describe(tls)} authenticates no caller: "
        "anyone who connects could store messages and client state with this provider's mqds token. Serve "
        "mutual TLS (--server-cert, --server-key and --client-ca, the CA of the certificate EMQX presents with "
        f"its exhook ssl certfile), listen on 127.0.0.1, or pass {INSECURE_FLAG} to accept any caller on purpose"
    )
