"""The public Sessions service: what a broker keeps besides messages (see proto/mqds/v1/sessions.proto).

Each write is checked here and logged as a ``SessionCommand`` in the Raft
group of the shard that owns its key: the clientid's shard for client state,
subscriptions and read positions, the topic's shard for a retained message,
the message's shard for a queue acknowledgement. A request that reaches a
node not leading that shard gets NOT_LEADER with the leader hint, like every
Storage write. Listing requests name their shards, and each is read on its
leader (or any replica with ``stale_ok``).
"""

from __future__ import annotations

from typing import Any

from mqds.protocol import errors, share_groups
from mqds.protocol.errors import MqdsError, Reason
from mqds.protocol.messages import check_message
from mqds.protocol.sharding import shard_of
from mqds.protocol.topics import MAX_TOPIC_BYTES
from mqds.server.api import consumers, deliver, shared_fetch
from mqds.server.api.follow_registry import FollowCalls
from mqds.server.api.shards_api import Shards, ShardsAPI, now_us
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.storage.expiry import NEVER
from mqds.server.storage.sessions import FetchFilter
from mqds.server.wire import (
    FETCH_MESSAGES_RESPONSE_MESSAGES_TAG,
    encode_messages,
    message_unknown_field,
    repeated_field,
    unknown_field_text,
)
from mqds.v1 import sessions_pb2 as spb

_U64_MAX = (1 << 64) - 1


def check_clientid(clientid: str) -> str:
    """A clientid as MQTT allows it (non-empty here, since mqds keys state by it)."""
    if not clientid:
        raise errors.error(Reason.INVALID_CLIENTID, "clientid is empty; state is kept per clientid")
    if len(clientid) > 16383 and len(clientid.encode("utf-8")) > MAX_TOPIC_BYTES:
        raise errors.error(Reason.INVALID_CLIENTID, f"clientid is over {MAX_TOPIC_BYTES:,} bytes")
    if "\x00" in clientid:
        raise errors.error(Reason.INVALID_CLIENTID, f"clientid {clientid!r} contains NUL, which MQTT forbids")
    return clientid


def _check_node(node: str, required: bool) -> None:
    if required and not node:
        raise errors.error(Reason.INVALID_REQUEST, "node is empty: name the broker node the client connected to")
    if len(node.encode("utf-8")) > MAX_TOPIC_BYTES:
        raise errors.error(Reason.INVALID_REQUEST, f"node name is over {MAX_TOPIC_BYTES:,} bytes")


def _check_qos(qos: int, what: str) -> None:
    if qos > 2:
        raise errors.error(Reason.INVALID_REQUEST, f"{what} qos must be 0, 1 or 2, got {qos}")


