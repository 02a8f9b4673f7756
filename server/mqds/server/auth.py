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
- ``admin``: also changes generations and membership.

A node of the cluster (one presenting the cluster secret) is an admin. A call
without a valid token gets UNAUTHENTICATED, a call its role does not allow
gets PERMISSION_DENIED; both are counted in ``rejected``. Health checks and
server reflection need no token.

This is a gRPC server interceptor, so it runs before a request is parsed and
applies to every service alike.
"""

from __future__ import annotations

import collections
import hmac
import threading
from collections.abc import Callable, Mapping
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
    "/mqds.v1.Storage/AddGeneration": ADMIN,
    "/mqds.v1.Storage/DropGeneration": ADMIN,
    **{
        f"/mqds.v1.Sessions/{m}": READ
        for m in (
            "GetClientState",
            "ClientsOnNode",
            "GetSubscriptions",
            "GetRetained",
            "GetReadPosition",
            "FetchMessages",
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
        )
    },
    **{f"/mqds.v1.Cluster/{m}": READ for m in ("GetClusterMap", "GetNodeStatus", "GetReplicaDigest")},
    **{f"/mqds.v1.Cluster/{m}": ADMIN for m in ("JoinNode", "LeaveNode", "ForgetNode", "Rebalance")},
}


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


def _abort_handler(err: MqdsError) -> grpc.RpcMethodHandler:
    status = errors.to_status(err)

    def abort(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort_with_status(status)

    # Raw bytes in and out: a refused request is not parsed at all.
    return grpc.unary_unary_rpc_method_handler(abort)


class ApiGuard(grpc.ServerInterceptor):
    """Checks the caller's token and role, and bounds each client's calls in flight."""

    def __init__(
        self,
        tokens: Mapping[str, str],
        is_cluster_node: Callable[[Mapping[str, str]], bool],
        max_calls_per_client: int,
    ) -> None:
        self._tokens = dict(tokens)
        self._is_node = is_cluster_node
        self.max_calls_per_client = max_calls_per_client
        self._lock = threading.Lock()
        self._in_flight: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[str] = collections.Counter()
        """Refused calls by reason (UNAUTHENTICATED, PERMISSION_DENIED, OVERLOADED)."""

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

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
        if needed is None or not self._tokens:
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
        method = details.method
        if method not in METHOD_ROLES:
            return continuation(details)
        metadata = {key: value for key, value in details.invocation_metadata or () if isinstance(value, str)}
        try:
            self.check(method, metadata)
        except MqdsError as err:
            self._count(err.reason)
            return _abort_handler(err)
        return self._bounded(continuation(details))

    def _count(self, reason: Reason) -> None:
        with self._lock:
            self.rejected[reason.value] += 1

    def _bounded(self, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
        """The handler, refusing a call while its client already has ``max_calls_per_client`` in flight."""
        if handler is None or handler.unary_unary is None or self.max_calls_per_client <= 0:
            return handler
        inner = handler.unary_unary

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            key = context.peer()  # a client's connection (host:port of its end)
            with self._lock:
                if self._in_flight[key] >= self.max_calls_per_client:
                    self.rejected[Reason.OVERLOADED.value] += 1
                    refused = True
                else:
                    self._in_flight[key] += 1
                    refused = False
            if refused:
                context.abort_with_status(
                    errors.to_status(
                        errors.error(
                            Reason.OVERLOADED,
                            f"this client already has {self.max_calls_per_client} calls in flight here "
                            "(max_calls_per_client); wait for answers before sending more",
                        )
                    )
                )
            try:
                return inner(request, context)
            finally:
                with self._lock:
                    self._in_flight[key] -= 1
                    if not self._in_flight[key]:
                        del self._in_flight[key]

        return grpc.unary_unary_rpc_method_handler(
            call, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
