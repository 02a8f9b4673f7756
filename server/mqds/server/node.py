"""The node: the composition root that wires storage, the API and the gRPC server.

Data directory layout::

    <data_dir>/node.json               node id, shard count, layout version
    <data_dir>/shards/shard-0000/      one RocksDB database per shard
    <data_dir>/shards/shard-0001/ ...

The node also runs the maintenance loop: it starts a new generation in a
shard once the current one is ``generation_interval_s`` old, and drops
generations that ended more than ``retention_period_s`` ago.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mqds.server.api.handlers import storage_handler
from mqds.server.api.storage_service import StorageService, now_us
from mqds.server.config import NodeConfig
from mqds.server.storage import Engine, EngineOptions, ShardStorage
from mqds.v1 import storage_pb2 as pb

log = logging.getLogger(__name__)

NODE_FILE_VERSION = 1
STORAGE_SERVICE = pb.DESCRIPTOR.services_by_name["Storage"].full_name


class StartupError(RuntimeError):
    """The node cannot start; the message says why and what to do."""


def _check_data_dir(config: NodeConfig) -> None:
    try:
        os.makedirs(os.path.join(config.data_dir, "shards"), exist_ok=True)
    except OSError as err:
        raise StartupError(f"cannot create data directory {config.data_dir}: {err.strerror}") from None
    if not os.access(config.data_dir, os.W_OK | os.X_OK):
        raise StartupError(f"data directory {config.data_dir} is not writable by this user")
    path = os.path.join(config.data_dir, "node.json")
    if os.path.exists(path):
        with open(path) as fh:
            meta = json.load(fh)
        if meta.get("version") != NODE_FILE_VERSION:
            raise StartupError(f"{path}: layout version {meta.get('version')} is not supported (expected 1)")
        if meta["n_shards"] != config.n_shards:
            raise StartupError(
                f"data directory {config.data_dir} was created with n_shards={meta['n_shards']}; "
                f"n_shards={config.n_shards} cannot change after creation"
            )
        if meta["node_id"] != config.node_id:
            raise StartupError(
                f"data directory {config.data_dir} belongs to node {meta['node_id']!r}, not {config.node_id!r}"
            )
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"version": NODE_FILE_VERSION, "node_id": config.node_id, "n_shards": config.n_shards}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class Node:
    """One mqds node: its shards, its gRPC server and its maintenance loop."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self._stopping = threading.Event()
        self._maintenance: threading.Thread | None = None
        _check_data_dir(config)
        self.engine = Engine(
            EngineOptions(
                block_cache_bytes=config.block_cache_bytes,
                write_buffer_bytes=config.write_buffer_bytes,
            )
        )
        self.shards: list[ShardStorage] = []
        try:
            for shard in range(config.n_shards):
                path = os.path.join(config.data_dir, "shards", f"shard-{shard:04d}")
                storage = ShardStorage(
                    path,
                    shard,
                    self.engine,
                    lts_threshold_top=config.lts_threshold_top,
                    lts_threshold=config.lts_threshold,
                )
                storage.initialize(now_us())
                self.shards.append(storage)
        except Exception as err:
            self._close_shards()
            if "lock" in str(err).lower():
                raise StartupError(
                    f"data directory {config.data_dir} is in use by another mqds-server process"
                ) from None
            raise
        self.service = StorageService(
            self.shards,
            max_payload_bytes=config.max_payload_bytes,
            max_batch_messages=config.max_batch_messages,
            max_next_batch=config.max_next_batch,
        )
        self.health = health.HealthServicer()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.grpc_workers, thread_name_prefix="grpc"),
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", config.max_request_bytes),
                ("grpc.max_send_message_length", config.max_request_bytes),
            ],
        )
        self.server.add_generic_rpc_handlers((storage_handler(self.service),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (STORAGE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        try:
            self.port = self.server.add_insecure_port(config.listen)
        except RuntimeError:
            self._close_shards()
            raise StartupError(
                f"cannot listen on {config.listen}: the address is in use or not available on this host"
            ) from None

    def start(self) -> None:
        self.server.start()
        for service in ("", STORAGE_SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._maintenance = threading.Thread(target=self._maintain, name="maintenance", daemon=True)
        self._maintenance.start()
        log.info(
            "node %s serving on %s with %d shards in %s",
            self.config.node_id,
            self.config.listen,
            self.config.n_shards,
            self.config.data_dir,
        )

    def wait(self) -> None:
        self._stopping.wait()

    def stop(self) -> None:
        """Stop serving, let in-flight calls finish, close the databases."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.health.enter_graceful_shutdown()
        self.server.stop(self.config.shutdown_grace_s).wait()
        if self._maintenance is not None:
            self._maintenance.join(timeout=10)
        self._close_shards()
        log.info("node %s stopped", self.config.node_id)

    def _close_shards(self) -> None:
        for storage in self.shards:
            storage.close()
        self.shards = []

    # -- maintenance ---------------------------------------------------------

    def maintain_once(self, now: int) -> None:
        """Rotate generations that are old enough and drop expired ones."""
        interval_us = int(self.config.generation_interval_s * 1_000_000)
        retention_us = int(self.config.retention_period_s * 1_000_000)
        for storage in self.shards:
            if interval_us:
                current = storage.generations()[-1]
                if now - max(current.since_us, current.created_at_us) >= interval_us:
                    info = storage.add_generation(now)
                    log.info("shard %d: generation %d started (interval)", storage.shard, info.generation)
            if retention_us:
                for generation in storage.expired_generations(now, retention_us):
                    storage.drop_generation(generation)
                    log.info("shard %d: generation %d dropped (retention)", storage.shard, generation)

    def _maintain(self) -> None:
        while not self._stopping.wait(self.config.maintenance_interval_s):
            try:
                self.maintain_once(now_us())
            except Exception:
                log.exception("maintenance failed; will retry")
