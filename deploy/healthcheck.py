"""Health probe of the node in this container: exit 0 when its gRPC health service reports SERVING.

The image's HEALTHCHECK runs it, and Kubernetes runs it as an exec probe when the node serves TLS
(the kubelet's built-in gRPC probe speaks plaintext only). By default it checks liveness (the
``""`` service) of the node this container runs, with the node's own settings from the
environment: the port of ``MQDS_LISTEN``; with ``MQDS_TLS_CERT_FILE`` it connects with TLS,
checks the node's certificate against ``MQDS_TLS_CA_FILE`` (else ``MQDS_TLS_CLIENT_CA_FILE``) for
the host of ``MQDS_ADVERTISE``, and presents the node's certificate (which allows client
authentication) for mutual TLS. ``--service mqds.v1.Storage`` checks readiness instead.

    python /opt/mqds/healthcheck.py [--service mqds.v1.Storage] [--address HOST:PORT] [--timeout S]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mqds.client import ConnectionSettings


def local_address(environ: Mapping[str, str]) -> str:
    """127.0.0.1 on the port the node listens on (MQDS_LISTEN, default 7101)."""
    _, _, port = environ.get("MQDS_LISTEN", "").rpartition(":")
    return f"127.0.0.1:{port if port.isdigit() else '7101'}"


def settings_from_env(environ: Mapping[str, str], timeout_s: float) -> ConnectionSettings:
    """Plaintext, or TLS as the node serves it (its CA, its own certificate, its advertised name)."""
    cert = environ.get("MQDS_TLS_CERT_FILE", "")
    if not cert:
        return ConnectionSettings(timeout_s=timeout_s, keepalive_time_s=None)
    ca = environ.get("MQDS_TLS_CA_FILE") or environ.get("MQDS_TLS_CLIENT_CA_FILE") or None
    advertised_host = environ.get("MQDS_ADVERTISE", "").rpartition(":")[0] or None
    return ConnectionSettings(
        timeout_s=timeout_s,
        keepalive_time_s=None,
        tls=True,
        tls_ca=ca,
        tls_client_cert=cert,
        tls_client_key=environ.get("MQDS_TLS_KEY_FILE") or None,
        tls_server_name=advertised_host,
    )


def check(address: str, service: str, settings: ConnectionSettings, timeout_s: float) -> str:
    """The status name the node reports for ``service`` (SERVING, NOT_SERVING, ...); raises grpc.RpcError."""
    with settings.open_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="healthcheck.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--service", default="", help='"" = liveness (default), "mqds.v1.Storage" = readiness')
    parser.add_argument("--address", default=None, help="host:port to check (default: 127.0.0.1 on MQDS_LISTEN's port)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    args = parser.parse_args(argv)
    address = args.address or local_address(environ)
    try:
        status = check(address, args.service, settings_from_env(environ, args.timeout), args.timeout)
    except (grpc.RpcError, ValueError) as err:
        detail = err.details() if isinstance(err, grpc.RpcError) else str(err)
        print(f"healthcheck: {address} service {args.service!r}: {detail}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"healthcheck: {address} service {args.service!r}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
