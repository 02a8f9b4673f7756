"""EMQX's ExHook interface served by mqds: EMQX's hook calls become :class:`BrokerHooks` calls.

EMQX connects to this gRPC server (service ``emqx.exhook.v3.HookProvider``),
calls ``OnProviderLoaded`` and from then on calls the hooks the answer listed
(:meth:`BrokerHooks.needed_hooks`: the configuration's hooks, with the rules'
topics for message hooks, so EMQX does not call for other topics).

What ExHook allows, and so what this provider does:

- ``message.publish`` is the one hook EMQX waits for. The provider stores the
  message by the rules and answers CONTINUE with the message unchanged (a
  message an earlier hook refused, header ``allow_publish=false``, is not
  stored). When some rule records acknowledgements it keeps EMQX's message
  id -> stored position (:class:`~mqds.broker.exhook.positions.AckPositions`:
  in a bounded LRU and, replicated and expiring, in mqds), since the message
  EMQX later reports as delivered or acknowledged carries its id, not mqds's
  position; so a provider that restarted resolves the acknowledgements of
  messages the one before it stored. One neither knows (never stored, or
  its record expired) is counted and skipped.
- ``message.delivered`` runs the ``on_message_delivered`` rules (the
  delivery counts as the acknowledgement, QoS 0 too), resolved as above.
- Every other hook is a notification: EMQX ignores the answer. Client state,
  stored subscriptions, read positions and queue acknowledgements are all
  recorded; but **fetched offline and retained messages and looked-up proxy
  subscriptions cannot be handed back to EMQX sessions** through ExHook. The
  provider counts and logs them; delivering them needs an EMQX-side component
  or a broker integration that can deliver (the amqtt plugin).
- EMQX does not send the RETAIN flag in ExHook messages, so retain rules act
  only on messages whose ``headers`` carry ``retain=true`` (a bridge replaying
  messages may set it); with EMQX use its own retainer for retained messages.

Requests that are wrong (no clientid, a topic with wildcards, a QoS above 2)
get INVALID_ARGUMENT with a message saying what was wrong; mqds failures keep
their gRPC code (UNAVAILABLE when the cluster cannot be reached); anything
else is INTERNAL, logged with its traceback. No request stops the server.

Who may call: :class:`ExhookServer` serves mutual TLS wherever another machine
can connect (:mod:`mqds.broker.exhook.listener`), and answers only the methods
:mod:`mqds.broker.exhook.methods` classifies as handled or no-op; every other
call is refused before it is read.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from mqds.broker.actions import BrokerHooks, Delivery
from mqds.broker.exhook.listener import ProviderTLS, check_listener
from mqds.broker.exhook.methods import SERVICE, MethodGuard
from mqds.broker.exhook.positions import DEFAULT_TTL_S, AckPositions
from mqds.broker.exhook.v3 import exhook_pb2 as pb
from mqds.broker.exhook.v3 import exhook_pb2_grpc as pb_grpc
from mqds.client.model import Message
from mqds.protocol.errors import MqdsError
from mqds.protocol.limits import SESSION_NEVER_EXPIRES

__all__ = ["SERVICE", "ExhookServer", "HookProvider", "UndecodableRequests", "to_message"]

log = logging.getLogger(__name__)

DEFAULT_ACK_CACHE_SIZE = 100_000

T = TypeVar("T")


def to_message(message: pb.Message, user_props: Any = (), props: Any = ()) -> Message:
    """An EMQX message as an mqds :class:`Message`: ``from`` is the sender; MQTT 5 user properties are kept.

    ``retain`` is read from the ``retain`` header (EMQX itself does not send
    the flag, see the module's documentation); ``message_expiry_s`` from the
    PUBLISH's ``Message-Expiry-Interval`` property (MQTT 5), which a
    retained message then keeps.
    """
    expiry = interval_property(props, "Message-Expiry-Interval")
    return Message(
        topic=message.topic,
        payload=message.payload,
        sender=getattr(message, "from"),
        qos=message.qos,
        retain=message.headers.get("retain", "").lower() in ("true", "1"),
        properties=tuple((p.name, p.value) for p in user_props),
        message_expiry_s=expiry or 0,
    )


def interval_property(props: Any, name: str) -> int | None:
    """An MQTT 5 interval property (seconds, a four-byte integer) as EMQX sends it (text); None when absent.

    ValueError (the call is answered INVALID_ARGUMENT) for a value that is
    not one.
    """
    for prop in props:
        if prop.name == name:
            try:
                value = int(prop.value)
            except ValueError:
                raise ValueError(f"{name} {prop.value!r} is not a number of seconds") from None
            if not 0 <= value <= SESSION_NEVER_EXPIRES:
                raise ValueError(f"{name} {value} is out of range (0 to {SESSION_NEVER_EXPIRES} seconds)")
            return value
    return None


class UndecodableRequests(logging.Filter):
    """Logs a request gRPC could not decode as one warning line instead of an error with a traceback.

    Install it on the ``grpc._cython.cygrpc`` logger: a peer sending bytes
    that are not the expected message is the peer's mistake (gRPC answers it
    with UNKNOWN and the parse error), not a failure of this server.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, DecodeError):
            record.msg, record.args = "%s: %s", (record.getMessage(), error)
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def _clientid(info: pb.ClientInfo) -> str:
    if not info.clientid:
        raise ValueError("clientinfo.clientid is empty")
    return info.clientid


