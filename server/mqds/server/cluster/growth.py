"""Which vnode commands add data to a shard: what a node past its disk quota refuses to log (``diskusage.py``).

Admission is decided where every command is proposed (``RaftGroup.admit``,
wired by ``node/hosting.py``), by what the command does, not by which call made
it: a new kind of write is covered without its handler knowing of quotas.
While the node's disk is past a limit, a leader logs no command that adds
data, and every command that removes data or updates a record that is
there already, so the node can always recover, and a broker keeps serving
the clients it has:

==========================================  ========================================================
refused (STORAGE_FULL)                      always logged
==========================================  ========================================================
store (new messages)                        delete and retention steps, dropping a generation,
                                            adding one (retention's rotation)
retain with a payload                       retain with an empty payload (clears the message)
subscribe to a filter the client has not    subscribe again to a filter it has (its QoS), unsubscribe
connect of a client the shard does not      connect of a known client, disconnect, forget session,
know                                        session and retained-message expiry
start a read position, or an ack that       an ack of an existing position, a queue ack (moves the
creates one                                 queue floor), forget a read position
a new member joining a share group          a member renewing its lease, leaving
a restore's begin and records               a restore's finish and abandon
==========================================  ========================================================

Whether a record is there is read from the leader's replica: an answer a
moment old at worst, which only decides whether a small update is taken.
Followers apply everything their leader commits; admission is the leader's
alone.
"""

from __future__ import annotations

from collections.abc import Callable

from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.storage import keys
from mqds.server.wire import VNODE_COMMAND_STORE_TAG
from mqds.v1 import sessions_pb2 as spb

Exists = Callable[[bytes], bool]
"""Whether the shard's metadata family holds a key (on the leader's replica)."""


def adds(body: bytes, exists: Exists) -> str | None:
    """What the command ``body`` would add to the shard, for the refusal's message; None when it adds nothing.

    A store is known by its first byte (it may hold a thousand messages:
    never decoded here); the rest are small, or a restore's records, and
    decoded only while the node refuses.
    """
    if body[:1] == VNODE_COMMAND_STORE_TAG:  # the first byte of every store command
        return "new messages"
    try:
        cmd = cpb.VnodeCommand.FromString(body)
    except Exception:  # DecodeError, or a RuntimeError from upb: the apply refuses it, alike everywhere
        return None
    kind = cmd.WhichOneof("kind")
    if kind == "session":
        return _session(cmd.session, exists)
    if kind == "import_shard":
        step = cmd.import_shard.WhichOneof("kind")
        return {"begin": "a restore", "records": "a restore's records"}.get(step or "")
    return None  # a generation added or dropped, a delete or retention step


def _session(cmd: cpb.SessionCommand, exists: Exists) -> str | None:
    kind = cmd.WhichOneof("kind")
    if kind == "retain":
        return "a retained message" if cmd.retain.payload else None
    if kind == "connected":
        c = cmd.connected
        return None if exists(keys.client_key(c.clientid)) else f"the state of a new client ({c.clientid!r})"
    if kind == "subscribe":
        s = cmd.subscribe
        key = keys.subscriptions_prefix(s.clientid) + s.topic_filter.encode("utf-8")
        return None if exists(key) else f"a new subscription ({s.clientid!r} to {s.topic_filter!r})"
    if kind == "start_position":
        p = cmd.start_position
        return _position(p.clientid, p.topic_filter, exists)
    if kind == "ack" and cmd.ack.mode != spb.QUEUE:
        return _position(cmd.ack.clientid, cmd.ack.topic_filter, exists)
    if kind == "share_join":
        j = cmd.share_join
        key = keys.share_group_prefix(j.group, j.topic_filter) + j.member.encode("utf-8")
        return None if exists(key) else f"a new member of share group {j.group!r}"
    return None  # disconnected, unsubscribe, forget_position, forget_session, expire, share_leave, a queue ack


def _position(clientid: str, topic_filter: str, exists: Exists) -> str | None:
    if exists(keys.position_key(clientid, topic_filter)):
        return None
    return f"a new read position ({clientid!r} on {topic_filter!r})"
