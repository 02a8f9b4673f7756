"""Leadership handed on purpose: a retiring replica, transfers to a follower, a replica not ready to lead."""

from __future__ import annotations

from pathlib import Path

import pytest
from pysyncobj import FAIL_REASON
from raft_support import HEARTBEAT, Outbox, follower, leader

from mqds.protocol.errors import MqdsError, Reason
from mqds.server.raft import group as raft_group
from mqds.server.raft.group import RaftGroup


def test_a_retiring_replica_neither_takes_a_transfer_nor_campaigns(tmp_path: Path) -> None:
    """A stopping node hands its leaderships over; the balancer of the new leader must not hand them back."""
    group, outbox = follower(tmp_path)
    group.retire()
    group.deliver("n1", {"type": "timeout_now", "term": 1}, 0)
    group._cycle()
    assert group.raft.term == 1 and not [m for _, _, m in outbox.sent if m["type"] == "request_vote"]
    # Nor does it campaign when it stops hearing the leader...
    group.raft.election_deadline = 0
    group._cycle()
    assert group.raft.term == 1 and not [m for _, _, m in outbox.sent if m["type"] == "request_vote"]
    # It tells its leader so in its answers...
    group.deliver("n1", HEARTBEAT, 0)
    group._cycle()
    assert [m for _, node, m in outbox.sent if m["type"] == "next_node_idx"][-1].get("declines_leadership")
    # ...but it still votes for a follower that does.
    group.deliver("n2", {"type": "request_vote", "term": 2, "last_log_index": 1, "last_log_term": 0}, 0)
    group._cycle()
    assert [m for _, node, m in outbox.sent if node == "n2" and m["type"] == "response_vote"]
    group.stop()


def test_a_replica_that_is_not_retiring_takes_a_transfer(tmp_path: Path) -> None:
    group, outbox = follower(tmp_path)
    group.deliver("n1", {"type": "timeout_now", "term": 1}, 0)
    group._cycle()
    assert group.raft.term == 2 and [m for _, _, m in outbox.sent if m["type"] == "request_vote"]
    group.stop()


def _transferring(tmp_path: Path, target: str) -> tuple[RaftGroup, Outbox, list[int]]:
    """A leader with an entry its followers have not acknowledged, asked to hand over to ``target``."""
    group, outbox = leader(tmp_path)
    group.propose(b"\x00before")
    group._cycle()
    results: list[int] = []
    group._inbox.append((raft_group._TRANSFER, target, lambda _, fail: results.append(fail)))
    group._cycle()
    return group, outbox, results


def test_a_transfer_stops_new_writes_and_waits_for_the_target_to_catch_up(tmp_path: Path) -> None:
    """Under load a transfer used to fail: the leader kept appending, so the target campaigned with a
    shorter log, the old leader refused its vote and campaigned (and won) at once."""
    group, outbox, results = _transferring(tmp_path, "n1")
    # n1 has not acknowledged the last entry: nothing sent yet, and no new writes taken meanwhile.
    assert results == [] and not [m for _, _, m in outbox.sent if m["type"] == "timeout_now"]
    with pytest.raises(MqdsError, match="being handed over") as raised:
        group.propose(b"\x00during")
    assert raised.value.reason == Reason.NO_LEADER
    group.deliver(
        "n1", {"type": "next_node_idx", "next_node_idx": group.last_log_index + 1, "reset": False, "success": True}, 1
    )
    group._cycle()
    assert results == [FAIL_REASON.SUCCESS]
    assert [node for _, node, m in outbox.sent if m["type"] == "timeout_now"] == ["n1"]
    with pytest.raises(MqdsError, match="being handed over"):
        group.propose(b"\x00after")
    group.stop()


def test_a_transfer_to_a_follower_that_never_catches_up_gives_up_and_writes_resume(tmp_path: Path) -> None:
    group, outbox, results = _transferring(tmp_path, "n2")
    assert results == []
    # Past the deadline (an election timeout).
    node_id, callback, _ = group._transfer._pending
    group._transfer._pending = (node_id, callback, 0.0)
    group._cycle()
    assert results == [FAIL_REASON.REQUEST_DENIED]
    assert not [m for _, _, m in outbox.sent if m["type"] == "timeout_now"]
    group.propose(b"\x00after")
    group.stop()


def test_a_leader_hands_over_to_followers_that_do_not_decline(tmp_path: Path) -> None:
    group, outbox = leader(tmp_path)
    caught_up = {"type": "next_node_idx", "next_node_idx": group.last_log_index + 1, "reset": False, "success": True}
    group.deliver("n2", {**caught_up, "declines_leadership": True}, 1)
    group.deliver("n1", caught_up, 1)
    group._cycle()
    results: list[int] = []
    # Not to n2, whose node is stopping: refused at once, and writes go on.
    group._inbox.append((raft_group._TRANSFER, "n2", lambda _, fail: results.append(fail)))
    group._cycle()
    assert results == [FAIL_REASON.REQUEST_DENIED]
    group.propose(b"\x00still")
    group._cycle()
    group.deliver("n1", {**caught_up, "next_node_idx": group.last_log_index + 1}, 2)
    group.deliver("n2", {**caught_up, "next_node_idx": group.last_log_index + 1, "declines_leadership": True}, 2)
    group._cycle()
    # Any follower: n1 (the highest id would win a tie).
    group._inbox.append((raft_group._TRANSFER, "", lambda _, fail: results.append(fail)))
    group._cycle()
    assert results[-1] == FAIL_REASON.SUCCESS
    assert [node for _, node, m in outbox.sent if m["type"] == "timeout_now"] == ["n1"]
    group.stop()


def test_a_replica_that_is_not_ready_declines_leadership_but_still_campaigns(tmp_path: Path) -> None:
    """A leader balancer handed vnodes to a node that was still fetching snapshots."""
    group, outbox = follower(tmp_path)
    group.not_ready = True
    group.deliver("n1", HEARTBEAT, 0)
    group._cycle()
    assert [m for _, _, m in outbox.sent if m["type"] == "next_node_idx"][-1].get("declines_leadership")
    group.deliver("n1", {"type": "timeout_now", "term": 1}, 0)
    group._cycle()
    assert group.raft.term == 1
    # When its leader is gone, it stands in the election like any replica.
    group.raft.election_deadline = 0
    group._cycle()
    assert group.raft.term == 2 and [m for _, _, m in outbox.sent if m["type"] == "request_vote"]
    group.stop()