class SessionService(ShardsAPI):
    """Implements mqds.v1.Sessions over the vnodes of one node."""

    def __init__(
        self,
        shards: Shards,
        *,
        max_payload_bytes: int,
        max_fetch: int,
        max_answer_bytes: int | None = None,
        max_entry_bytes: int | None = None,
        clock: Any = now_us,
        session_expiry_default_s: int = NEVER,
        follow_calls: FollowCalls | None = None,
    ) -> None:
        super().__init__(shards, max_answer_bytes=max_answer_bytes, max_entry_bytes=max_entry_bytes)
        self.max_payload_bytes = max_payload_bytes
        self.max_fetch = max_fetch
        self.clock = clock
        self.session_expiry_default_s = session_expiry_default_s
        """The session expiry interval of a client that reported none (MQTT 3.1.1), logged with its connect."""
        self.follow_calls = follow_calls if follow_calls is not None else FollowCalls()
        """The node's open Follow calls: ListConsumers lists them (the storage service registers them)."""

    def _log(self, shard: int, **change: Any) -> Any:
        """Log one session change in ``shard``'s group (on its leader); the result of applying it."""
        command = cpb.VnodeCommand(session=cpb.SessionCommand(now_us=self.clock(), **change))
        (result,) = self._propose_all([(shard, command.SerializeToString())])
        return result

    def _client_shard(self, clientid: str) -> int:
        return shard_of(check_clientid(clientid), self.shards.n_shards)

    def _one(self, shard: int, stale_ok: bool) -> Any:
        (vnode,) = self._read([shard], stale_ok)
        return vnode

    # -- client state ---------------------------------------------------------

    @staticmethod
    def _state(state: spb.ClientState | None) -> spb.ClientStateResponse:
        return spb.ClientStateResponse(found=True, state=state) if state is not None else spb.ClientStateResponse()

    def ClientConnected(self, request: spb.ClientConnectedRequest) -> spb.ClientStateResponse:
        shard = self._client_shard(request.clientid)
        _check_node(request.node, required=True)
        if not request.HasField("session_expiry_s"):
            # Logged with the command: every replica keeps the interval this node's settings gave.
            request.session_expiry_s = self.session_expiry_default_s
        return self._state(self._log(shard, connected=request))

    def ClientDisconnected(self, request: spb.ClientDisconnectedRequest) -> spb.ClientStateResponse:
        shard = self._client_shard(request.clientid)
        _check_node(request.node, required=False)
        return self._state(self._log(shard, disconnected=request))

    def GetClientState(self, request: spb.GetClientStateRequest) -> spb.ClientStateResponse:
        vnode = self._one(self._client_shard(request.clientid), request.stale_ok)
        with vnode.replica.reading() as storage:
            return self._state(storage.sessions.client_state(request.clientid))

    def ClientsOnNode(self, request: spb.ClientsOnNodeRequest) -> spb.ClientsOnNodeResponse:
        _check_node(request.node, required=True)
        response = spb.ClientsOnNodeResponse()
        size = 0
        for vnode in self._read(self._shard_numbers(0, True, request.shards), request.stale_ok):
            with vnode.replica.reading() as storage:
                found = storage.sessions.clients_on_node(request.node)
            size += sum(len(clientid.encode("utf-8")) + 4 for clientid in found)
            self._check_answer(size, f"the clients on node {request.node!r}", "ask for fewer shards at a time (shards)")
            response.clientids.extend(found)
        return response

    # -- subscriptions --------------------------------------------------------

    def Subscribe(self, request: spb.SubscribeRequest) -> spb.SubscribeResponse:
        shard = self._client_shard(request.clientid)
        self._filter(request.topic_filter)
        _check_qos(request.qos, "subscription")
        self._log(shard, subscribe=request)
        return spb.SubscribeResponse()

    def Unsubscribe(self, request: spb.UnsubscribeRequest) -> spb.UnsubscribeResponse:
        shard = self._client_shard(request.clientid)
        self._filter(request.topic_filter)
        return spb.UnsubscribeResponse(existed=bool(self._log(shard, unsubscribe=request)))

    def GetSubscriptions(self, request: spb.GetSubscriptionsRequest) -> spb.GetSubscriptionsResponse:
        vnode = self._one(self._client_shard(request.clientid), request.stale_ok)
        with vnode.replica.reading() as storage:
            found = storage.sessions.subscriptions(request.clientid)
        self._check_answer(
            sum(len(topic_filter.encode("utf-8")) + 10 for topic_filter, _ in found),
            f"the subscriptions of {request.clientid!r}",
            "unsubscribe the client from filters it no longer needs",
        )
        response = spb.GetSubscriptionsResponse()
        for topic_filter, qos in found:
            response.subscriptions.add(topic_filter=topic_filter, qos=qos)
        return response

    # -- retained messages ----------------------------------------------------

    def Retain(self, request: spb.RetainRequest) -> spb.RetainResponse:
        m = message = request.message
        check_message("retained message", m.topic, m.payload, m.sender, m.qos, m.properties, self.max_payload_bytes)
        unknown = message_unknown_field(0, message)
        if unknown is not None:  # kept as it came, it would reach readers as it came
            raise errors.error(Reason.INVALID_MESSAGE, f"retained message: {unknown_field_text(unknown)}")
        message.ClearField("timestamp_us")
        message.ClearField("shard")
        stored = self._log(shard_of(message.topic, self.shards.n_shards), retain=message)
        return spb.RetainResponse(message=stored) if stored is not None else spb.RetainResponse()

    def GetRetained(self, request: spb.GetRetainedRequest) -> bytes:
        levels = self._filter(request.topic_filter)
        found: list[bytes] = []
        size = 0
        now = self.clock()  # expired retained messages are left out, removed yet or not
        for vnode in self._read(self._shard_numbers(0, True, request.shards), request.stale_ok):
            with vnode.replica.reading() as storage:
                retained = storage.sessions.retained(levels, now)
            size += sum(len(message) + 6 for message in retained)
            self._check_answer(
                size,
                f"the retained messages matching {request.topic_filter!r}",
                "ask for fewer shards at a time (shards) or a narrower topic filter",
            )
            found.extend(retained)
        return repeated_field(FETCH_MESSAGES_RESPONSE_MESSAGES_TAG, found)

    # -- offline delivery -----------------------------------------------------

    def GetReadPosition(self, request: spb.GetReadPositionRequest) -> spb.GetReadPositionResponse:
        shard = self._client_shard(request.clientid)
        self._filter(request.topic_filter)
        vnode = self._one(shard, request.stale_ok)
        with vnode.replica.reading() as storage:
            position = storage.sessions.read_position(request.clientid, request.topic_filter)
        if position is None:
            return spb.GetReadPositionResponse()
        return spb.GetReadPositionResponse(found=True, position=position)

    def GetReadPositions(self, request: spb.ReadPositionsRequest) -> spb.ReadPositionsResponse:
        return self._positions(request, start=False)

    def StartReadPositions(self, request: spb.ReadPositionsRequest) -> spb.ReadPositionsResponse:
        return self._positions(request, start=True)

    def _positions(self, request: spb.ReadPositionsRequest, *, start: bool) -> spb.ReadPositionsResponse:
        """The read positions of many pairs, each read in its clientid's shard; ``start``: start the missing ones."""
        pairs = request.pairs
        shared_fetch.check_not_empty(len(pairs), "pairs")
        homes: list[int] = []
        for i, pair in enumerate(pairs):
            try:
                homes.append(self._client_shard(pair.clientid))
            except MqdsError as err:
                raise errors.error(err.reason, f"pairs[{i}]: {err.message}") from None
            shared_fetch.check_filter(pair.topic_filter, f"pairs[{i}]")
        by_shard: dict[int, list[int]] = {}
        for i, shard in enumerate(homes):
            by_shard.setdefault(shard, []).append(i)
        positions: list[spb.ReadPosition | None] = [None] * len(pairs)
        for vnode in self._read(sorted(by_shard), request.stale_ok and not start):
            with vnode.replica.reading() as storage:
                for i in by_shard[vnode.shard]:
                    positions[i] = storage.sessions.read_position(pairs[i].clientid, pairs[i].topic_filter)
        started = [False] * len(pairs)
        if start:
            missing = [i for i, position in enumerate(positions) if position is None]
            now = self.clock()
            commands = [
                (
                    homes[i],
                    cpb.VnodeCommand(
                        session=cpb.SessionCommand(
                            now_us=now,
                            start_position=spb.StartReadPositionRequest(
                                clientid=pairs[i].clientid, topic_filter=pairs[i].topic_filter
                            ),
                        )
                    ).SerializeToString(),
                )
                for i in missing
            ]
            # One entry per new pair, proposed together: the groups log what arrives in a cycle at once.
            for i, (was_started, position) in zip(missing, self._propose_all(commands), strict=True):
                started[i], positions[i] = was_started, position
        response = spb.ReadPositionsResponse()
        for i, pair in enumerate(pairs):
            position = positions[i]
            entry = response.positions.add(
                clientid=pair.clientid, topic_filter=pair.topic_filter, found=position is not None, started=started[i]
            )
            if position is not None:
                entry.position.CopyFrom(position)
        self._check_answer(
            response.ByteSize(), f"the read positions of {len(pairs):,} pairs", "ask for fewer pairs at a time"
        )
        return response

    def FetchMessagesShared(self, request: spb.FetchMessagesSharedRequest) -> bytes:
        return shared_fetch.serve(self, request)

    def FetchMessages(self, request: spb.FetchMessagesRequest) -> bytes:
        self._filter(request.topic_filter)
        if request.max_count < 1:
            raise errors.error(Reason.INVALID_REQUEST, f"max_count must be at least 1, got {request.max_count}")
        max_count = min(request.max_count, self.max_fetch)
        now = self.clock()
        since = max(0, now - request.time_range_us) if request.time_range_us else 0
        numbers = self._shard_numbers(0, True, request.shards)
        self._shard_numbers(0, False, list(request.after_us), field="after_us")
        found: list[tuple[int, int, bytes]] = []
        for vnode in self._read(numbers, request.stale_ok):
            after = max(request.after_us.get(vnode.shard, 0), request.after_all_us)
            if after >= _U64_MAX:
                continue  # no timestamp comes after it
            wanted = FetchFilter(
                topic_filter=request.topic_filter,
                after_us=after,
                since_us=since,
                max_count=max_count,
                include_qos0=request.include_qos0,
                skip_acked=request.skip_acked,
                # Each shard's oldest messages up to the answer's budget: the
                # answer below (the oldest of all, within the same budget) is
                # always among them, and the node never holds much more.
                max_bytes=self.max_answer_bytes,
            )
            with vnode.replica.reading() as storage:
                found.extend((ts, vnode.shard, stored) for ts, stored in storage.sessions.fetch(wanted, now_us=now))
        found.sort(key=lambda entry: (entry[0], entry[1]))
        # Oldest first, up to max_answer_bytes (one message at least): the
        # reader continues after the last one (after_us), as after max_count.
        budget = self.max_answer_bytes
        parts: list[bytes] = []
        for ts, shard, stored in found[:max_count]:
            part = encode_messages(FETCH_MESSAGES_RESPONSE_MESSAGES_TAG, [(ts, stored)], shard)
            if budget is not None:
                if parts and len(part) > budget:
                    break
                budget -= len(part)
            parts.append(part)
        return b"".join(parts)

    def Ack(self, request: spb.AckRequest) -> spb.AckResponse:
        self._filter(request.topic_filter)
        if request.mode not in (spb.PUBSUB, spb.QUEUE, spb.DELIVERY, spb.NACK, spb.RELEASE):
            raise errors.error(
                Reason.INVALID_REQUEST,
                f"mode {request.mode} is none of PUBSUB (0), QUEUE (1), DELIVERY (2), NACK (3) and RELEASE (4)",
            )
        if request.timestamp_us < 1:
            raise errors.error(
                Reason.INVALID_REQUEST, "timestamp_us is 0: acknowledge a message as fetched, with its position"
            )
        (message_shard,) = self._shard_numbers(request.shard, False)
        if request.mode != spb.PUBSUB:  # kept in the message's shard
            check_clientid(request.clientid)
            self._log(message_shard, ack=request)
        else:
            self._log(self._client_shard(request.clientid), ack=request)
        return spb.AckResponse()

    def ForgetReadPosition(self, request: spb.ForgetReadPositionRequest) -> spb.ForgetReadPositionResponse:
        shard = self._client_shard(request.clientid)
        self._filter(request.topic_filter)
        return spb.ForgetReadPositionResponse(existed=bool(self._log(shard, forget_position=request)))

    def StartReadPosition(self, request: spb.StartReadPositionRequest) -> spb.StartReadPositionResponse:
        shard = self._client_shard(request.clientid)
        self._filter(request.topic_filter)
        # A pair that has a position (a reconnect, a re-subscribe) costs a read, not a Raft write.
        with self._one(shard, False).replica.reading() as storage:
            position = storage.sessions.read_position(request.clientid, request.topic_filter)
        if position is not None:
            return spb.StartReadPositionResponse(started=False, position=position)
        started, position = self._log(shard, start_position=request)
        return spb.StartReadPositionResponse(started=started, position=position)

    def ForgetSession(self, request: spb.ForgetSessionRequest) -> spb.ForgetSessionResponse:
        subscriptions, positions = self._log(self._client_shard(request.clientid), forget_session=request)
        return spb.ForgetSessionResponse(subscriptions=subscriptions, read_positions=positions)

    # -- shared subscriptions -----------------------------------------------------

    def _share_group(self, request: spb.ShareGroupRequest, change: str) -> spb.ShareGroupResponse:
        share_groups.check(request.group, request.topic_filter, request.member, request.lease_s or 1)
        pseudo = share_groups.position_client(request.group)
        members = self._log(shard_of(pseudo, self.shards.n_shards), **{change: request})
        mine = share_groups.assign(members, self.shards.n_shards).get(request.member, [])
        return spb.ShareGroupResponse(members=members, shards=mine, position_clientid=pseudo)

    def JoinShareGroup(self, request: spb.ShareGroupRequest) -> spb.ShareGroupResponse:
        if not request.lease_s:
            raise errors.error(Reason.INVALID_REQUEST, "lease_s is 0: a member joins for 1 to 3600 seconds")
        return self._share_group(request, "share_join")

    def LeaveShareGroup(self, request: spb.ShareGroupRequest) -> spb.ShareGroupResponse:
        return self._share_group(request, "share_leave")

    # -- redelivery -----------------------------------------------------------------

    def Deliver(self, request: spb.DeliverRequest) -> bytes:
        check_clientid(request.clientid)
        return deliver.serve(self, request)

    # -- inspecting consumers -------------------------------------------------------

    def ListConsumers(self, request: spb.ListConsumersRequest) -> spb.ListConsumersResponse:
        return consumers.list_consumers(self, self.follow_calls, request, self.clock)

    def ConsumerLag(self, request: spb.ConsumerLagRequest) -> spb.ConsumerLagResponse:
        return consumers.consumer_lag(self, request, self.clock)
