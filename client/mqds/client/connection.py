"""How a client connects to the nodes: TLS, auth token, keepalive, message size limits, deadline.

One frozen :class:`ConnectionSettings` serves the synchronous and the asyncio
client: the router opens every channel with its options and credentials and
sends its metadata with every call (cluster-map calls included).

>>> ConnectionSettings(timeout_s=5, auth_token="s3cret").call_metadata()
(('authorization', 'Bearer s3cret'),)
>>> ConnectionSettings(tls_client_cert=b"...")
Traceback (most recent call last):
ValueError: tls_client_cert and tls_client_key go together: give both for mutual TLS, or neither
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import grpc

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# The metadata key the nodes present the cluster secret under (the server's raft.transport.SECRET_HEADER).
CLUSTER_SECRET_HEADER = "x-mqds-cluster-secret"

# A PEM value: the PEM bytes themselves, or a file to read them from (a path,
# or a str that is itself PEM text).
Pem = Union[bytes, str, "os.PathLike[str]"]

# gRPC puts this in the details of a call that hit a message size limit
# ("CLIENT: Sent message larger than max (2009 vs. 1000)").
_SIZE_LIMIT = re.compile(r"(?:(CLIENT|SERVER): )?(Sent|Received) message larger than max \((\d+) vs\. (\d+)\)")


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """``"a:1,b:2"`` or ``["a:1", "b:2"]`` -> ``["a:1", "b:2"]``; rejects empty and port-less entries."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed = [item.strip() for item in items if item and item.strip()]
    if not parsed:
        raise ValueError("no endpoints given: pass 'host:port' addresses of mqds nodes")
    for item in parsed:
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"endpoint {item!r} is not host:port")
    return parsed