class HookProvider(pb_grpc.HookProviderServicer):
    """The ExHook servicer: one method per EMQX hook, each mapped to a :class:`BrokerHooks` call.

    ``calls`` counts the calls of each RPC, ``failures`` those answered with an
    error, ``stats`` what the provider itself did or could not do (the
    dispatcher's own counts are in ``hooks.stats``).
    """

    def __init__(
        self,
        hooks: BrokerHooks,
        *,
        ack_cache_size: int = DEFAULT_ACK_CACHE_SIZE,
        ack_positions_ttl_s: int = DEFAULT_TTL_S,
    ) -> None:
        if ack_cache_size < 1:
            raise ValueError("ack_cache_size must be at least 1")
        self.hooks = hooks
        self.ack_cache_size = ack_cache_size
        # EMQX message id -> (shard, timestamp_us) of the stored copy: here (LRU) and in mqds.
        self.positions = AckPositions(hooks.client, cache_size=ack_cache_size, ttl_s=ack_positions_ttl_s)
        self.calls: collections.Counter[str] = collections.Counter()
        self.failures: collections.Counter[str] = collections.Counter()
        self.stats: collections.Counter[str] = collections.Counter()
        self.started = time.monotonic()
        # clientid -> the Session Expiry Interval of its CONNECT (OnClientConnect), until OnClientConnected.
        self._session_expiry: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._told_undeliverable = False

    # -- plumbing --------------------------------------------------------------------

    async def _run(self, name: str, context: Any, work: Callable[[], Awaitable[T]]) -> T:
        """Count the call and run it; turn a failure into a gRPC status that says what went wrong."""
        self.calls[name] += 1
        try:
            return await work()
        except MqdsError as err:
            self.failures[name] += 1
            log.warning("%s failed: %s", name, err)
            await context.abort(err.code, f"{name}: {err}")
        except ValueError as err:
            self.failures[name] += 1
            log.warning("%s: invalid request: %s", name, err)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: invalid request: {err}")
        except Exception as err:
            self.failures[name] += 1
            log.exception("%s failed", name)
            await context.abort(grpc.StatusCode.INTERNAL, f"{name}: internal error: {type(err).__name__}: {err}")
        raise AssertionError("context.abort returned")  # it raises

    def position_of(self, message_id: str) -> tuple[int, int] | None:
        """The stored position this process remembers for an EMQX message id, if any (mqds is not asked)."""
        return self.positions.remembered(message_id)

    async def _stored_message(self, hook: str, name: str, request: Any) -> tuple[str, Message] | None:
        """The client and the message, with its stored position, of a delivered or acknowledged message.

        None when no rule of ``hook`` acknowledges the message's topic (mqds
        is not asked), and (counted as ``<name>_of_unknown_messages``) when
        its position is unknown: no rule stores the topic, or it was not
        stored, or its record expired.
        """
        clientid = _clientid(request.clientinfo)
        if not request.HasField("message"):
            raise ValueError("message is missing")
        topic = request.message.topic
        if not any(rule.kind == "ack" for rule in self.hooks.config.rules_for(hook, topic)):
            return None
        stores = self.hooks.config.rules_for("message.publish", topic)
        stored = any(rule.kind == "store" for rule in stores)
        # A message no rule stores has no position: mqds is not asked.
        position = await self.positions.resolve(request.message.id) if stored else None
        if position is None:
            self.stats[f"{name}_of_unknown_messages"] += 1
            return None
        message = to_message(request.message)
        message.shard, message.timestamp_us = position
        return clientid, message

    def _undeliverable(self, what: str, clientid: str, count: int) -> None:
        self.stats[what] += count
        level = logging.DEBUG if self._told_undeliverable else logging.INFO
        self._told_undeliverable = True
        log.log(
            level,
            "client %s: %d %s that ExHook cannot hand to EMQX (counted; see docs/brokers.md)",
            clientid,
            count,
            what.replace("_", " "),
        )

    # -- provider ----------------------------------------------------------------------

    async def OnProviderLoaded(self, request: pb.ProviderLoadedRequest, context: Any) -> pb.LoadedResponse:
        async def work() -> pb.LoadedResponse:
            specs = [pb.HookSpec(name=name, topics=topics) for name, topics in self.hooks.needed_hooks().items()]
            log.info(
                "loaded by EMQX %s (node %s, cluster %s): hooks %s",
                request.broker.version or "?",
                request.meta.node or "?",
                request.meta.cluster_name or "?",
                ", ".join(spec.name for spec in specs),
            )
            return pb.LoadedResponse(hooks=specs)

        return await self._run("OnProviderLoaded", context, work)

    async def OnProviderUnloaded(self, request: pb.ProviderUnloadedRequest, context: Any) -> pb.EmptySuccess:
        async def work() -> pb.EmptySuccess:
            log.info("unloaded by EMQX node %s", request.meta.node or "?")
            return pb.EmptySuccess()

        return await self._run("OnProviderUnloaded", context, work)

    # -- clients -----------------------------------------------------------------------

    async def OnClientConnected(self, request: pb.ClientConnectedRequest, context: Any) -> pb.EmptySuccess:
        async def work() -> pb.EmptySuccess:
            clientid = _clientid(request.clientinfo)
            expiry = self._session_expiry.pop(clientid, None)
            found = await self.hooks.client_connected(
                clientid, node=request.clientinfo.node or None, session_expiry_s=expiry
            )
            if found:
                self._undeliverable("proxy_subscriptions_found", clientid, len(found))
            return pb.EmptySuccess()

        return await self._run("OnClientConnected", context, work)

    async def OnClientConnect(self, request: pb.ClientConnectRequest, context: Any) -> pb.EmptySuccess:
        """Keep the CONNECT's Session Expiry Interval for OnClientConnected, which EMQX sends without it.

        MQTT 5 without the property means 0 (the session ends at the
        disconnect); MQTT 3.x has none: the node's default applies.
        """

        async def work() -> pb.EmptySuccess:
            conninfo = request.conninfo
            if conninfo.proto_ver != "5" or not conninfo.clientid:
                return pb.EmptySuccess()
            expiry = interval_property(request.props, "Session-Expiry-Interval")
            self._session_expiry[conninfo.clientid] = expiry or 0
            self._session_expiry.move_to_end(conninfo.clientid)
            while len(self._session_expiry) > self.ack_cache_size:
                self._session_expiry.popitem(last=False)
            return pb.EmptySuccess()

        return await self._run("OnClientConnect", context, work)

    async def OnClientDisconnected(self, request: pb.ClientDisconnectedRequest, context: Any) -> pb.EmptySuccess:
        async def work() -> pb.EmptySuccess:
            clientid = _clientid(request.clientinfo)
            await self.hooks.client_disconnected(clientid, node=request.clientinfo.node or None)
            return pb.EmptySuccess()

        return await self._run("OnClientDisconnected", context, work)

    async def OnSessionCreated(self, request: pb.SessionCreatedRequest, context: Any) -> pb.EmptySuccess:
        async def work() -> pb.EmptySuccess:
            clientid = _clientid(request.clientinfo)
            found = await self.hooks.session_created(clientid, node=request.clientinfo.node or None)
            if found:
                self._undeliverable("proxy_subscriptions_found", clientid, len(found))
            return pb.EmptySuccess()

        return await self._run("OnSessionCreated", context, work)

    # -- subscriptions -----------------------------------------------------------------

    async def OnSessionSubscribed(self, request: pb.SessionSubscribedRequest, context: Any) -> pb.EmptySuccess:
        async def work() -> pb.EmptySuccess:
            clientid = _clientid(request.clientinfo)
            if not request.topic:
                raise ValueError("topic is empty")
            delivery: Delivery = await self.hooks.session_subscribed(
                clientid, request.topic, request.subopts.qos, send_retained=request.subopts.rh != 2
            )
            if delivery.offline:
                self._undeliverable("offline_messages_found", clientid, len(delivery.offline))
            if delivery.retained:
                self._undeliverable("retained_messages_found", clientid, len(delivery.retained))
            return pb.EmptySuccess()

        return await self._run("OnSessionSubscribed", context, work)

    async def OnSessionUnsubscribed(self, request: pb.SessionUnsubscribedRequest, context: Any) -> pb.EmptySuccess:
        async def work() -> pb.EmptySuccess:
            clientid = _clientid(request.clientinfo)
            if not request.topic:
                raise ValueError("topic is empty")
            await self.hooks.session_unsubscribed(clientid, request.topic)
            return pb.EmptySuccess()

        return await self._run("OnSessionUnsubscribed", context, work)

    # -- messages ----------------------------------------------------------------------

    async def OnMessagePublish(self, request: pb.MessagePublishRequest, context: Any) -> pb.ValuedResponse:
        async def work() -> pb.ValuedResponse:
            if not request.HasField("message"):
                raise ValueError("message is missing")
            if request.message.headers.get("allow_publish", "").lower() == "false":
                # An earlier hook refused it: EMQX drops it, so there is nothing to keep.
                self.stats["refused_messages_skipped"] += 1
            else:
                stored = await self.hooks.message_publish(
                    to_message(request.message, request.user_props, request.props)
                )
                if stored is not None and self.hooks.records_acks:
                    await self.positions.record(request.message.id, stored)
            return pb.ValuedResponse(type=pb.ValuedResponse.CONTINUE, message=request.message)

        return await self._run("OnMessagePublish", context, work)

    async def OnMessageAcked(self, request: pb.MessageAckedRequest, context: Any) -> pb.EmptySuccess:
        return await self._acknowledgement(
            "OnMessageAcked", "message.acked", "acks", request, context, self.hooks.message_acked
        )

    async def OnMessageDelivered(self, request: pb.MessageDeliveredRequest, context: Any) -> pb.EmptySuccess:
        """EMQX sent a message to a subscriber: the ``message.delivered`` rules (``on_message_delivered``)."""
        return await self._acknowledgement(
            "OnMessageDelivered", "message.delivered", "deliveries", request, context, self.hooks.message_delivered
        )

    async def _acknowledgement(
        self,
        name: str,
        hook: str,
        counted: str,
        request: Any,
        context: Any,
        act: Callable[[str, Message], Awaitable[None]],
    ) -> pb.EmptySuccess:
        """An acknowledgement (or a delivery): ``act`` on the client and the message at its stored position."""

        async def work() -> pb.EmptySuccess:
            found = await self._stored_message(hook, counted, request)
            if found is not None:
                await act(*found)
            return pb.EmptySuccess()

        return await self._run(name, context, work)

    # -- hooks mqds does not use: answered, counted --------------------------------------

    async def _ignored(self, name: str) -> pb.EmptySuccess:
        self.calls[name] += 1
        return pb.EmptySuccess()

    async def OnClientConnack(self, request: pb.ClientConnackRequest, context: Any) -> pb.EmptySuccess:
        return await self._ignored("OnClientConnack")

    async def OnClientSubscribe(self, request: pb.ClientSubscribeRequest, context: Any) -> pb.EmptySuccess:
        return await self._ignored("OnClientSubscribe")

    async def OnClientUnsubscribe(self, request: pb.ClientUnsubscribeRequest, context: Any) -> pb.EmptySuccess:
        return await self._ignored("OnClientUnsubscribe")

    async def OnSessionResumed(self, request: pb.SessionResumedRequest, context: Any) -> pb.EmptySuccess:
        return await self._ignored("OnSessionResumed")

    async def OnSessionDiscarded(self, request: pb.SessionDiscardedRequest, context: Any) -> pb.EmptySuccess:
        return await self._ignored("OnSessionDiscarded")

    async def OnSessionTakenover(self, request: pb.SessionTakenoverRequest, context: Any) -> pb.EmptySuccess:
        return await self._ignored("OnSessionTakenover")

    async def OnSessionTerminated(self, request: pb.SessionTerminatedRequest, context: Any) -> pb.EmptySuccess:
        return await self._ignored("OnSessionTerminated")

    async def OnMessageDropped(self, request: pb.MessageDroppedRequest, context: Any) -> pb.EmptySuccess:
        return await self._ignored("OnMessageDropped")

    # OnClientAuthenticate and OnClientAuthorize are refused (methods.HOOK_METHODS): the servicer's base class
    # answers them UNIMPLEMENTED too, should a server without the MethodGuard serve this servicer.

    # -- reporting ---------------------------------------------------------------------

    def summary(self) -> str:
        """What was handled, done and refused, as a few readable lines."""
        elapsed = time.monotonic() - self.started
        total = sum(self.calls.values())
        failed = sum(self.failures.values())
        lines = [f"handled {total} call{'' if total == 1 else 's'} in {elapsed:.1f} s, {failed} answered with an error"]
        if self.calls:
            lines.append("  calls: " + ", ".join(f"{name} {n}" for name, n in sorted(self.calls.items())))
        if self.failures:
            lines.append("  errors: " + ", ".join(f"{name} {n}" for name, n in sorted(self.failures.items())))
        done = self.hooks.stats + self.stats + self.positions.stats
        if done:
            lines.append("  done: " + ", ".join(f"{what.replace('_', ' ')} {n}" for what, n in sorted(done.items())))
        piped = self.hooks.client.pipeline_stats()
        if piped["calls"]:
            # How well concurrent publishes shared batches: messages / batches.
            lines.append("  pipeline: " + ", ".join(f"{what} {n}" for what, n in piped.items()))
        return "\n".join(lines)


