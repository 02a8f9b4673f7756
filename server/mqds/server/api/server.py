"""The node's gRPC server: its options, the services on its port, and server reflection.

One port serves the public services (Storage, Cluster, Sessions), the
internal Raft service (authenticated with the cluster secret), the health
service and server reflection. Reflection describes the public services
only.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent import futures
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from mqds.server.config import NodeConfig
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import sessions_pb2 as spb
from mqds.v1 import storage_pb2 as pb

STORAGE_SERVICE = pb.DESCRIPTOR.services_by_name["Storage"].full_name
CLUSTER_SERVICE = clpb.DESCRIPTOR.services_by_name["Cluster"].full_name
SESSIONS_SERVICE = spb.DESCRIPTOR.services_by_name["Sessions"].full_name
PUBLIC_SERVICES = (STORAGE_SERVICE, CLUSTER_SERVICE, SESSIONS_SERVICE)
"""The public API: readiness is reported under these names."""

CHUNK_BYTES = 1024 * 1024
"""Largest piece of a file in one snapshot stream message."""


def grpc_server(
    config: NodeConfig,
    interceptors: Sequence[grpc.ServerInterceptor],
    handlers: Sequence[grpc.GenericRpcHandler],
    health_servicer: health.HealthServicer,
) -> grpc.Server:
    """A server with every service of the node (not listening yet: the caller adds the port)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.grpc_workers, thread_name_prefix="grpc"),
        interceptors=interceptors,
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        options=[
            ("grpc.so_reuseport", 0),
            # Raft frames share the port: one append-entries may carry
            # entries up to twice the entry limit. The public services
            # refuse requests over max_request_bytes themselves (handlers).
            ("grpc.max_receive_message_length", receive_limit(config)),
            ("grpc.max_send_message_length", 2 * config.max_request_bytes + 4 * CHUNK_BYTES),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 1000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )
    server.add_generic_rpc_handlers(tuple(handlers))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # Reflection describes the public services only: its own pool holds
    # their files (the default pool would describe the internal protos too).
    reflection.enable_server_reflection(
        (*PUBLIC_SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME),
        server,
        pool=public_descriptor_pool(),
    )
    return server


def receive_limit(config: NodeConfig) -> int:
    """The port's receive limit: Raft frames share it, and carry entries up to twice the entry limit."""
    return 2 * config.max_request_bytes + 4 * CHUNK_BYTES


def public_descriptor_pool() -> descriptor_pool.DescriptorPool:
    """A descriptor pool of the public API's proto files (and what they import), for server reflection."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file: Any) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.Add(proto)
        added.add(file.name)

    for module in (pb, clpb, spb, health_pb2, reflection_pb2):
        add(module.DESCRIPTOR)
    return pool
