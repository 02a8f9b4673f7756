"""Bounded waits: polling a condition, and a node's readiness through the gRPC health service."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mqds.client import ConnectionSettings

T = TypeVar("T")

READY_SERVICE = "mqds.v1.Storage"


def wait_serving(
    address: str, timeout_s: float, service: str = READY_SERVICE, connection: ConnectionSettings | None = None
) -> bool:
    """Poll the gRPC health service until ``service`` is SERVING or the time is up.

    The node's own readiness is the ``mqds.v1.Storage`` service (joined, every
    replica has a leader); ``""`` is liveness (the process serves at all).
    """
    deadline = time.monotonic() + timeout_s
    with (connection or ConnectionSettings()).open_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    return False


def wait_until(what: str, check: Callable[[], T | None], timeout_s: float, interval_s: float = 0.1) -> T:
    """Poll ``check`` until it returns something truthy; TimeoutError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        try:
            result = check()
            if result:
                return result
            last_error = None  # only the last check's error says why it is still not so
        except (grpc.RpcError, OSError) as err:
            last_error = err
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            raise TimeoutError(f"{what} did not happen within {timeout_s:g}s{detail}")
        time.sleep(interval_s)
