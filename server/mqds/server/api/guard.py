"""The node's guard: every call looked up in the method table, authenticated, counted, bounded and placed.

A gRPC server interceptor, so it runs before a request is parsed and applies
to every service the port serves alike (public, internal, health,
reflection). For each call it takes the method's entry in
``methods.METHODS``, and:

- refuses a method without one (UNIMPLEMENTED, UNKNOWN_METHOD): nothing is
  passed through unclassified;
- checks the caller for the entry's role (UNAUTHENTICATED, PERMISSION_DENIED);
- takes a slot of the entry's lane (``max_public_calls``,
  ``max_public_streams``, the internal calls' spare workers, the peer pool),
  or refuses with OVERLOADED at once;
- wraps the handler so that its request (each message of a stream) is bounded
  where it is decoded (``request_bounds``), the caller's connection is
  counted against ``max_calls_per_client``, work whose deadline passed is
  skipped, a stream with a time limit is cut, and the slot is given back
  exactly when the call ends;
- runs it on the lane's pool: streams on a pool of their own, so a held
  stream never takes a worker that unary calls or peers need.

It runs on the server's one polling thread, not on a pool worker (see
DESIGN.md, "Workers, limits and refusals"): what it refuses is answered on
the small control pool, never behind the calls it refuses.
"""

from __future__ import annotations

import collections
import hmac
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.server.api.methods import (
    CONTROL_REQUEST_BYTES,
    FIELD_LIMITS,
    METHODS,
    SERVED,
    Lane,
    Method,
    RequestBytes,
    Role,
)
from mqds.server.api.request_bounds import FieldBounds, Refused, bounded_parser
from mqds.server.api.server import receive_limit
from mqds.server.auth import ROLES, set_deadline
from mqds.server.config import NodeConfig
from mqds.server.raft.cluster_auth import SECRET_HEADER, ClusterAuth


