"""Who may call what on the public API, and how many calls one client may have in flight.

Clients authenticate with a bearer token (``authorization: Bearer <token>``
metadata; ``mqds --token``, ``ConnectionSettings(auth_token=...)``). The node
reads the tokens and their roles from ``auth_tokens_file``; without that
file, authentication is off and every caller may do everything (as before,
for development and for clusters reachable only by trusted brokers).

Roles, each including the ones before it:

- ``reader``: reads messages, streams, fences, generations, broker state and
  the cluster map (analytics, Spark, dashboards);
- ``broker``: also stores messages and writes broker state (client state,
  subscriptions, retained messages, acknowledgements);
- ``admin``: also changes generations and membership, deletes, and
  exports and imports whole shards (backup and restore).

A node of the cluster (one presenting the cluster secret) is an admin. A call
without a valid token gets UNAUTHENTICATED, a call its role does not allow
gets PERMISSION_DENIED; both are counted in ``rejected``. Health checks need
no token; server reflection needs the reader role when tokens are on.

Admin calls (membership and generations) are never open to anyone who can
reach the port: without a tokens file they need the cluster secret (as the
nodes present it, ``x-mqds-cluster-secret``; ``mqds admin`` reads it from
MQDS_CLUSTER_SECRET or --cluster-secret-file). Only ``dev_mode`` leaves them
open. A client certificate verified under mutual TLS does not make a caller
an admin: every client and peer holds one signed by the same CA.

This is a gRPC server interceptor, so it runs before a request is parsed and
applies to every service alike. It runs on the server's one polling thread,
not on a pool worker (see DESIGN.md, "Workers, limits and refusals"): what it
refuses is answered on a small pool of its own, and health checks run there
too, so neither ever waits behind calls. It also bounds the public calls in
flight on the node (``max_public_calls``, below ``grpc_workers``) and per
client connection (``max_calls_per_client``), and skips work whose caller's
deadline has passed; :func:`time_left` gives handlers what is left of it.
"""

from __future__ import annotations

import collections
import contextvars
import hmac
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason

ROLES = ("reader", "broker", "admin")
"""The roles, weakest first; each may do what the ones before it may."""

READ, WRITE, ADMIN = "reader", "broker", "admin"

# The role a public method needs; methods not listed are not public API
# (health, reflection, and the node-to-node service with its own check).
METHOD_ROLES: dict[str, str] = {
    **{f"/mqds.v1.Storage/{m}": READ for m in ("GetStreams", "MakeIterator", "Next", "ListGenerations", "GetFences")},
    "/mqds.v1.Storage/StoreBatch": WRITE,
    "/mqds.v1.Storage/StoreStream": WRITE,
    "/mqds.v1.Storage/AddGeneration": ADMIN,
    "/mqds.v1.Storage/DropGeneration": ADMIN,
    "/mqds.v1.Storage/DeleteMessages": ADMIN,
    # A backup's export holds every client's state and message: admins only, as the restore.
    "/mqds.v1.Storage/ExportShard": ADMIN,
    "/mqds.v1.Storage/ImportShard": ADMIN,
    **{
        f"/mqds.v1.Sessions/{m}": READ
        for m in (
            "GetClientState",
            "ClientsOnNode",
            "GetSubscriptions",
            "GetRetained",
            "GetReadPosition",
            "GetReadPositions",
            "FetchMessages",
            "FetchMessagesShared",
        )
    },
    **{
        f"/mqds.v1.Sessions/{m}": WRITE
        for m in (
            "ClientConnected",
            "ClientDisconnected",
            "Subscribe",
            "Unsubscribe",
            "Retain",
            "Ack",
            "ForgetReadPosition",
            "StartReadPosition",
            "StartReadPositions",
            "ForgetSession",
            "JoinShareGroup",
            "LeaveShareGroup",
        )
    },
    **{f"/mqds.v1.Cluster/{m}": READ for m in ("GetClusterMap", "GetNodeStatus")},
    **{f"/mqds.v1.Cluster/{m}": ADMIN for m in ("JoinNode", "LeaveNode", "ForgetNode", "Rebalance", "SetRetention")},
    "/mqds.v1.Cluster/GetReplicaDigest": ADMIN,  # a scan of a whole replica (api/replica_digest.py)
    # Server reflection describes the API: readers may use it (it is a stream a client holds open).
    **{f"/grpc.reflection.{v}.ServerReflection/ServerReflectionInfo": READ for v in ("v1alpha", "v1")},
}

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
REFLECTION = tuple(m for m in METHOD_ROLES if m.startswith("/grpc.reflection."))
OBSERVING = frozenset(f"/mqds.v1.Cluster/{m}" for m in ("GetClusterMap", "GetNodeStatus"))
"""Calls that only report what the node knows, never wait on storage or Raft: served on the control pool.

An operator's ``mqds status``, a client's map refresh and the chaos runner's
readiness wait are needed most when the node is busiest; behind the public
calls they queued for a worker (or were refused with every public slot
taken) and timed out. They still count against the caller's
``max_calls_per_client``, not against ``max_public_calls``.
"""

