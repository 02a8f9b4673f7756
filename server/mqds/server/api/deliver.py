"""Sessions.Deliver: a consumer's redeliveries and new messages, one logged step per shard.

The request is checked here (consumer, filter, policy, count, shards) and
nothing is logged while anything is wrong. Then each shard this node leads
gets one ``SessionCommand.deliver`` with the leader's clock, one after the
other: each step takes what is left of the call's ``max_count`` and answer
bytes, so the answer stays within both and holds exactly the deliveries the
steps recorded (a message recorded as delivered and left out of the answer
would only come back after its ack wait, counted once more). A step that fails
after others were logged (a leader lost meanwhile) ends the call with what they
delivered. What a step does in its shard is ``storage/deliveries.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from mqds.protocol import errors
from mqds.protocol.delivery import Policy
from mqds.protocol.errors import MqdsError, Reason
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.storage.deliveries import Delivered
from mqds.server.wire import FETCH_MESSAGES_RESPONSE_MESSAGES_TAG, encode_messages
from mqds.v1 import sessions_pb2 as spb


class _Service(Protocol):
    """What a Deliver call uses of the Sessions service (``session_service.SessionService``)."""

    shards: Any
    max_fetch: int
    max_answer_bytes: int | None

    def clock(self) -> int: ...

    def _filter(self, topic_filter: str) -> list[str]: ...

    def _shard_numbers(self, shard: int, all_if_empty: bool, shards: Sequence[int]) -> list[int]: ...

    def _propose_all(self, commands: list[tuple[int, bytes]]) -> list[Any]: ...


def check_policy(request: spb.DeliverRequest) -> Policy:
    """The request's policy, or INVALID_REQUEST (INVALID_TOPIC for the dead-letter topic) saying what is wrong."""
    if not request.HasField("policy"):
        raise errors.error(Reason.INVALID_REQUEST, "policy is missing: a consumer delivers with a delivery policy")
    p = request.policy
    return Policy.of(
        p.ack_wait_ms, p.max_deliveries, list(p.backoff_ms), p.max_unacked, p.dead_letter_topic, request.topic_filter
    )


def serve(api: _Service, request: spb.DeliverRequest) -> bytes:
    """Deliver in each of the request's shards (led here), in shard order, within the call's bounds."""
    api._filter(request.topic_filter)
    check_policy(request)
    if request.max_count < 1:
        raise errors.error(Reason.INVALID_REQUEST, f"max_count must be at least 1, got {request.max_count}")
    numbers = api._shard_numbers(0, True, request.shards)
    for shard in numbers:  # every shard led here (NOT_LEADER otherwise), before anything is logged
        api.shards.leader_vnode(shard)
    count_left = min(request.max_count, api.max_fetch)
    bytes_left = api.max_answer_bytes
    parts: list[bytes] = []
    answer = spb.DeliverResponse()
    for shard in numbers:
        if count_left == 0 or (bytes_left is not None and bytes_left <= 0):
            break
        step = spb.DeliverRequest()
        step.CopyFrom(request)
        step.ClearField("shards")
        step.max_count = count_left
        command = cpb.VnodeCommand(
            session=cpb.SessionCommand(
                now_us=api.clock(),
                deliver=cpb.Deliver(request=step, max_bytes=bytes_left or 0, strict_bytes=bool(parts)),
            )
        )
        try:
            (done,) = api._propose_all([(shard, command.SerializeToString())])
        except MqdsError:
            if shard == numbers[0]:
                raise
            # The steps before were logged: their deliveries are answered (lost, they would only come back after
            # their ack wait); this shard and the rest are delivered from by the consumer's next call.
            break
        assert isinstance(done, Delivered)
        for ts, stored, deliveries in done.messages:
            part = encode_messages(FETCH_MESSAGES_RESPONSE_MESSAGES_TAG, [(ts, stored)], shard)
            parts.append(part)
            answer.deliveries.append(deliveries)
            if bytes_left is not None:
                bytes_left -= len(stored)
        count_left -= len(done.messages)
        answer.dead_lettered += done.dead_lettered
        answer.unacked += done.unacked
    return b"".join(parts) + answer.SerializeToString()
