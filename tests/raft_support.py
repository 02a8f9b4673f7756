"""A Raft group in one process for the unit tests: a state machine that records, an outbox that decodes.

Drive a group by hand with ``group.deliver(...)`` and ``group._cycle()``; what it
sent is in ``outbox.sent`` (decoded) and ``outbox.lazy``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mqds.server.raft import codec
from mqds.server.raft.group import Outgoing, RaftGroup, RaftTiming
from mqds.server.raft.journal import NodeLog
from mqds.server.raft.scheduler import RaftScheduler


class Machine:
    """Applies what it is given and remembers it."""

    applied_index = 0

    def __init__(self) -> None:
        self.applied: list[tuple[int, bytes]] = []
        self.skipped: list[int] = []

    def apply(self, command: bytes, index: int) -> Any:
        self.applied.append((index, command))
        self.applied_index = index
        return index

    def skip(self, index: int) -> None:
        self.skipped.append(index)
        self.applied_index = index

    def snapshot(self) -> bytes:
        return b""

    def install(self, payload: bytes, index: int, source: str, members: list[str]) -> None:
        raise AssertionError("not used")


class Outbox:
    """Every message the group sent, decoded, and whether it was lazy."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, str, dict[str, Any]]] = []
        self.lazy: list[bool] = []

    def send(self, sends: list[tuple[int, list[Outgoing]]]) -> None:
        for group, messages in sends:
            self.sent.extend((group, node, codec.decode(raw)) for node, raw, _ in messages)
            self.lazy.extend(lazy for _, _, lazy in messages)

    def is_connected(self, node_id: str) -> bool:
        return True

    def address_of(self, node_id: str) -> str | None:
        return f"{node_id}:1"


def make_group(
    tmp_path: Path, members: list[str], scheduler: RaftScheduler | None = None
) -> tuple[RaftGroup, Machine, Outbox]:
    """Group 0 on n3 with ``members``, its log and manifest under ``tmp_path``; driven by hand unless ``scheduler``."""
    machine, outbox = Machine(), Outbox()
    log = NodeLog(str(tmp_path / "wal"))
    group = RaftGroup(
        0, "n3", members, machine, str(tmp_path / "g"), log.journal(0), outbox, RaftTiming(), scheduler=scheduler
    )
    return group, machine, outbox


HEARTBEAT = {"type": "append_entries", "term": 1, "commit_index": 1, "prevLogIdx": 1, "prevLogTerm": 0, "entries": []}


def follower(tmp_path: Path) -> tuple[RaftGroup, Outbox]:
    """n3 following n1 in term 1, connected to both peers."""
    group, _, outbox = make_group(tmp_path, ["n1", "n2", "n3"])
    for peer in ("n1", "n2"):
        group.peer_connected(peer, True)
    group.deliver("n1", HEARTBEAT, 0)
    group._cycle()
    return group, outbox


def leader(tmp_path: Path) -> tuple[RaftGroup, Outbox]:
    """n3 elected leader of term 1 by n1's vote."""
    group, _, outbox = make_group(tmp_path, ["n1", "n2", "n3"])
    for peer in ("n1", "n2"):
        group.peer_connected(peer, True)
    elect(group)
    return group, outbox


def elect(group: RaftGroup) -> None:
    """Make a new replica, connected to n1, campaign at once and win by n1's vote (driven by hand)."""
    group._timers._quiet_until = 0.0
    group.raft.election_deadline = 0
    group._cycle()
    group.deliver("n1", {"type": "response_vote", "term": group.raft.term}, 0)
    group._cycle()
    assert group.is_leader


def sent_since(outbox: Outbox, start: int) -> list[tuple[str, dict[str, Any], bool]]:
    """(peer, message, lazy) of what the group sent since ``start``."""
    sent = zip(outbox.sent[start:], outbox.lazy[start:], strict=True)
    return [(node, m, lazy) for (_, node, m), lazy in sent]


def kinds_since(outbox: Outbox, start: int) -> list[tuple[str, str, bool]]:
    """(peer, message type, lazy) of what the group sent since ``start``."""
    return [(node, m["type"], lazy) for node, m, lazy in sent_since(outbox, start)]
