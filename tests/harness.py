"""Test helpers around real mqds-server processes."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from mqds.server.localproc import SERVER, NodeProcess, free_port, wait_serving

ServerProcess = NodeProcess

__all__ = ["SERVER", "ServerProcess", "free_port", "run_server", "wait_serving"]


def run_server(args: Sequence[str], timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    """Run mqds-server to completion (for --help, bad configs) and capture its output."""
    return subprocess.run([SERVER, *args], capture_output=True, text=True, timeout=timeout_s)
