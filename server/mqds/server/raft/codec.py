"""pysyncobj's Raft messages as protobuf, and the restricted decoder for what peers send.

pysyncobj hands its transport plain dicts (``{'type': 'append_entries', ...}``)
and would pickle them on the wire. Here each one becomes a
``mqds.server.raft.v1.RaftMessage``; decoding builds the dict back from the
protobuf fields alone, so bytes from the network can only ever become
numbers, booleans and byte strings. On top of that every log entry's command
is checked: a regular entry or a no-op passes as it is, a membership change
must be a well-formed ``MembershipChange`` (pysyncobj would unpickle it),
and anything else (pysyncobj's pickled code-version switch, an unknown type)
is refused. A refused message raises :class:`MalformedMessage`; the transport
drops it and counts it.

>>> msg = {"type": "request_vote", "term": 3, "last_log_index": 10, "last_log_term": 2}
>>> decode(encode(msg)) == {**msg, "transfer": False}
True
>>> decode(b"\\xff\\xff")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
mqds.server.raft.codec.MalformedMessage: not a RaftMessage: Error parsing message...
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import DecodeError

from mqds.protocol.wire import varint
from mqds.server.raft import batching
from mqds.server.raft.v1 import raft_pb2 as rpb
from mqds.server.wire import APPEND_ENTRIES_ENTRIES_TAG, ENTRY_COMMAND_TAG, RAFT_MESSAGE_APPEND_ENTRIES_TAG

# pysyncobj's command types (the first byte of every log entry).
COMMAND_REGULAR = 0
COMMAND_NO_OP = 1
COMMAND_MEMBERSHIP = 2
# 3 is pysyncobj's (pickled) code-version switch, which mqds refuses.
COMMAND_BATCH = 4

# Append-entries carrying at least this many bytes of commands are framed by
# hand (``_encode_append_entries``); protobuf is a little faster below.
_FRAME_BY_HAND_BYTES = 64 * 1024

# Largest index, term or request id a peer may send (they are Python ints
# inside pysyncobj; this keeps them sane).
_MAX_U63 = (1 << 63) - 1


class MalformedMessage(ValueError):
    """A message from a peer that is not a valid Raft message; it is dropped."""


def encode_membership(kind: int, node_id: str) -> bytes:
    """The body of a membership-change entry (without the type byte)."""
    return rpb.MembershipChange(kind=kind, node_id=node_id).SerializeToString()  # type: ignore[arg-type]


def decode_membership(body: bytes) -> tuple[str, str]:
    """A membership-change body as pysyncobj's request: ``('add' | 'rem', node_id)``."""
    try:
        change = rpb.MembershipChange.FromString(body)
    except (DecodeError, RuntimeError) as err:
        raise MalformedMessage(f"membership change does not parse: {err}") from None
    if change.kind == rpb.MembershipChange.KIND_ADD:
        op = "add"
    elif change.kind == rpb.MembershipChange.KIND_REMOVE:
        op = "rem"
    else:
        raise MalformedMessage(f"membership change of unknown kind {change.kind}")
    if not change.node_id:
        raise MalformedMessage("membership change without a node id")
    return op, change.node_id


def check_command(command: bytes) -> None:
    """Refuse a log entry command that pysyncobj would unpickle or does not know."""
    if not command:
        raise MalformedMessage("empty log entry command")
    kind = command[0]
    if kind == COMMAND_MEMBERSHIP:
        decode_membership(command[1:])
    elif kind == COMMAND_NO_OP:
        if len(command) != 1:
            raise MalformedMessage("no-op entry with a body")
    elif kind == COMMAND_BATCH:
        try:
            batching.check(memoryview(command)[1:])  # a slice would copy the whole batch
        except DecodeError as err:
            raise MalformedMessage(f"batch entry that is not a CommandBatch: {err}") from None
    elif kind != COMMAND_REGULAR:
        raise MalformedMessage(f"log entry of command type {kind}, which mqds does not use")


def _int(value: int, what: str) -> int:
    if value > _MAX_U63:
        raise MalformedMessage(f"{what} {value} is out of range")
    return value


def _entries(entries: list[tuple[bytes, int, int]]) -> list[rpb.Entry]:
    return [rpb.Entry(command=cmd, index=idx, term=term) for cmd, idx, term in entries]


