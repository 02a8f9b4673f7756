"""Local mqds-server processes: start, kill -9, restart, stop.

Used by the demo, the tests and benchmarks. Every wait is bounded; a process
that dies during start-up raises with the end of its log.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVER = str(Path(sys.executable).with_name("mqds-server"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_serving(address: str, timeout_s: float) -> bool:
    """Poll the gRPC health service until it says SERVING or the time is up."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    return False


class NodeProcess:
    """One mqds-server process with a fixed node id, port and data directory."""

    def __init__(
        self, data_dir: Path, *, node_id: str = "n1", port: int | None = None, args: Sequence[str] = ()
    ) -> None:
        self.data_dir = data_dir
        self.node_id = node_id
        self.port = port or free_port()
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"{node_id}-{self.port}.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            SERVER,
            "--node-id",
            self.node_id,
            "--listen",
            self.address,
            "--data-dir",
            str(self.data_dir),
            *self.args,
        ]

    def start(self, timeout_s: float = 30) -> NodeProcess:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mqds-server exited with {self.proc.returncode}:\n{self.output()}")
            if wait_serving(self.address, 0.5):
                return self
        self.kill()
        raise TimeoutError(f"mqds-server not serving after {timeout_s}s:\n{self.output()}")

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """kill -9: no shutdown code runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout_s: float = 20) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
                raise
        return int(self.proc.returncode)

    def restart(self, timeout_s: float = 30) -> NodeProcess:
        self.kill()
        return self.start(timeout_s)
