"""The data directory: its lock (one node per directory) and its layout.

Layout::

    <data_dir>/LOCK                     flock'ed while a node uses the directory
    <data_dir>/node.json                node id and layout version
    <data_dir>/meta/state               the cluster map this node applied
    <data_dir>/meta/raft/               the metadata group's journal and snapshot manifest
    <data_dir>/shards/shard-0000/       one RocksDB database per hosted vnode
    <data_dir>/raft/shard-0000/         that vnode's Raft journal and snapshot manifest
    <data_dir>/raft/wal/                the node's Raft write-ahead log (every group's records)
    <data_dir>/tmp/                     checkpoints being sent to other nodes (emptied at start)

Every path the node opens is named here, so the layout is written down once.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil

from mqds.server.config import NodeConfig
from mqds.server.durable import make_dirs, write_atomically
from mqds.server.startup import StartupError

NODE_FILE_VERSION = 2


def _lock_data_dir(config: NodeConfig) -> int:
    """Take the data directory's lock (held until the process exits): one node per directory."""
    fd = os.open(os.path.join(config.data_dir, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StartupError(f"data directory {config.data_dir} is in use by another mqds-server process") from None
    return fd


def _check_data_dir(config: NodeConfig) -> int:
    try:
        make_dirs(config.data_dir)
    except OSError as err:
        raise StartupError(f"cannot create data directory {config.data_dir}: {err.strerror}") from None
    if not os.access(config.data_dir, os.W_OK | os.X_OK):
        raise StartupError(f"data directory {config.data_dir} is not writable by this user")
    lock = _lock_data_dir(config)
    # Made durable (their names synced into the data directory), or a power loss could take them and all below.
    for sub in ("shards", "raft", "meta", "tmp"):
        make_dirs(os.path.join(config.data_dir, sub))
    path = os.path.join(config.data_dir, "node.json")
    if os.path.exists(path):
        with open(path) as fh:
            meta = json.load(fh)
        if meta.get("version") != NODE_FILE_VERSION:
            raise StartupError(
                f"{path}: layout version {meta.get('version')} is not supported (expected {NODE_FILE_VERSION})"
            )
        if meta["node_id"] != config.node_id:
            raise StartupError(
                f"data directory {config.data_dir} belongs to node {meta['node_id']!r}, not {config.node_id!r}"
            )
        return lock
    write_atomically(path, json.dumps({"version": NODE_FILE_VERSION, "node_id": config.node_id}).encode())
    return lock


class DataDir:
    """A node's data directory, locked and laid out; ``close`` releases the lock.

    Raises StartupError when the directory cannot be created or written, is
    locked by another process, or belongs to another node or layout version.
    """

    def __init__(self, config: NodeConfig) -> None:
        self.root = config.data_dir
        self._lock = _check_data_dir(config)
        self.tmp = os.path.join(self.root, "tmp")
        """Scratch space (snapshot checkpoints being sent): emptied here, at start."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp, exist_ok=True)

    @property
    def meta_dir(self) -> str:
        """The metadata replica: its applied state (``state``) and its Raft directory (``raft``)."""
        return os.path.join(self.root, "meta")

    @property
    def meta_state(self) -> str:
        return os.path.join(self.meta_dir, "state")

    @property
    def wal(self) -> str:
        """The Raft write-ahead log shared by every group of this node."""
        return os.path.join(self.root, "raft", "wal")

    def vnode_paths(self, shard: int) -> tuple[str, str]:
        """A vnode replica's RocksDB directory and its Raft directory."""
        return (
            os.path.join(self.root, "shards", f"shard-{shard:04d}"),
            os.path.join(self.root, "raft", f"shard-{shard:04d}"),
        )

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1