@dataclass(frozen=True)
class CallLimits:
    """How many calls of each lane the node serves at once (0: no bound), and per client connection."""

    max_public_calls: int = 0
    max_public_streams: int = 0
    max_calls_per_client: int = 0
    max_internal_calls: int = 0
    """Internal unary calls: the workers ``max_public_calls`` leaves (``grpc_workers - max_public_calls``)."""
    max_peer_calls: int = 0
    """Raft streams and snapshot fetches: the peer pool's threads."""

    @property
    def max_reflection_streams(self) -> int:
        return max(1, self.max_public_streams // 4) if self.max_public_streams else 0

    def of(self, lane: Lane) -> int:
        return {
            Lane.UNARY: self.max_public_calls,
            Lane.STREAM: self.max_public_streams,
            Lane.INTERNAL: self.max_internal_calls,
            Lane.PEER: self.max_peer_calls,
        }.get(lane, 0)


_PER_CLIENT = frozenset({Lane.OBSERVE, Lane.UNARY, Lane.STREAM})
"""Lanes counted against ``max_calls_per_client``: what clients call (peers and probes are not clients)."""

_FULL = {
    Lane.UNARY: "this node already serves {n} public calls (max_public_calls); retry shortly, or spread calls over "
    "more nodes",
    Lane.STREAM: "this node already holds {n} streams (max_public_streams: Follow, StoreStream, exports, health "
    "watches, reflection); retry shortly, or spread them over more nodes",
    Lane.INTERNAL: "this node already serves {n} internal calls (the workers max_public_calls leaves); retry shortly",
    Lane.PEER: "this node already serves {n} Raft streams and snapshot fetches; retry shortly",
}


def _refusal_handler(err: MqdsError, pool: futures.ThreadPoolExecutor | None) -> grpc.RpcMethodHandler:
    """A handler that answers ``err`` at once, on ``pool`` when given (else on the server's pool).

    Request-streaming: gRPC then runs it without waiting for the request
    message (a client that never sends one holds nothing), and a refused
    request is never parsed.
    """
    status = errors.to_status(err)

    def refuse(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        context.abort_with_status(status)

    _run_on(refuse, pool)
    return grpc.stream_unary_rpc_method_handler(refuse)


def _run_on(behavior: Callable[..., Any], pool: futures.ThreadPoolExecutor | None) -> None:
    # gRPC runs a behavior with an ``experimental_thread_pool`` attribute on
    # that pool instead of the server's (grpc/_server.py,
    # _select_thread_pool_for_behavior).
    if pool is not None:
        behavior.experimental_thread_pool = pool  # type: ignore[attr-defined]


def _checked(requests: Iterator[Any]) -> Iterator[Any]:
    """A stream's requests, raising the error of the first one the deserializer refused."""
    for request in requests:
        if isinstance(request, Refused):
            raise request.error
        yield request


class ApiGuard(grpc.ServerInterceptor):
    """Authenticates, counts, bounds and places every call by its entry in the method table."""

    def __init__(
        self,
        tokens: Mapping[str, str],
        cluster: ClusterAuth,
        limits: CallLimits,
        *,
        config: NodeConfig | None = None,
        control_pool: futures.ThreadPoolExecutor | None = None,
        stream_pool: futures.ThreadPoolExecutor | None = None,
        peer_pool: futures.ThreadPoolExecutor | None = None,
        methods: Mapping[str, Method] = METHODS,
    ) -> None:
        self._tokens = dict(tokens)
        self._cluster = cluster
        self.limits = limits
        self.dev_mode = cluster.dev_mode
        """Development: admin calls are open without a tokens file (as every call is), internal calls without a
        cluster secret."""
        self._methods = methods
        self._pools = {
            Lane.PROBE: control_pool,
            Lane.OBSERVE: control_pool,
            Lane.STREAM: stream_pool,
            Lane.PEER: peer_pool,
        }
        self._control_pool = control_pool
        config = config or NodeConfig()
        max_request_bytes = config.max_request_bytes
        self._bytes = {
            RequestBytes.DATA: (max_request_bytes, "max_request_bytes"),
            RequestBytes.CONTROL: (
                min(max_request_bytes, CONTROL_REQUEST_BYTES),
                "4 MiB for a request that carries no messages",
            ),
            RequestBytes.FRAME: (receive_limit(config), "the port's receive limit"),
        }
        # Each served method's request field bounds, with the node's settings.
        self._fields = {
            f"/{service.full_name}/{method.name}": FieldBounds.of(method.input_type, FIELD_LIMITS, config)
            for service in SERVED
            for method in service.methods
        }
        self._lock = threading.Lock()
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._lanes: collections.Counter[Lane] = collections.Counter()
        self._reflection = 0
        self.rejected: collections.Counter[str] = collections.Counter()
        """Refused calls by reason (UNAUTHENTICATED, PERMISSION_DENIED, OVERLOADED, UNKNOWN_METHOD, ...)."""

    @property
    def enabled(self) -> bool:
        """Whether client tokens are required (a tokens file is configured)."""
        return bool(self._tokens)

    def in_flight(self, lane: Lane) -> int:
        """The calls of ``lane`` in flight now."""
        return self._lanes[lane]

    # -- who may call -----------------------------------------------------------------------------------

    def _is_node(self, metadata: Mapping[str, str]) -> bool:
        return self._cluster.is_node(metadata)

    def _secret_refusal(self, metadata: Mapping[str, str], what: str) -> MqdsError:
        """UNAUTHENTICATED for a call that needs the cluster secret: a wrong one told apart from none."""
        if SECRET_HEADER in metadata:
            return errors.error(
                Reason.UNAUTHENTICATED,
                f"{what}: the cluster secret presented is not this cluster's (check MQDS_CLUSTER_SECRET or "
                "--cluster-secret-file against the nodes' cluster_secret)",
            )
        return errors.error(
            Reason.UNAUTHENTICATED,
            f"{what}: present the cluster secret (mqds admin reads MQDS_CLUSTER_SECRET or --cluster-secret-file; "
            "ConnectionSettings(cluster_secret=...)), or configure auth_tokens_file and use an admin token",
        )

    def _token_role(self, metadata: Mapping[str, str]) -> str:
        if self._is_node(metadata):
            return "admin"
        given = metadata.get("authorization", "")
        if not given.startswith("Bearer "):
            if SECRET_HEADER in metadata:
                raise self._secret_refusal(metadata, "this node requires a token or the cluster secret")
            raise errors.error(
                Reason.UNAUTHENTICATED,
                "this node requires a token: send 'authorization: Bearer <token>' "
                "(mqds --token, ConnectionSettings(auth_token=...))",
            )
        presented = given[len("Bearer ") :].encode("utf-8")
        role = None
        for token, token_role in self._tokens.items():  # compare every token in constant time
            if hmac.compare_digest(presented, token.encode("utf-8")):
                role = token_role
        if role is None:
            raise errors.error(Reason.UNAUTHENTICATED, "the token is not one this node accepts")
        return role

    def check(self, method: str, metadata: Mapping[str, str]) -> Method:
        """The method's entry; raises UNKNOWN_METHOD, UNAUTHENTICATED or PERMISSION_DENIED unless the caller may."""
        entry = self._methods.get(method)
        name = method.rsplit("/", 1)[-1]
        if entry is None or entry.role is Role.NOBODY:
            raise errors.error(Reason.UNKNOWN_METHOD, f"this node serves no method {method}")
        needed = entry.role.value
        if needed == "anyone":
            return entry
        if needed == "node":
            if self._is_node(metadata) or (self.dev_mode and not self._cluster.secret):
                return entry
            if not self._cluster.secret:
                raise errors.error(
                    Reason.UNAUTHENTICATED,
                    f"{name} is an internal call: this node has no cluster_secret and is not in dev_mode, so it "
                    "takes none",
                )
            raise self._secret_refusal(metadata, f"{name} is an internal call between the cluster's nodes")
        if not self._tokens:
            # No client authentication, but administration is never open to
            # whoever reaches the port: it needs the cluster's own proof.
            if needed == "admin" and not self.dev_mode and not self._is_node(metadata):
                raise self._secret_refusal(metadata, f"{name} changes the cluster or reads all of it")
            return entry
        role = self._token_role(metadata)
        if ROLES.index(role) < ROLES.index(needed):
            raise errors.error(
                Reason.PERMISSION_DENIED, f"the {role} role may not call {name}: it needs the {needed} role"
            )
        return entry

    # -- the interceptor --------------------------------------------------------------------------------

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        # On the server's polling thread: nothing here may block.
        method = details.method
        metadata = {key: value for key, value in details.invocation_metadata or () if isinstance(value, str)}
        try:
            entry = self.check(method, metadata)
        except MqdsError as err:
            return self._refuse(err)
        handler = continuation(details)
        if handler is None:
            return None
        lane = entry.lane
        most = self.limits.of(lane)
        with self._lock:
            if most and self._lanes[lane] >= most:
                why = _FULL[lane].format(n=most)
            elif entry.own_cap and self._reflection >= self.limits.max_reflection_streams:
                why = (
                    f"this node already serves {self.limits.max_reflection_streams} server-reflection streams; "
                    "retry shortly"
                )
            else:
                why = ""
                self._lanes[lane] += 1
                self._reflection += entry.own_cap
        if why:
            return self._refuse(errors.error(Reason.OVERLOADED, why))
        return self._bounded(method, handler, entry)

    def _refuse(self, err: MqdsError) -> grpc.RpcMethodHandler:
        self._count(err.reason)
        return _refusal_handler(err, self._control_pool)

    def _count(self, reason: Reason) -> None:
        with self._lock:
            self.rejected[reason.value] += 1

    def _release(self, key: str | None, entry: Method) -> None:
        with self._lock:
            self._lanes[entry.lane] -= 1
            self._reflection -= entry.own_cap
            if key is not None:
                self._in_flight[key] -= 1
                if not self._in_flight[key]:
                    del self._in_flight[key]

    def _admit(self, context: grpc.ServicerContext, lane: Lane) -> str | None:
        """On the worker, first thing: the call's client, counted; raises OVERLOADED or DEADLINE_EXCEEDED instead."""
        remaining = context.time_remaining()
        if remaining is not None:
            if remaining <= 0:
                raise errors.error(Reason.DEADLINE_EXCEEDED, "the call's deadline passed before a worker took it")
            set_deadline(time.monotonic() + remaining)
        per_client = self.limits.max_calls_per_client
        if per_client <= 0 or lane not in _PER_CLIENT:
            return None
        key = context.peer()  # a client's connection (host:port of its end)
        with self._lock:
            if self._in_flight[key] >= per_client:
                raise errors.error(
                    Reason.OVERLOADED,
                    f"this client already has {per_client} calls and streams in flight here "
                    "(max_calls_per_client); wait for answers before sending more",
                )
            self._in_flight[key] += 1
        return key

    def _parser(self, method: str, handler: grpc.RpcMethodHandler, entry: Method) -> Callable[[bytes], Any]:
        most, name = self._bytes[entry.request_bytes]
        return bounded_parser(
            handler.request_deserializer, method.rsplit("/", 1)[-1] + "'s request", most, name, self._fields.get(method)
        )

    def _bounded(self, method: str, handler: grpc.RpcMethodHandler, entry: Method) -> grpc.RpcMethodHandler:
        """The admitted handler, wrapped so its slot is given back exactly when its worker is done.

        Always request-streaming: gRPC calls such a behavior even when the
        call was cancelled while it queued for a worker (a unary-request
        behavior is then skipped), so the slot taken above is always given
        back. The wrapper reads the one request of a unary-request method
        itself.
        """
        inner = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        unary_request = not handler.request_streaming
        released = threading.Event()
        lane = entry.lane
        pool = self._pools.get(lane)

        def release(key: str | None) -> None:
            if not released.is_set():
                released.set()
                self._release(key, entry)

        def argument(requests: Iterator[Any]) -> Any:
            if not unary_request:
                return _checked(requests)
            for request in requests:
                if isinstance(request, Refused):
                    raise request.error
                return request
            raise errors.error(Reason.INVALID_REQUEST, "the call ended without its request message")

        def refused(err: MqdsError, context: grpc.ServicerContext) -> None:
            self._count(err.reason)
            context.abort_with_status(errors.to_status(err))

        parse = self._parser(method, handler, entry)
        if not handler.response_streaming:

            def call(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                key = None
                try:
                    key = self._admit(context, lane)
                    return inner(argument(requests), context)
                except MqdsError as err:  # refused: by _admit, or a request by argument() or as the handler read it
                    refused(err, context)
                finally:
                    release(key)

            _run_on(call, pool)
            return grpc.stream_unary_rpc_method_handler(
                call, request_deserializer=parse, response_serializer=handler.response_serializer
            )

        def stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            # A generator: gRPC starts it on the worker and always asks it for
            # a first response, so the finally below runs (dropped unfinished,
            # it is closed with GeneratorExit).
            key = None
            timer = None
            try:
                key = self._admit(context, lane)
                if entry.max_duration_s is not None:
                    timer = threading.Timer(entry.max_duration_s, context.cancel)
                    timer.daemon = True
                    timer.start()
                yield from inner(argument(requests), context)
            except MqdsError as err:
                refused(err, context)
            finally:
                if timer is not None:
                    timer.cancel()
                release(key)

        _run_on(stream, pool)
        return grpc.stream_stream_rpc_method_handler(
            stream, request_deserializer=parse, response_serializer=handler.response_serializer
        )