REFLECTION_MAX_S = 60.0
"""A server-reflection stream is cut after this long (tools ask, get their answer and close)."""

_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("mqds_call_deadline", default=None)


def time_left(limit_s: float) -> float:
    """``limit_s``, or less: what is left of the current public call's deadline (0 once it passed).

    gRPC runs each call in a context of its own, so this is the deadline of
    the call the current handler serves; outside one it is ``limit_s``.
    """
    deadline = _deadline.get()
    if deadline is None:
        return limit_s
    return max(0.0, min(limit_s, deadline - time.monotonic()))


class TokenFileError(ValueError):
    """The tokens file cannot be used; the message says which line and why."""


def load_tokens(path: str) -> dict[str, str]:
    """token -> role from a file of ``<role> <token>`` lines (``#`` starts a comment)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise TokenFileError(f"auth_tokens_file {path}: cannot read it: {err.strerror}") from None
    tokens: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenFileError(f"auth_tokens_file {path}, line {number}: expected '<role> <token>'")
        role, token = parts
        if role not in ROLES:
            raise TokenFileError(
                f"auth_tokens_file {path}, line {number}: unknown role {role!r}; roles are {', '.join(ROLES)}"
            )
        if len(token) < 16:
            raise TokenFileError(f"auth_tokens_file {path}, line {number}: a token needs at least 16 characters")
        if token in tokens:
            raise TokenFileError(f"auth_tokens_file {path}, line {number}: this token is listed twice")
        tokens[token] = role
    if not tokens:
        raise TokenFileError(f"auth_tokens_file {path}: no tokens in it; remove the setting to turn auth off")
    return tokens


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


class ApiGuard(grpc.ServerInterceptor):
    """Checks the caller's token and role, and bounds the public calls in flight, per client and in all."""

    def __init__(
        self,
        tokens: Mapping[str, str],
        is_cluster_node: Callable[[Mapping[str, str]], bool],
        max_calls_per_client: int,
        *,
        max_public_calls: int = 0,
        dev_mode: bool = False,
        control_pool: futures.ThreadPoolExecutor | None = None,
    ) -> None:
        self._tokens = dict(tokens)
        self._is_node = is_cluster_node
        self.max_calls_per_client = max_calls_per_client
        self.max_public_calls = max_public_calls
        """Public calls and streams in flight on the node in all (0 = no limit); keep it below the workers."""
        self.max_reflection_streams = max(1, max_public_calls // 4) if max_public_calls else 0
        self.dev_mode = dev_mode
        """Development: admin calls are open without a tokens file (as every call is)."""
        self._control_pool = control_pool
        self._lock = threading.Lock()
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._public = 0
        self._reflection = 0
        self.rejected: collections.Counter[str] = collections.Counter()
        """Refused calls by reason (UNAUTHENTICATED, PERMISSION_DENIED, OVERLOADED, DEADLINE_EXCEEDED)."""

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    @property
    def public_in_flight(self) -> int:
        return self._public

    def _role(self, metadata: Mapping[str, str]) -> str:
        if self._is_node(metadata):
            return ADMIN
        given = metadata.get("authorization", "")
        if not given.startswith("Bearer "):
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

    def check(self, method: str, metadata: Mapping[str, str]) -> None:
        """Raise UNAUTHENTICATED or PERMISSION_DENIED unless the caller may call ``method``."""
        needed = METHOD_ROLES.get(method)
        if needed is None:
            return
        if not self._tokens:
            # No client authentication, but administration is never open to
            # whoever reaches the port: it needs the cluster's own proof.
            if needed == ADMIN and not self.dev_mode and not self._is_node(metadata):
                raise errors.error(
                    Reason.UNAUTHENTICATED,
                    f"{method.rsplit('/', 1)[-1]} changes the cluster: present the cluster secret "
                    "(mqds admin reads MQDS_CLUSTER_SECRET or --cluster-secret-file; "
                    "ConnectionSettings(cluster_secret=...)), or configure auth_tokens_file and use an admin token",
                )
            return
        role = self._role(metadata)
        if ROLES.index(role) < ROLES.index(needed):
            raise errors.error(
                Reason.PERMISSION_DENIED,
                f"the {role} role may not call {method.rsplit('/', 1)[-1]}: it needs the {needed} role",
            )

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        # On the server's polling thread: nothing here may block.
        method = details.method
        if method == HEALTH_CHECK:
            return self._on_control_pool(continuation(details))
        if method not in METHOD_ROLES and method != HEALTH_WATCH:
            return continuation(details)
        metadata = {key: value for key, value in details.invocation_metadata or () if isinstance(value, str)}
        try:
            self.check(method, metadata)
        except MqdsError as err:
            return self._refuse(err)
        handler = continuation(details)
        if handler is None:
            return handler
        if method in OBSERVING and self._control_pool is not None:
            return self._observing(handler)
        reflection = method in REFLECTION
        with self._lock:
            if self.max_public_calls and self._public >= self.max_public_calls:
                why = (
                    f"this node already serves {self.max_public_calls} public calls (max_public_calls); "
                    "retry shortly, or spread calls over more nodes"
                )
            elif reflection and self._reflection >= self.max_reflection_streams:
                why = f"this node already serves {self.max_reflection_streams} server-reflection streams; retry shortly"
            else:
                why = ""
                self._public += 1
                self._reflection += reflection
        if why:
            return self._refuse(errors.error(Reason.OVERLOADED, why))
        return self._bounded(handler, reflection)

    def _observing(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """An OBSERVING call: bounded per client only, and run on the control pool."""
        bounded = self._bounded(handler, reflection=False, public=False)
        if bounded.stream_unary is not None:
            _run_on(bounded.stream_unary, self._control_pool)
        return bounded

    def _refuse(self, err: MqdsError) -> grpc.RpcMethodHandler:
        self._count(err.reason)
        return _refusal_handler(err, self._control_pool)

    def _count(self, reason: Reason) -> None:
        with self._lock:
            self.rejected[reason.value] += 1

    def _on_control_pool(self, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
        """Health checks: answered on the control pool, never behind the calls the server's workers serve."""
        if handler is None or handler.unary_unary is None or self._control_pool is None:
            return handler
        inner = handler.unary_unary

        def check(request: Any, context: grpc.ServicerContext) -> Any:
            return inner(request, context)

        _run_on(check, self._control_pool)
        return grpc.unary_unary_rpc_method_handler(
            check, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )

    def _release(self, key: str | None, reflection: bool, public: bool = True) -> None:
        with self._lock:
            self._public -= public
            self._reflection -= reflection
            if key is not None:
                self._in_flight[key] -= 1
                if not self._in_flight[key]:
                    del self._in_flight[key]

    def _admit(self, context: grpc.ServicerContext) -> str | None:
        """On the worker, first thing: the call's client, counted; raises OVERLOADED or DEADLINE_EXCEEDED instead."""
        remaining = context.time_remaining()
        if remaining is not None:
            if remaining <= 0:
                raise errors.error(Reason.DEADLINE_EXCEEDED, "the call's deadline passed before a worker took it")
            _deadline.set(time.monotonic() + remaining)
        if self.max_calls_per_client <= 0:
            return None
        key = context.peer()  # a client's connection (host:port of its end)
        with self._lock:
            if self._in_flight[key] >= self.max_calls_per_client:
                raise errors.error(
                    Reason.OVERLOADED,
                    f"this client already has {self.max_calls_per_client} calls in flight here "
                    "(max_calls_per_client); wait for answers before sending more",
                )
            self._in_flight[key] += 1
        return key

    def _bounded(self, handler: grpc.RpcMethodHandler, reflection: bool, public: bool = True) -> grpc.RpcMethodHandler:
        """The admitted handler, wrapped so its slot is given back exactly when its worker is done.

        ``public``: the call took one of ``max_public_calls`` (every call but the OBSERVING ones).

        Always request-streaming: gRPC calls such a behavior even when the
        call was cancelled while it queued for a worker (a unary-request
        behavior is then skipped), so the slot taken above is always given
        back. The wrapper reads the one request of a unary-request method
        itself.
        """
        inner = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        unary_request = not handler.request_streaming
        released = threading.Event()

        def release(key: str | None) -> None:
            if not released.is_set():
                released.set()
                self._release(key, reflection, public)

        def argument(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            if not unary_request:
                return requests
            for request in requests:
                return request
            raise errors.error(Reason.INVALID_REQUEST, "the call ended without its request message")

        def refused(err: MqdsError, context: grpc.ServicerContext) -> None:
            self._count(err.reason)
            context.abort_with_status(errors.to_status(err))

        if not handler.response_streaming:

            def call(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                key = None
                try:
                    try:
                        key = self._admit(context)
                    except MqdsError as err:
                        refused(err, context)
                    return inner(argument(requests, context), context)
                except MqdsError as err:  # INVALID_REQUEST from argument()
                    context.abort_with_status(errors.to_status(err))
                finally:
                    release(key)

            return grpc.stream_unary_rpc_method_handler(
                call, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
            )

        def stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            # A generator: gRPC starts it on the worker and always asks it for
            # a first response, so the finally below runs (dropped unfinished,
            # it is closed with GeneratorExit).
            key = None
            timer = None
            try:
                try:
                    key = self._admit(context)
                except MqdsError as err:
                    refused(err, context)
                if reflection:
                    timer = threading.Timer(REFLECTION_MAX_S, context.cancel)
                    timer.daemon = True
                    timer.start()
                yield from inner(argument(requests, context), context)
            except MqdsError as err:
                context.abort_with_status(errors.to_status(err))
            finally:
                if timer is not None:
                    timer.cancel()
                release(key)

        return grpc.stream_stream_rpc_method_handler(
            stream, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
