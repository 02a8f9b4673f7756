"""Every method of EMQX's ``HookProvider`` service, classified; a call to any other is refused.

Deny by default: :class:`MethodGuard`, the provider server's interceptor,
lets a call through only to a method :data:`HOOK_METHODS` marks handled or
no-op. A method the table marks refused, or does not list at all (a newer
``exhook.proto`` adding one, a probe of another service), is answered
UNIMPLEMENTED before anything of the request is read, so a method cannot
ship served by accident. ``tests/broker/test_exhook_methods.py`` enumerates
the service's descriptor and fails when a method has no entry.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

__all__ = ["HOOK_METHODS", "SERVICE", "Handling", "MethodGuard"]

SERVICE = "emqx.exhook.v3.HookProvider"


class Handling(enum.Enum):
    """What the provider does with a call of a method."""

    HANDLED = "handled"
    """Mapped to :class:`~mqds.broker.actions.BrokerHooks`: it reads or writes the mqds cluster."""
    NO_OP = "no-op"
    """Answered (``EmptySuccess``) and counted: mqds keeps nothing of it, and EMQX ignores the answer."""
    REFUSED = "refused"
    """Answered UNIMPLEMENTED: never registered, and not the provider's decision to make."""


HOOK_METHODS: dict[str, Handling] = {
    "OnProviderLoaded": Handling.HANDLED,
    "OnProviderUnloaded": Handling.HANDLED,
    "OnClientConnect": Handling.HANDLED,
    "OnClientConnack": Handling.NO_OP,
    "OnClientConnected": Handling.HANDLED,
    "OnClientDisconnected": Handling.HANDLED,
    # Authentication and authorization stay EMQX's: the provider never registers these hooks, and
    # answering them would let whoever calls the port speak for a decision mqds does not make.
    "OnClientAuthenticate": Handling.REFUSED,
    "OnClientAuthorize": Handling.REFUSED,
    "OnClientSubscribe": Handling.NO_OP,
    "OnClientUnsubscribe": Handling.NO_OP,
    "OnSessionCreated": Handling.HANDLED,
    "OnSessionSubscribed": Handling.HANDLED,
    "OnSessionUnsubscribed": Handling.HANDLED,
    "OnSessionResumed": Handling.NO_OP,
    "OnSessionDiscarded": Handling.NO_OP,
    "OnSessionTakenover": Handling.NO_OP,
    "OnSessionTerminated": Handling.NO_OP,
    "OnMessagePublish": Handling.HANDLED,
    "OnMessageDelivered": Handling.HANDLED,
    "OnMessageDropped": Handling.NO_OP,
    "OnMessageAcked": Handling.HANDLED,
}


def classify(full_method: str) -> Handling:
    """How a call of ``/package.Service/Method`` is answered: anything not in the table is refused."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    if service != SERVICE:
        return Handling.REFUSED
    return HOOK_METHODS.get(method, Handling.REFUSED)


def _refusal(full_method: str) -> grpc.RpcMethodHandler:
    message = (
        f"{full_method} is not served by mqds exhook (it serves the {SERVICE} hooks it stores or answers; "
        "authentication and authorization hooks stay EMQX's)"
    )

    async def refuse(request: bytes, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)

    # No deserializer: the request's bytes are never parsed.
    return grpc.unary_unary_rpc_method_handler(refuse)


class MethodGuard(grpc.aio.ServerInterceptor):
    """Refuses every call :func:`classify` does not let through, before the servicer or a parser sees it."""

    def __init__(self) -> None:
        self.refused = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = str(handler_call_details.method)
        if classify(method) is Handling.REFUSED:
            self.refused += 1
            return _refusal(method)
        return await continuation(handler_call_details)
