"""gRPC method handlers: parsing, and the one place errors become statuses.

The generated ``add_StorageServicer_to_server`` would let a request that does
not parse (for example a topic that is not UTF-8) fail inside gRPC with a
status that says nothing useful. These handlers parse themselves, so such a
request gets INVALID_ARGUMENT / MALFORMED_REQUEST naming the message type, and
any ``MqdsError`` a method raises is sent with its reason in ErrorInfo.
Being that one place, they also time every call and count the refused ones
by reason for the node's metrics (one histogram observation per call).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf import descriptor as protobuf_descriptor
from google.protobuf import message as protobuf_message

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.server.api.request_bounds import WithRaw, check_parsed, malformed

if TYPE_CHECKING:
    from mqds.server.metrics import MethodMetrics, RequestMetrics

log = logging.getLogger(__name__)


T = TypeVar("T", bound=Callable[..., Any])


def takes_raw_request(method: T) -> T:
    """Mark a service method that takes ``(request, raw)``: the parsed request and its bytes."""
    method.takes_raw_request = True  # type: ignore[attr-defined]
    return method


def _parser(cls: type[protobuf_message.Message], keep_raw: bool) -> Callable[[bytes], Any]:
    """The request's deserializer: never raises (gRPC would answer INTERNAL); the guard bounds it first."""

    def parse(raw: bytes) -> Any:
        try:
            parsed = cls.FromString(raw)
        except Exception as err:  # DecodeError, or a RuntimeError from upb
            return malformed(cls.DESCRIPTOR.full_name, err)
        return WithRaw(parsed, raw) if keep_raw else parsed

    return parse


def _serialize(response: Any) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()


def _abort(context: grpc.ServicerContext, name: str, err: Exception, metrics: MethodMetrics | None) -> None:
    """End a call with ``err``'s status (an unexpected exception: logged, INTERNAL), counting the refusal."""
    if not isinstance(err, MqdsError):
        log.exception("%s failed", name, exc_info=err)
        err = errors.error(Reason.INTERNAL, f"{name} failed: {err}")
    if metrics is not None:
        metrics.rejected(err.reason)
    context.abort_with_status(errors.to_status(err))


def _unary(
    method: Callable[..., Any],
    request_cls: type[protobuf_message.Message],
    metrics: MethodMetrics | None = None,
) -> grpc.RpcMethodHandler:
    name = method.__name__
    keep_raw = getattr(method, "takes_raw_request", False)
    wants_context = not keep_raw and len(inspect.signature(method).parameters) >= 2

    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        started = metrics.started(context) if metrics is not None else 0.0
        try:
            check_parsed(request)
            if keep_raw:
                return method(request.parsed, request.raw)
            return method(request, context) if wants_context else method(request)
        except Exception as err:
            _abort(context, name, err, metrics)
        finally:
            if metrics is not None:
                metrics.finished(started)

    return grpc.unary_unary_rpc_method_handler(
        handle,
        request_deserializer=_parser(request_cls, keep_raw),
        response_serializer=_serialize,
    )


def _bidi(
    method: Callable[..., Any],
    request_cls: type[protobuf_message.Message],
    metrics: MethodMetrics | None = None,
) -> grpc.RpcMethodHandler:
    """A bidirectional-streaming handler: ``method(requests, context)`` yields answers (bytes or messages).

    Each request arrives as the parser left it (``check_parsed`` turns a bad
    one into its error; ``.parsed`` and ``.raw`` of a good one). An
    ``MqdsError`` the method raises ends the stream with its status, after
    the answers it yielded before.
    """
    name = method.__name__

    def handle(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        started = metrics.started(context) if metrics is not None else 0.0
        try:
            yield from method(requests, context)
        except Exception as err:
            _abort(context, name, err, metrics)
        finally:
            if metrics is not None:
                metrics.finished(started)

    return grpc.stream_stream_rpc_method_handler(
        handle,
        request_deserializer=_parser(request_cls, True),
        response_serializer=_serialize,
    )


def _server_stream(
    method: Callable[..., Any],
    request_cls: type[protobuf_message.Message],
    metrics: MethodMetrics | None = None,
) -> grpc.RpcMethodHandler:
    """A server-streaming handler: ``method(request)`` returns an iterator of answers (bytes or messages).

    An ``MqdsError`` raised before or while answering ends the stream with
    its status, after the answers sent before.
    """
    name = method.__name__

    def handle(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        started = metrics.started(context) if metrics is not None else 0.0
        try:
            yield from method(check_parsed(request))
        except Exception as err:
            _abort(context, name, err, metrics)
        finally:
            if metrics is not None:
                metrics.finished(started)

    return grpc.unary_stream_rpc_method_handler(
        handle,
        request_deserializer=_parser(request_cls, False),
        response_serializer=_serialize,
    )


def unary_handlers(
    descriptor: protobuf_descriptor.ServiceDescriptor,
    impl: Any,
    module: ModuleType,
    metrics: RequestMetrics | None = None,
    streams: bool = False,
) -> dict[str, grpc.RpcMethodHandler]:
    """Handlers for the unary methods of a service, calling ``impl``'s methods of the same names.

    A method of ``impl`` takes the parsed request, and the call context if it
    has a second parameter; a bidirectional-streaming method takes the
    requests and the context and yields its answers (``_bidi``), and a
    server-streaming one takes the request and returns its answers
    (``_server_stream``), with ``streams`` (otherwise streaming methods are
    left to the caller). With ``metrics``, each call is timed and a refused
    one counted, under the service's short name (``Storage``) and the method's.
    """
    methods = {}
    for method in descriptor.methods:
        request_cls = getattr(module, method.input_type.name)
        counted = metrics.method(descriptor.name, method.name) if metrics is not None else None
        if method.client_streaming and method.server_streaming and streams:
            methods[method.name] = _bidi(getattr(impl, method.name), request_cls, counted)
        elif method.server_streaming and not method.client_streaming and streams:
            methods[method.name] = _server_stream(getattr(impl, method.name), request_cls, counted)
        elif not (method.client_streaming or method.server_streaming):
            methods[method.name] = _unary(getattr(impl, method.name), request_cls, counted)
    return methods


def service_handler(
    descriptor: protobuf_descriptor.ServiceDescriptor,
    impl: Any,
    module: ModuleType,
    metrics: RequestMetrics | None = None,
) -> grpc.GenericRpcHandler:
    """The generic handler serving every (unary) method of a service with ``impl``."""
    return grpc.method_handlers_generic_handler(
        descriptor.full_name, unary_handlers(descriptor, impl, module, metrics, streams=True)
    )
