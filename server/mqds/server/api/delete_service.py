"""Storage.DeleteMessages: a delete's request checked, then its steps logged on the shard's leader.

The storage layer deletes one bounded step at a time (``storage/deletes.py``);
this handler logs steps on the shard's Raft group, each from the cursor the
one before returned, until the delete is done or the call's time is nearly
spent, and answers what they deleted. A call that stops early answers a
cursor, and the client calls again with it (on this node or, after a
failover, on the new leader: the cursor is the whole state of the delete, and
a step applied twice deletes nothing more).

Deletes are never refused for a full disk (``cluster/growth.py`` classes a
delete step as adding nothing): they are how space comes back.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from mqds.protocol import errors
from mqds.protocol.deletes import check_delete
from mqds.protocol.errors import MqdsError, Reason
from mqds.protocol.sharding import shard_of
from mqds.server.auth import time_left
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.storage.deletes import STEP_KEYS, StepResult
from mqds.v1 import storage_pb2 as pb

if TYPE_CHECKING:
    from mqds.server.api.shards_api import Shards

log = logging.getLogger(__name__)

CALL_MAX_S = 10.0
"""A call logs steps for at most this long, then answers with a cursor (the client calls again)."""


def check_request(request: pb.DeleteMessagesRequest, n_shards: int) -> None:
    """Refuse a request that is malformed, names the wrong shard, or would delete everything unconfirmed."""
    until = request.cursor.until_us if request.HasField("cursor") else request.until_us
    check_delete(request.topic_filter, request.sender, request.since_us, until, request.confirm_all)
    if not 0 <= request.shard < n_shards:
        raise errors.error(
            Reason.UNKNOWN_SHARD, f"shard {request.shard} does not exist; shards are 0 to {n_shards - 1}"
        )
    home = shard_of(request.sender, n_shards) if request.sender else request.shard
    if home != request.shard:
        raise errors.error(
            Reason.INVALID_REQUEST,
            f"sender {request.sender!r} stores its messages in shard {home}, not shard {request.shard}",
        )


def step_command(request: pb.DeleteMessagesRequest, cursor: pb.DeleteCursor | None) -> bytes:
    """The logged command of the step that starts at ``cursor`` (None: the delete's first step)."""
    cmd = cpb.DeleteMessages(
        topic_filter=request.topic_filter,
        sender=request.sender,
        since_us=request.since_us,
        until_us=cursor.until_us if cursor is not None else request.until_us,
        max_keys=STEP_KEYS,
    )
    if cursor is not None:
        cmd.cursor.CopyFrom(cursor)
    return cpb.VnodeCommand(delete_messages=cmd).SerializeToString()


def delete_messages(shards: Shards, request: pb.DeleteMessagesRequest) -> pb.DeleteMessagesResponse:
    """Log steps of the delete on the shard's leader until it is done or the call's time runs short."""
    check_request(request, shards.n_shards)
    cursor = request.cursor if request.HasField("cursor") else None
    response = pb.DeleteMessagesResponse(shard=request.shard, until_us=cursor.until_us if cursor else request.until_us)
    started = time.monotonic()
    budget = time_left(CALL_MAX_S)
    longest = 0.0
    while True:
        vnode = shards.leader_vnode(request.shard)
        began = time.monotonic()
        timeout = time_left(shards.write_timeout_s)
        try:
            result: StepResult = vnode.group.propose(step_command(request, cursor)).wait(timeout)
        except MqdsError:
            if response.steps:  # what was done stays done: answer it, with where to go on
                break
            raise
        longest = max(longest, time.monotonic() - began)
        response.steps += 1
        response.deleted_messages += result.messages
        response.deleted_index_keys += result.index_keys
        response.scanned_keys += result.scanned
        response.until_us = result.until_us
        if result.cursor is None:
            response.ClearField("cursor")
            break
        cursor = result.cursor.message(result.until_us)
        response.cursor.CopyFrom(cursor)
        if request.max_steps and response.steps >= request.max_steps:
            break
        if time.monotonic() - started + 2 * longest + 0.2 > budget:
            break
    if response.deleted_messages:
        log.info(
            "shard %d: deleted %d messages (filter %r, sender %r, %d steps%s)",
            request.shard,
            response.deleted_messages,
            request.topic_filter,
            request.sender,
            response.steps,
            ", more to do" if response.HasField("cursor") else "",
        )
    return response