def encode_message(message: dict[str, Any], echo: int = 0, sequence: int = 0) -> rpb.RaftMessage:
    """A pysyncobj message dict as a RaftMessage; ValueError for ones mqds never sends."""
    kind = message["type"]
    out = rpb.RaftMessage(echo=echo, sequence=sequence)
    if kind == "append_entries":
        if "transmission" in message:
            # pysyncobj pickles an entry larger than appendEntriesBatchSizeBytes
            # into chunks; the node configures that size above any entry.
            raise ValueError("chunked append_entries (a pickled entry) cannot be sent")
        if "serialized" in message:
            data = message["serialized"]
            snap = out.install_snapshot
            snap.term = message["term"]
            snap.commit_index = message["commit_index"]
            if data is not None and data is not False:
                chunk, is_first, is_last = data
                snap.has_data = True
                snap.data = chunk if isinstance(chunk, bytes) else bytes(chunk)
                snap.is_first = bool(is_first)
                snap.is_last = bool(is_last)
            return out
        ae = out.append_entries
        ae.term = message["term"]
        ae.commit_index = message["commit_index"]
        ae.prev_log_index = message["prevLogIdx"]
        ae.prev_log_term = message["prevLogTerm"]
        ae.entries.extend(_entries(message.get("entries", [])))
    elif kind == "request_vote":
        out.request_vote.CopyFrom(
            rpb.RequestVote(
                term=message["term"],
                last_log_index=message["last_log_index"],
                last_log_term=message["last_log_term"],
                transfer=bool(message.get("transfer", False)),
            )
        )
    elif kind == "response_vote":
        out.response_vote.term = message["term"]
    elif kind == "next_node_idx":
        out.next_index.CopyFrom(
            rpb.NextIndex(
                next_index=message["next_node_idx"],
                reset=bool(message["reset"]),
                success=bool(message["success"]),
                declines_leadership=bool(message.get("declines_leadership", False)),
            )
        )
    elif kind == "apply_command":
        cmd = out.apply_command
        cmd.command = message["command"]
        if "request_id" in message:
            cmd.request_id = message["request_id"]
            cmd.has_request_id = True
    elif kind == "apply_command_response":
        resp = out.apply_command_response
        resp.request_id = message["request_id"]
        if message.get("error") is not None:
            resp.error = message["error"]
        else:
            resp.log_index = message["log_idx"]
            resp.log_term = message["log_term"]
    elif kind == "timeout_now":
        out.timeout_now.term = message["term"]
    else:
        raise ValueError(f"pysyncobj message type {kind!r} is not part of the mqds Raft protocol")
    return out


def command_bytes(message: dict[str, Any]) -> int:
    """The bytes of the commands an append-entries carries (0 for any other message)."""
    return sum(len(entry[0]) for entry in message.get("entries") or ())


def encode(message: dict[str, Any], echo: int = 0, sequence: int = 0) -> bytes:
    """A pysyncobj message dict as a serialised RaftMessage; ValueError for ones mqds never sends."""
    if message["type"] == "append_entries" and command_bytes(message) >= _FRAME_BY_HAND_BYTES:
        return _encode_append_entries(message, echo, sequence)  # a chunked one ("transmission") carries no entries
    return encode_message(message, echo, sequence).SerializeToString()


