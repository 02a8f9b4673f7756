"""The outbox: how a group's outgoing messages are encoded, held and batched.

pysyncobj hands every message it produces to a transport at once. Ours
(:class:`GroupTransport`) only encodes it and keeps it: the cycle's messages go
to the router (:class:`Outbox`) after ``journal.sync()`` (a leader's
append-entries before it), so nothing leaves the node before what it
acknowledges is on disk; a pass hands over every group's at once, and the
router sends each peer one frame for them (``cycles.py``). Each message
is also marked lazy or not here, which is what lets the peer's link batch
heartbeats of several groups into one frame (see DESIGN.md, "Heartbeats wait
for company"). The router itself is ``transport.py``.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, Protocol

from pysyncobj.node import Node
from pysyncobj.transport import Transport

from mqds.server.raft import codec

log = logging.getLogger(__name__)


def carries_entries(message: dict[str, Any]) -> bool:
    """Whether an append-entries carries log entries or a snapshot (not just a heartbeat)."""
    return bool(message.get("entries")) or "serialized" in message or "transmission" in message


class Outgoing(NamedTuple):
    """An encoded message for one peer, once it may leave the node."""

    node_id: str
    raw: bytes
    lazy: bool
    """Nobody waits for it: it may wait a little to share a frame (see ``GroupTransport.send``)."""


Sends = list[tuple[int, list[Outgoing]]]
"""What one or more groups' cycles send: (the group's number, its messages), in order."""


class Outbox(Protocol):
    """Where a group's messages go once they may leave the node (the router)."""

    def send(self, sends: Sends) -> None:
        """Send the messages of one or more groups' cycles: what is for one peer leaves in one frame."""
        ...

    def is_connected(self, node_id: str) -> bool: ...

    def address_of(self, node_id: str) -> str | None: ...


class Sender(Protocol):
    """What the transport reads from its group (``RaftGroup``) to encode and classify a message."""

    @property
    def name(self) -> str: ...

    @property
    def echo_round(self) -> int: ...

    @property
    def last_echo_from(self) -> dict[str, int]: ...

    @property
    def declines_leadership(self) -> bool: ...

    def sent_entries(self, node_id: str, entry_bytes: int) -> None: ...

    def on_member_added(self, node_id: str) -> None: ...


class GroupTransport(Transport):
    """pysyncobj's transport for one group: encodes and holds messages until the group's cycle ends."""

    def __init__(self, group: Sender) -> None:
        super().__init__(None, None, None)
        self._group = group
        self.outbox: list[Outgoing] = []
        self.answering_entries = False
        """Set while the group handles an append-entries that carries entries (its answer is never lazy)."""
        # Per peer: the (term, read round) of the last append-entries sent,
        # and the (next index, read round, declines) of the last answer.
        self._last_beat: dict[str, tuple[int, int]] = {}
        self._last_answer: dict[str, tuple[int, int, bool]] = {}
        self._sequence: dict[str, int] = {}
        """Per peer: the number of the last append-entries sent (``RaftMessage.sequence``)."""

    def send(self, node: Node, message: dict[str, Any]) -> bool:
        """Encode a message for ``node``, and say whether anybody waits for it.

        Lazy (it may wait up to ``raft_heartbeat_linger_s`` in the peer's link
        to share a frame): a leader's heartbeat (no entries, no snapshot) in a
        term and read round it already sent this peer, and a follower's
        answer to a heartbeat that repeats its last answer. A commit waits
        for answers to entries, a read for a new round's echo, an election for
        votes, a new leader for its first heartbeat: those leave at once, and
        take whatever waits for the same peer with them. A lazy heartbeat
        still resets the follower's election timer within the linger, and
        tells it the commit index a little later; nothing else changes.
        """
        group = self._group
        kind = message["type"]
        lazy = False
        sequence = 0
        if kind == "append_entries":
            sequence = self._sequence[node.id] = self._sequence.get(node.id, 0) + 1
            echo = group.echo_round
            beat = (message["term"], echo)
            lazy = not carries_entries(message) and self._last_beat.get(node.id) == beat
            if sent := codec.command_bytes(message):
                group.sent_entries(node.id, sent)
            self._last_beat[node.id] = beat
        elif kind == "next_node_idx":
            echo = group.last_echo_from.get(node.id, 0)
            if group.declines_leadership:
                message = {**message, "declines_leadership": True}
            answer = (message["next_node_idx"], echo, bool(message.get("declines_leadership")))
            lazy = (
                not self.answering_entries
                and message["success"]
                and not message["reset"]
                and self._last_answer.get(node.id) == answer
            )
            self._last_answer[node.id] = answer
        else:
            echo = 0
        try:
            raw = codec.encode(message, echo, sequence)
        except ValueError:
            log.exception("%s: cannot send %s to %s", group.name, kind, node.id)
            return False
        self.outbox.append(Outgoing(node.id, raw, lazy))
        return True

    def addNode(self, node: Node) -> None:
        self._group.on_member_added(node.id)

    def dropNode(self, node: Node) -> None:
        pass
