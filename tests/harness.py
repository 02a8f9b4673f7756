"""Test helpers around real mqds-server processes."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from mqds.client import Message
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.ports import free_port, free_port_block
from mqds.tools.processes import SERVER, NodeProcess
from mqds.tools.waiting import wait_serving

ServerProcess = NodeProcess

__all__ = [
    "MQDS",
    "SERVER",
    "ServerProcess",
    "cluster_up",
    "free_port",
    "replayed",
    "rss_bytes",
    "run_server",
    "sender_on",
    "wait_serving",
]


MQDS = str(Path(sys.executable).with_name("mqds"))


@contextlib.contextmanager
def cluster_up(data_dir: Path, n_shards: int) -> Iterator[str]:
    """A local 3-node cluster started with ``mqds cluster up`` in ``data_dir``: its endpoints; down afterwards."""
    base = free_port_block(3)
    try:
        up = subprocess.run(
            [MQDS, "cluster", "up", "--data-dir", str(data_dir), "--base-port", str(base), "--shards", str(n_shards)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert up.returncode == 0, up.stdout + up.stderr
        yield ",".join(f"127.0.0.1:{base + i}" for i in range(3))
    finally:
        if LocalCluster.recorded(data_dir):
            subprocess.run([MQDS, "cluster", "down", "--data-dir", str(data_dir)], capture_output=True, timeout=120)
            LocalCluster.load(data_dir).kill_all()


def run_server(args: Sequence[str], timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    """Run mqds-server to completion (for --help, bad configs) and capture its output."""
    return subprocess.run([SERVER, *args], capture_output=True, text=True, timeout=timeout_s)


def rss_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS in /proc), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def sender_on(shard: int, prefix: str, n_shards: int) -> str:
    """A clientid starting with ``prefix`` whose messages go to ``shard`` of ``n_shards``."""
    return next(f"{prefix}-{i}" for i in range(10_000) if shard_of(f"{prefix}-{i}", n_shards) == shard)


def replayed(cluster: LocalCluster, topic_filter: str) -> list[Message]:
    """Everything the cluster holds under ``topic_filter``, read by a client of its own."""
    with cluster.client(timeout_s=30) as reader:
        return list(reader.replay(topic_filter))
