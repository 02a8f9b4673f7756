"""Raft scenarios of a few seconds each, on an in-process cluster of real ``RaftGroup``s (tests/raft_harness.py).

Each scenario scripts a history (elections, a partition, a leadership
transfer, a replica down while the log is compacted) and checks Raft's
promises after it: one leader followed by a majority, commits only with a
majority, every replica ending with the same applied history.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from raft_harness import FAST_TIMING, Cluster, make_cluster

from mqds.protocol.errors import MqdsError, Reason
from mqds.server.raft.group import RaftTiming

# A hard stop for a scenario that hangs; each one takes a few seconds (its waits are bounded tighter).
pytestmark = pytest.mark.timeout(30)


def _commit_all(cluster: Cluster, prefix: str, count: int, among: list[str] | None = None) -> list[int]:
    return [cluster.commit(f"{prefix}-{i}".encode(), among=among) for i in range(count)]


def _assert_same_history(cluster: Cluster, nodes: list[str] | None = None) -> list[tuple[int, bytes]]:
    nodes = nodes or cluster.running()
    histories = {n: cluster.machine(n).entries for n in nodes}
    first = histories[nodes[0]]
    for node, history in histories.items():
        assert history == first, f"{node} applied a different history than {nodes[0]}\n{cluster.describe()}"
    return first


@pytest.mark.parametrize("size", [3, 5])
def test_a_leader_is_elected_and_commands_commit_on_every_replica(tmp_path: Path, size: int) -> None:
    with make_cluster(tmp_path, size) as cluster:
        leader = cluster.wait_leader(timeout=5)
        assert [n for n in cluster.ids if cluster.group(n).is_leader] == [leader]
        indexes = _commit_all(cluster, "a", 20)
        assert indexes == sorted(indexes) and len(set(indexes)) == 20
        cluster.wait_applied(indexes[-1], timeout=5)
        history = _assert_same_history(cluster)
        assert [index for index, _ in history] == indexes
        assert [command for _, command in history] == [f"a-{i}".encode() for i in range(20)]
        # Every replica knows the leader and the commit (a spurious election on a loaded machine may move it).
        cluster.wait_for(
            lambda: (
                (now := cluster.leader()) is not None
                and all(
                    (s := cluster.group(n).status())["leader"] == now and s["commit_index"] >= indexes[-1]
                    for n in cluster.ids
                )
            ),
            5,
            "every replica to follow one leader and know the last commit",
        )


def test_a_leader_cut_off_cannot_commit_and_catches_up_after_the_heal(tmp_path: Path) -> None:
    with make_cluster(tmp_path, 5) as cluster:
        old = cluster.wait_leader(timeout=5)
        before = _commit_all(cluster, "before", 5)
        cluster.wait_applied(before[-1], timeout=5)
        # The leader and one follower on the minority side: a follower cannot make a majority either.
        buddy = next(n for n in cluster.ids if n != old)
        minority = [old, buddy]
        majority = [n for n in cluster.ids if n not in minority]
        term_when_cut = cluster.group(old).raft.term
        cluster.partition(*minority)
        commit_when_cut = cluster.group(old).status()["commit_index"]
        try:
            stale = cluster.group(old).propose(b"stale")
        except MqdsError as err:  # it already stepped down: a thread stalled for a whole election timeout
            assert err.reason in (Reason.NO_LEADER, Reason.NOT_LEADER)
            stale = None

        new = cluster.wait_leader(timeout=5, among=majority)
        assert new in majority
        assert cluster.group(new).raft.term > term_when_cut
        after = _commit_all(cluster, "after", 5, among=majority)
        cluster.wait_applied(after[-1], timeout=5, nodes=majority)

        # The old leader gives up leading once a majority stopped answering, having committed nothing.
        cluster.wait_for(lambda: not cluster.group(old).is_leader, 3, f"{old} to step down")
        assert cluster.group(old).status()["commit_index"] == commit_when_cut
        if stale is not None:
            assert not stale.done.is_set()
        for node in minority:
            assert cluster.machine(node).applied_index < after[0]
            assert b"stale" not in cluster.machine(node).commands

        cluster.heal()
        cluster.wait_applied(after[-1], timeout=5)
        leader = cluster.wait_leader(timeout=5)
        assert leader in majority  # the minority's logs were behind: neither could win
        history = _assert_same_history(cluster)
        assert [c for _, c in history] == [f"before-{i}".encode() for i in range(5)] + [
            f"after-{i}".encode() for i in range(5)
        ]
        if stale is not None:
            # Its entry was overwritten by the new leader's: the proposer learns it was not applied.
            with pytest.raises(MqdsError) as caught:
                stale.wait(5)
            assert caught.value.reason is Reason.NO_LEADER
        # The same log on every replica (indexes, terms, commands), not just the same applied commands;
        # the old leader's uncommitted entry is gone from its journal.
        last = cluster.commit(b"last")

        def same_logs() -> bool:
            logs = [cluster.log_entries(n) for n in cluster.ids]
            return logs[0][-1][0] >= last and all(log == logs[0] for log in logs)

        cluster.wait_for(same_logs, 5, "every replica to hold the same log")
        assert not [e for e in cluster.log_entries(old) if b"stale" in e[2]]


@pytest.mark.parametrize("named", [True, False], ids=["to-a-chosen-node", "to-the-most-caught-up"])
def test_leadership_is_handed_to_a_follower_which_then_serves(tmp_path: Path, named: bool) -> None:
    with make_cluster(tmp_path, 3) as cluster:
        old = cluster.wait_leader(timeout=5)
        first = _commit_all(cluster, "first", 5)
        cluster.wait_applied(first[-1], timeout=5)
        target = next(n for n in reversed(cluster.ids) if n != old)
        term = cluster.group(old).raft.term

        cluster.group(old).transfer_leadership(target if named else None)
        new = cluster.wait_for(
            lambda: (leader := cluster.leader()) not in (None, old) and leader, 5, "leadership to move"
        )
        if named:
            assert new == target
        assert cluster.group(new).raft.term > term
        # The old leader now follows, and says whom to ask.
        cluster.wait_for(lambda: not cluster.group(old).is_leader, 3, f"{old} to step down")
        with pytest.raises(MqdsError) as caught:
            cluster.group(old).propose(b"to the old leader")
        assert caught.value.reason in (Reason.NOT_LEADER, Reason.NO_LEADER)
        if caught.value.reason is Reason.NOT_LEADER:
            assert new in str(caught.value)

        proposal = cluster.group(new).propose(b"served by the new leader")
        index = int(proposal.wait(5))
        cluster.wait_applied(index, timeout=5)
        history = _assert_same_history(cluster)
        assert history[-1] == (index, b"served by the new leader")
        assert cluster.leader() == new


def test_a_replica_down_while_the_log_was_compacted_catches_up_by_snapshot(tmp_path: Path) -> None:
    # Compact at 4 KiB of entries, and roll log segments at 16 KiB, so a few dozen commands suffice.
    timing = RaftTiming(
        heartbeat_s=FAST_TIMING.heartbeat_s,
        election_timeout_min_s=FAST_TIMING.election_timeout_min_s,
        election_timeout_max_s=FAST_TIMING.election_timeout_max_s,
        log_max_bytes=4096,
    )
    with make_cluster(tmp_path, 3, timing=timing, segment_bytes=16 * 1024) as cluster:
        leader = cluster.wait_leader(timeout=5)
        first = _commit_all(cluster, "first", 3)
        cluster.wait_applied(first[-1], timeout=5)
        down = next(n for n in cluster.ids if n != leader)
        cluster.stop(down)
        applied_when_down = cluster.machine(down).applied_index

        payload = b"x" * 256
        while_down = [cluster.commit(payload + b"%d" % i) for i in range(60)]
        up = [n for n in cluster.ids if n != down]
        cluster.wait_applied(while_down[-1], timeout=5, nodes=up)
        # The leader's log no longer holds the entry the replica that is down needs next.
        cluster.wait_for(
            lambda: cluster.log_entries(leader)[0][0] > applied_when_down + 1, 5, f"{leader} to compact its log"
        )
        assert cluster.machine(leader).snapshots > 0

        cluster.restart(down)
        cluster.wait_applied(while_down[-1], timeout=5)
        installs = cluster.machine(down).installs
        assert installs, f"{down} caught up without a snapshot\n{cluster.describe()}"
        assert installs[0][0] > applied_when_down + 1
        assert cluster.group(down).snapshots_installed >= 1
        assert cluster.network.sent["install_snapshot"] > 0
        _assert_same_history(cluster)

        # From the snapshot on it follows by ordinary appends.
        index = cluster.commit(b"after the snapshot")
        cluster.wait_applied(index, timeout=5)
        history = _assert_same_history(cluster)
        assert history[-1] == (index, b"after the snapshot")
        assert len(history) == 3 + 60 + 1
