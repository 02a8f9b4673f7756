"""Snapshot transfer: a vnode replica's RocksDB checkpoint, streamed from one node to another.

A replica too far behind its leader's log installs a snapshot: it fetches a
checkpoint of a replica that applied at least the index it needs
(``fetch``, called by ``cluster.vnode.VnodeReplica``), and the node that
has one streams it (``serve``, behind the internal Raft service's
FetchSnapshot): a header naming each file and its size, then the files in
chunks of ``CHUNK_BYTES``. The checkpoint is taken under the replica's
reader guard into the data directory's ``tmp`` and removed once sent.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.server.api.server import CHUNK_BYTES
from mqds.server.cluster.vnode import Vnode
from mqds.server.durable import fsync_dir
from mqds.server.metrics import NodeMetrics
from mqds.server.node.peers import Peers
from mqds.server.raft.cluster_auth import ClusterAuth
from mqds.server.raft.v1 import raft_pb2 as rpb

log = logging.getLogger(__name__)


class Snapshots:
    """Fetches snapshots from other nodes and serves this node's."""

    def __init__(self, peers: Peers, auth: ClusterAuth, metrics: NodeMetrics, tmp_dir: str) -> None:
        self.peers = peers
        self.auth = auth
        self.metrics = metrics
        self.tmp_dir = tmp_dir

    def fetch(self, node_id: str, shard: int, min_index: int, dest: str) -> int:
        """Copy ``node_id``'s replica of ``shard`` (applied at least to ``min_index``) into ``dest``."""
        stub = self.peers.internal_stub(node_id)
        os.makedirs(dest, exist_ok=True)
        stream = stub.FetchSnapshot(
            rpb.FetchSnapshotRequest(group=shard, min_index=min_index),
            timeout=3600,
            metadata=self.auth.metadata(),
        )
        header: rpb.SnapshotHeader | None = None
        handles: dict[int, Any] = {}
        received = 0
        try:
            for chunk in stream:
                if chunk.HasField("header"):
                    header = chunk.header
                    for i, f in enumerate(header.files):
                        root = os.path.abspath(dest)
                        path = os.path.abspath(os.path.join(root, f.name))
                        if os.path.isabs(f.name) or os.path.commonpath([root, path]) != root or path == root:
                            raise errors.error(
                                Reason.INVALID_REQUEST, f"snapshot file {f.name!r} escapes its directory"
                            )
                        os.makedirs(os.path.dirname(path), exist_ok=True)
                        handles[i] = open(path, "wb")  # noqa: SIM115 - closed below
                    continue
                if header is None or chunk.chunk.file not in handles:
                    raise errors.error(Reason.INVALID_REQUEST, "snapshot stream out of order")
                handles[chunk.chunk.file].write(chunk.chunk.data)
                received += len(chunk.chunk.data)
            if header is None:
                raise errors.error(Reason.INVALID_REQUEST, "empty snapshot stream")
            for i, f in enumerate(header.files):
                fh = handles[i]
                fh.flush()
                if fh.tell() != f.size:
                    raise errors.error(
                        Reason.INVALID_REQUEST, f"snapshot file {f.name} is {fh.tell()} bytes, not {f.size}"
                    )
                os.fsync(fh.fileno())
            # The files' names too: the directory is renamed into place whole, and a rename makes
            # the directory's own name durable, not the names inside it.
            for directory in {os.path.dirname(fh.name) for fh in handles.values()} | {dest}:
                fsync_dir(directory)
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err) from None
        finally:
            for fh in handles.values():
                fh.close()
        log.info("shard %d: fetched %d bytes of snapshot from %s", shard, received, node_id)
        self.metrics.snapshot_received(shard, received)
        return int(header.applied_index)

    def serve(self, vnode: Vnode, request: rpb.FetchSnapshotRequest) -> Iterator[rpb.SnapshotChunk]:
        """Stream a checkpoint of ``vnode``'s replica, applied at least to ``request.min_index``."""
        directory = os.path.join(self.tmp_dir, f"snapshot-{request.group}-{uuid.uuid4().hex}")
        started = time.monotonic()
        sent = 0
        try:
            with vnode.replica.reading() as storage:
                if storage.applied_index < request.min_index:
                    raise errors.error(
                        Reason.NO_LEADER,
                        f"shard {request.group}: this replica applied {storage.applied_index}, "
                        f"behind the requested {request.min_index}",
                    )
                applied = storage.checkpoint(directory)
            files = []
            for root, _, names in os.walk(directory):
                for name in sorted(names):
                    path = os.path.join(root, name)
                    files.append((os.path.relpath(path, directory), path, os.path.getsize(path)))
            header = rpb.SnapshotHeader(applied_index=applied)
            for rel, _, size in files:
                header.files.add(name=rel, size=size)
            yield rpb.SnapshotChunk(header=header)
            for i, (_, path, _) in enumerate(files):
                with open(path, "rb") as fh:
                    while True:
                        data = fh.read(CHUNK_BYTES)
                        if not data:
                            break
                        yield rpb.SnapshotChunk(chunk=rpb.FileChunk(file=i, data=data))
                        sent += len(data)
            self.metrics.snapshot_sent(request.group, sent, time.monotonic() - started)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