class ExhookServer:
    """A ``grpc.aio`` server serving a :class:`HookProvider` on ``listen`` (``HOST:PORT``; port 0 picks one).

    ``tls``: the certificate to serve and the CA of EMQX's client certificate
    (mutual TLS, EMQX's ``ssl`` option of the exhook server), or None for
    plaintext. Anything but mutual TLS authenticates no caller, so it is
    refused (ValueError) on an address other machines can reach unless
    ``insecure_no_client_auth`` (``insecure`` is then True: warn about it).
    Only the methods :mod:`~mqds.broker.exhook.methods` lets through are served.
    """

    def __init__(
        self,
        provider: HookProvider,
        listen: str,
        tls: ProviderTLS | None = None,
        *,
        insecure_no_client_auth: bool = False,
    ) -> None:
        host, sep, port = listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"--listen {listen!r}: expected HOST:PORT, e.g. 0.0.0.0:9000")
        self.insecure = check_listener(listen, tls, insecure_no_client_auth=insecure_no_client_auth)
        self.provider = provider
        self.listen = listen
        self.tls = tls
        self.guard = MethodGuard()
        self.address = listen
        self._server: grpc.aio.Server | None = None

    async def start(self) -> str:
        """Bind and start serving; return the address bound (``HOST:PORT`` with the real port)."""
        # No SO_REUSEPORT: a second server on a port in use must fail, not share its connections.
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)], interceptors=[self.guard])
        pb_grpc.add_HookProviderServicer_to_server(self.provider, server)
        try:
            if self.tls is None:
                port = server.add_insecure_port(self.listen)
            else:
                port = server.add_secure_port(self.listen, self.tls.credentials())
        except RuntimeError as err:
            raise OSError(f"cannot listen on {self.listen}: {err}") from None
        if not port:
            raise OSError(f"cannot listen on {self.listen}: the address is in use or not local")
        await server.start()
        self._server = server
        self.address = f"{self.listen.rpartition(':')[0]}:{port}"
        return self.address

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop taking calls; let the calls in flight finish for up to ``grace_s`` seconds."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