def _encode_append_entries(message: dict[str, Any], echo: int, sequence: int = 0) -> bytes:
    """The same bytes as ``encode_message(...).SerializeToString()``, each command copied once.

    Protobuf copies a command three times on the way (into its ``Entry``, into
    the repeated field, out to bytes); for a batch of tens of MiB that kept
    the leader's Raft thread from its heartbeats for longer than an election
    timeout. Here protobuf serialises everything but the commands, which are
    framed by hand (``Entry.command`` is field 1, ``AppendEntries.entries``
    field 5, ``RaftMessage.append_entries`` field 3: the canonical field
    order is kept) and joined once.
    """
    parts: list[bytes] = [
        b"",  # RaftMessage.append_entries' tag and length, known at the end
        rpb.AppendEntries(
            term=message["term"],
            commit_index=message["commit_index"],
            prev_log_index=message["prevLogIdx"],
            prev_log_term=message["prevLogTerm"],
        ).SerializeToString(),
    ]
    size = len(parts[1])
    for command, index, term in message["entries"]:
        command_head = ENTRY_COMMAND_TAG + varint(len(command)) if command else b""
        rest = rpb.Entry(index=index, term=term).SerializeToString()
        entry_size = len(command_head) + len(command) + len(rest)
        entry_head = APPEND_ENTRIES_ENTRIES_TAG + varint(entry_size)
        parts += (entry_head, command_head, command, rest)
        size += len(entry_head) + entry_size
    parts[0] = RAFT_MESSAGE_APPEND_ENTRIES_TAG + varint(size)
    if echo or sequence:
        parts.append(rpb.RaftMessage(echo=echo, sequence=sequence).SerializeToString())  # fields 14, 15: last
    return b"".join(parts)


def decode(raw: bytes) -> dict[str, Any]:
    try:
        parsed = rpb.RaftMessage.FromString(raw)
    except (DecodeError, RuntimeError) as err:
        raise MalformedMessage(f"not a RaftMessage: {err}") from None
    return decode_message(parsed)


def decode_message(msg: rpb.RaftMessage) -> dict[str, Any]:
    """The pysyncobj dict for a RaftMessage from a peer; MalformedMessage when it breaks a rule."""
    kind = msg.WhichOneof("kind")
    if kind == "append_entries":
        ae = msg.append_entries
        entries = []
        previous = ae.prev_log_index
        for entry in ae.entries:
            if entry.index != previous + 1:
                raise MalformedMessage(f"entry index {entry.index} does not follow {previous}")
            check_command(entry.command)
            entries.append((entry.command, _int(entry.index, "entry index"), _int(entry.term, "entry term")))
            previous = entry.index
        return {
            "type": "append_entries",
            "term": _int(ae.term, "term"),
            "commit_index": _int(ae.commit_index, "commit index"),
            "prevLogIdx": _int(ae.prev_log_index, "previous log index"),
            "prevLogTerm": _int(ae.prev_log_term, "previous log term"),
            "entries": entries,
        }
    if kind == "install_snapshot":
        snap = msg.install_snapshot
        data = (snap.data, snap.is_first, snap.is_last) if snap.has_data else None
        return {
            "type": "append_entries",
            "term": _int(snap.term, "term"),
            "commit_index": _int(snap.commit_index, "commit index"),
            "serialized": data,
        }
    if kind == "request_vote":
        rv = msg.request_vote
        return {
            "type": "request_vote",
            "term": _int(rv.term, "term"),
            "last_log_index": _int(rv.last_log_index, "last log index"),
            "last_log_term": _int(rv.last_log_term, "last log term"),
            "transfer": rv.transfer,
        }
    if kind == "response_vote":
        return {"type": "response_vote", "term": _int(msg.response_vote.term, "term")}
    if kind == "next_index":
        ni = msg.next_index
        if ni.next_index < 1:
            raise MalformedMessage("next index 0")
        answer = {
            "type": "next_node_idx",
            "next_node_idx": _int(ni.next_index, "next index"),
            "reset": ni.reset,
            "success": ni.success,
        }
        if ni.declines_leadership:
            answer["declines_leadership"] = True
        return answer
    if kind == "apply_command":
        ac = msg.apply_command
        check_command(ac.command)
        out: dict[str, Any] = {"type": "apply_command", "command": ac.command}
        if ac.has_request_id:
            out["request_id"] = _int(ac.request_id, "request id")
        return out
    if kind == "apply_command_response":
        acr = msg.apply_command_response
        resp: dict[str, Any] = {"type": "apply_command_response", "request_id": _int(acr.request_id, "request id")}
        if acr.error:
            if acr.error > 7:
                raise MalformedMessage(f"unknown failure reason {acr.error}")
            resp["error"] = acr.error
        else:
            resp["log_idx"] = _int(acr.log_index, "log index")
            resp["log_term"] = _int(acr.log_term, "log term")
        return resp
    if kind == "timeout_now":
        return {"type": "timeout_now", "term": _int(msg.timeout_now.term, "term")}
    raise MalformedMessage("empty RaftMessage")