@dataclass(frozen=True)
class ConnectionSettings:
    """How the client connects to mqds nodes. Every field has a working default.

    TLS is on when ``tls`` is true or any ``tls_*`` certificate is given.
    PEM values (``tls_ca``, ``tls_client_cert``, ``tls_client_key``) are the
    PEM bytes, a file path (``str`` or ``os.PathLike``), or a ``str`` holding
    the PEM text; files are read when the client is created, and a missing
    file or a value that is not PEM is a ``ValueError`` naming the setting.
    """

    timeout_s: float = 30.0
    """Default deadline of one client call, retries included, in seconds (``timeout_s=`` on a call overrides it)."""
    tls: bool = False
    """Connect with TLS; without ``tls_ca`` the node's certificate is checked against the system's trusted roots."""
    tls_ca: Pem | None = None
    """CA certificate(s) that signed the nodes' certificates (PEM). Implies TLS."""
    tls_client_cert: Pem | None = None
    """This client's certificate chain (PEM), for nodes that require client certificates (mutual TLS)."""
    tls_client_key: Pem | None = field(default=None, repr=False)
    """The private key of ``tls_client_cert`` (PEM)."""
    tls_server_name: str | None = None
    """Check the nodes' certificates against this name instead of the host dialled (e.g. when dialling by IP)."""
    auth_token: str | None = field(default=None, repr=False)
    """Sent as ``authorization: Bearer <token>`` metadata on every call. Use TLS: without it the token is readable."""
    cluster_secret: str | None = field(default=None, repr=False)
    """The nodes' cluster secret, sent on every call (``x-mqds-cluster-secret``): the proof admin calls
    (membership, generations) need on nodes without client tokens. Only for operators' tools; use TLS."""
    keepalive_time_s: float | None = 30.0
    """Ping a connection after this many seconds without traffic; ``None`` = no keepalive pings."""
    keepalive_timeout_s: float = 10.0
    """A ping not answered within this many seconds closes the connection (its calls fail and are retried)."""
    keepalive_permit_without_calls: bool = False
    """Also ping connections that have no call in flight (notices a dead node before the next call needs it)."""
    max_send_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest request this client sends, in bytes; a larger one fails at once with InvalidArgumentError."""
    max_receive_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest response this client accepts, in bytes; a larger one fails with InvalidArgumentError."""

    def __post_init__(self) -> None:
        _positive("timeout_s", self.timeout_s)
        _positive("keepalive_timeout_s", self.keepalive_timeout_s)
        if self.keepalive_time_s is not None:
            _positive("keepalive_time_s", self.keepalive_time_s)
        for name in ("max_send_message_bytes", "max_receive_message_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            raise ValueError("tls_client_cert and tls_client_key go together: give both for mutual TLS, or neither")
        if self.tls_server_name is not None and (not self.tls_server_name or not self.use_tls):
            raise ValueError("tls_server_name must be a non-empty host name, and needs TLS (tls=True or tls_ca)")
        if self.auth_token is not None and (
            not self.auth_token or not all(0x21 <= ord(c) <= 0x7E for c in self.auth_token)
        ):
            raise ValueError(
                "auth_token must be non-empty printable ASCII without spaces "
                "(give the token alone, not 'Bearer <token>')"
            )
        if self.cluster_secret is not None and (
            not self.cluster_secret or not all(0x20 <= ord(c) <= 0x7E for c in self.cluster_secret)
        ):
            raise ValueError("cluster_secret must be non-empty printable ASCII")

    def replace(self, **changes: Any) -> ConnectionSettings:
        """A copy with some fields changed (validated like the original)."""
        return dataclasses.replace(self, **changes)

    @property
    def use_tls(self) -> bool:
        return self.tls or self.tls_ca is not None or self.tls_client_cert is not None

    def channel_options(self) -> list[tuple[str, Any]]:
        """The gRPC channel arguments these settings stand for."""
        options: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", self.max_send_message_bytes),
            ("grpc.max_receive_message_length", self.max_receive_message_bytes),
            # A node that restarts is back in a second or two: retry the
            # connection that often, not on gRPC's default backoff (up to 2
            # minutes), and keep the backoff state per client.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if self.keepalive_time_s is not None:
            options += [
                ("grpc.keepalive_time_ms", max(1, round(self.keepalive_time_s * 1000))),
                ("grpc.keepalive_timeout_ms", max(1, round(self.keepalive_timeout_s * 1000))),
                # gRPC waits for any ping's answer this long (default a
                # minute), keepalive pings included.
                ("grpc.http2.ping_timeout_ms", max(1, round(self.keepalive_timeout_s * 1000))),
                ("grpc.keepalive_permit_without_calls", int(self.keepalive_permit_without_calls)),
                # Keep pinging while a long call waits without data (Next on
                # an empty stream, a write waiting for its commit).
                ("grpc.http2.max_pings_without_data", 0),
            ]
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return options

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials (reads the PEM files now), or None for plaintext."""
        if not self.use_tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_pem("tls_ca", self.tls_ca, "CERTIFICATE"),
            private_key=_pem("tls_client_key", self.tls_client_key, "PRIVATE KEY"),
            certificate_chain=_pem("tls_client_cert", self.tls_client_cert, "CERTIFICATE"),
        )

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata sent with every call."""
        metadata: tuple[tuple[str, str], ...] = ()
        if self.auth_token is not None:
            metadata += (("authorization", f"Bearer {self.auth_token}"),)
        if self.cluster_secret is not None:
            metadata += ((CLUSTER_SECRET_HEADER, self.cluster_secret),)
        return metadata

    def open_channel(
        self,
        address: str,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
    ) -> grpc.Channel:
        """A channel to ``address``.

        ``credentials`` (from :meth:`channel_credentials`) and ``options``
        (from :meth:`channel_options`) let a caller that opens many channels
        read the PEM files once; by default they are made here.
        """
        if credentials is None and self.use_tls:
            credentials = self.channel_credentials()
        options = self.channel_options() if options is None else options
        if credentials is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, credentials, options=options)

    def open_aio_channel(
        self,
        address: str,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
    ) -> grpc.aio.Channel:
        """An asyncio channel to ``address`` (bound to the running event loop), like :meth:`open_channel`."""
        if credentials is None and self.use_tls:
            credentials = self.channel_credentials()
        options = self.channel_options() if options is None else options
        if credentials is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, credentials, options=options)

    def describe_failure(self, err: grpc.RpcError) -> str:
        """Why a node could not be reached, with a hint when the cause is likely these settings."""
        call: grpc.Call = err
        code = call.code()
        details = call.details() or ""
        text = f"{code.name if code is not None else 'UNKNOWN'}: {details}"
        if "CERTIFICATE_VERIFY_FAILED" in details:
            hint = "the node's certificate is not signed by a CA in tls_ca"
        elif "Hostname Verification" in details or "No match found for server name" in details:
            hint = "the node's certificate does not name the host dialled; set tls_server_name"
        elif "WRONG_VERSION_NUMBER" in details:
            hint = "the node does not serve TLS; connect without tls/tls_ca"
        elif "Socket closed" in details and not self.use_tls:
            hint = "the node closed the connection: if it serves TLS, set tls_ca (or tls=True)"
        elif "Socket closed" in details and self.tls_client_cert is None:
            hint = (
                "the node closed the connection: if it requires client certificates (mutual TLS), "
                "set tls_client_cert and tls_client_key"
            )
        elif "Socket closed" in details:
            hint = "the node closed the connection: is tls_client_cert signed by the CA the node trusts?"
        else:
            return text
        return f"{text} [{hint}]"

    def call_error(self, err: grpc.RpcError) -> MqdsError:
        """The mqds error for a failed call; one that hit a size limit says which setting to change."""
        mapped = errors.from_rpc_error(err)
        if mapped.reason is not Reason.INVALID_REQUEST:
            return mapped
        found = _SIZE_LIMIT.search(mapped.message)
        if found is None:
            return mapped
        side, direction, size, limit = found.group(1), found.group(2), int(found.group(3)), int(found.group(4))
        if side != "SERVER" and direction == "Sent":
            text = (
                f"the request is {size:,} bytes, more than max_send_message_bytes ({limit:,}); "
                "send smaller batches or raise the setting"
            )
        elif side == "CLIENT" or (side is None and limit == self.max_receive_message_bytes):
            text = (
                f"the response is {size:,} bytes, more than max_receive_message_bytes ({limit:,}); "
                "ask for fewer messages (batch_size) or raise the setting"
            )
        elif side == "SERVER" and direction == "Sent":
            text = (
                f"the node's answer is {size:,} bytes, more than it may send ({limit:,}); "
                "ask for less at a time (batch_size, max_count, fewer shards), or upgrade the node: "
                "it bounds its answers by max_answer_bytes"
            )
        else:
            text = (
                f"the node refused a request of {size:,} bytes: its limit is {limit:,} "
                "(the node's max_request_bytes); send smaller batches"
            )
        return errors.error(Reason.INVALID_REQUEST, text)


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _pem(name: str, value: Pem | None, kind: str) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        data, source = value, name
    elif isinstance(value, str) and value.lstrip().startswith("-----BEGIN"):
        data, source = value.encode("ascii", "replace"), name
    else:
        path = os.fspath(value)
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as err:
            raise ValueError(f"cannot read {name} file {path}: {err.strerror}") from None
        source = f"{name} file {path}"
    if b"-----BEGIN" not in data or (kind == "CERTIFICATE" and b"CERTIFICATE-----" not in data):
        raise ValueError(f"{source} is not PEM: expected a '-----BEGIN {kind}-----' block")
    if kind == "PRIVATE KEY" and b"PRIVATE KEY-----" not in data:
        raise ValueError(f"{source} is not a PEM private key")
    return data


def resolve_settings(
    settings: ConnectionSettings | None, timeout_s: float | None, max_message_bytes: int | None
) -> ConnectionSettings:
    """The settings a client uses: ``settings`` (or the defaults) with the older keyword arguments applied."""
    resolved = settings or ConnectionSettings()
    if timeout_s is not None:
        resolved = resolved.replace(timeout_s=timeout_s)
    if max_message_bytes is not None:
        resolved = resolved.replace(
            max_send_message_bytes=max_message_bytes, max_receive_message_bytes=max_message_bytes
        )
    return resolved
