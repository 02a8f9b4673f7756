"""The chaos checker finds each kind of violation; the schedule is reproducible; the options are checked."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import pytest

from mqds.chaos import runner
from mqds.chaos.checker import Convergence, ReplicaState, check, check_reads, longest_gap, write_outages
from mqds.chaos.history import Ack, FaultRecord, History, ReadMessage, parse_message, payload_of, topic_of
from mqds.chaos.nemesis import NEMESES, Schedule, cut_off
from mqds.server.config import ConfigError, NodeConfig


def history_with(acked: dict[tuple[str, int], Ack], attempted_only: list[tuple[str, int]] = ()) -> History:
    """A history where ``acked`` were attempted and acknowledged, ``attempted_only`` only attempted."""
    history = History()
    history.record_attempted([*acked, *attempted_only])
    history.acked.update(acked)
    return history


def stored(sender: str, seqs: list[int], shard: int = 1) -> list[ReadMessage]:
    return [ReadMessage(sender, seq, shard, 1000 + seq) for seq in seqs]


def acks(sender: str, seqs: list[int], shard: int = 1, at: float = 5.0) -> dict[tuple[str, int], Ack]:
    return {(sender, seq): Ack(shard, 1000 + seq, at) for seq in seqs}


def test_a_clean_history_passes() -> None:
    history = history_with(acks("a", [0, 1, 2]), attempted_only=[("a", 3)])
    result = check_reads(history, stored("a", [0, 1, 2, 3]))
    assert result.passed, result.findings
    assert result.counts["lost"] == 0 and result.counts["read"] == 4
    # Attempted, never acknowledged, but stored (a timeout whose write committed): allowed.
    assert result.counts["unacked_but_stored"] == 1


def test_a_lost_message_is_reported_and_classified_by_fault() -> None:
    history = history_with({**acks("a", [0, 1]), **acks("a", [2], at=11.0)})
    history.faults.append(FaultRecord(1, "kill-leader", ["n2"], "", started=10.0, healed=14.0, recovered=15.0))
    result = check_reads(history, stored("a", [0, 1]))
    assert not result.passed
    (lost,) = result.of_kind("lost")
    assert (lost.sender, lost.seq, lost.shard) == ("a", 2, 1)
    assert lost.where == "during fault #1 kill-leader"
    assert result.loss_classes == {"shard 1, during fault #1 kill-leader": 1}
    assert result.violation_counts() == {"lost": 1}


def test_an_unexpected_message_is_reported() -> None:
    history = history_with(acks("a", [0, 1]))
    result = check_reads(history, [*stored("a", [0, 1]), ReadMessage("ghost", 7, 3, 99)])
    (finding,) = result.of_kind("unexpected")
    assert (finding.sender, finding.seq) == ("ghost", 7)
    assert not result.passed


def test_unparsable_stored_messages_count_as_unexpected() -> None:
    history = history_with(acks("a", [0]))
    result = check_reads(history, stored("a", [0]), unparsable=2)
    assert len(result.of_kind("unexpected")) == 2


def test_a_duplicate_is_reported() -> None:
    history = history_with(acks("a", [0, 1, 2]))
    final = stored("a", [0, 1, 2])
    final.append(ReadMessage("a", 1, 1, 5000))  # the same message, stored again later
    result = check_reads(history, final)
    (dup,) = result.of_kind("duplicate")
    assert (dup.sender, dup.seq) == ("a", 1)
    assert result.counts["duplicates"] == 1
    assert not result.passed


def test_out_of_order_replay_is_reported() -> None:
    history = history_with(acks("a", [0, 1, 2, 3]))
    final = stored("a", [0, 2, 1, 3])
    result = check_reads(history, final)
    (finding,) = result.of_kind("out-of-order")
    assert (finding.sender, finding.seq) == ("a", 1)
    assert not result.passed
    # Different senders interleave freely.
    mixed = check_reads(
        history_with({**acks("a", [0, 1]), **acks("b", [0, 1])}),
        [*stored("b", [0]), *stored("a", [0, 1]), *stored("b", [1])],
    )
    assert mixed.passed, mixed.findings


def test_a_message_read_at_another_position_than_acknowledged_is_reported() -> None:
    history = history_with(acks("a", [0, 1]))
    final = [ReadMessage("a", 0, 1, 1000), ReadMessage("a", 1, 1, 7777)]
    result = check_reads(history, final)
    (moved,) = result.of_kind("moved")
    assert moved.seq == 1


def test_a_message_seen_while_running_and_gone_at_the_end_is_reported() -> None:
    history = history_with(acks("a", [0]), attempted_only=[("a", 1)])
    history.record_seen(stored("a", [0, 1]))
    result = check_reads(history, stored("a", [0]))
    (gone,) = result.of_kind("vanished")
    assert gone.seq == 1


def test_anomalies_the_workload_recorded_fail_the_run() -> None:
    history = history_with(acks("a", [0]))
    history.record_anomaly("reader-duplicate", "reader0: a#0 seen twice")
    result = check_reads(history, stored("a", [0]))
    assert result.violation_counts() == {"reader-duplicate": 1}


def test_replicas_that_differ_fail_the_run() -> None:
    history = history_with(acks("a", [0]))
    same = [ReplicaState("n1", 10, "x", 5), ReplicaState("n2", 10, "x", 5)]
    differ = [ReplicaState("n1", 10, "x", 5), ReplicaState("n2", 10, "y", 5)]
    ok = check(history, stored("a", [0]), [Convergence(0, True, same)], n_shards=2)
    assert ok.passed
    bad = check(history, stored("a", [0]), [Convergence(0, True, same), Convergence(1, False, differ)], n_shards=2)
    assert bad.violation_counts() == {"not-converged": 1}


def test_longest_gap_measures_the_write_outage_from_the_fault() -> None:
    times = [1.0, 1.1, 1.2, 5.0, 5.1, 9.0]
    # The fault at 1.25: nothing until 5.0.
    assert longest_gap(times, 1.25, 4.0, end_of_workload=10.0) == pytest.approx(3.75)
    # A later stretch that begins inside the window counts whole (5.1 to 9.0).
    assert longest_gap(times, 1.25, 6.0, end_of_workload=10.0) == pytest.approx(3.9)
    # Gaps that begin after the window do not count; one still open at the end runs to the end.
    assert longest_gap(times, 5.05, 5.2, end_of_workload=10.0) == pytest.approx(3.9)
    assert longest_gap([], 2.0, 3.0, end_of_workload=10.0) == pytest.approx(8.0)
    # Nothing past the next fault's start is this fault's.
    assert longest_gap(times, 1.25, 4.0, end_of_workload=10.0, cut_at=3.0) == pytest.approx(1.75)
    assert longest_gap(times, 1.25, 4.0, end_of_workload=10.0, cut_at=1.0) == 0.0


def test_write_outages_split_hit_and_other_vnodes() -> None:
    history = History()
    history.acked.update({("a", i): Ack(0, i, 0.1 * i) for i in range(100)})  # shard 0: steady
    history.acked.update({("b", i): Ack(1, i, 0.1 * i) for i in range(30)})  # shard 1: stops at 2.9 ...
    history.acked.update({("b", i): Ack(1, i, 0.1 * i + 2.0) for i in range(50, 80)})  # ... back at 7.0
    history.faults.append(FaultRecord(1, "kill-leader", ["n1"], "", started=3.0, healed=5.0, recovered=6.0))
    history.workload_ended = 10.0
    (outage,) = write_outages(history, n_shards=2, settle_s=1.0)
    assert outage.affected == {} and outage.others_shard == 1
    history.faults[0].affected_shards = [1]
    (outage,) = write_outages(history, n_shards=2, settle_s=1.0)
    assert outage.affected[1] == pytest.approx(4.0)
    assert outage.others_max_s == pytest.approx(0.1) and outage.others_shard == 0
    # A second fault at 4.0: the first one's window stops there.
    history.faults.append(FaultRecord(2, "pause-leader", ["n2"], "", started=4.0, healed=5.0, recovered=5.5))
    first, second = write_outages(history, n_shards=2, settle_s=1.0)
    assert first.affected[1] == pytest.approx(1.0) and second.affected == {}
    assert second.others_shard == 1 and second.others_max_s == pytest.approx(3.0)


def test_messages_name_themselves() -> None:
    assert parse_message(topic_of("pub3", 42), payload_of("pub3", 42)) == ("pub3", 42)
    assert parse_message(topic_of("pub3", 42), payload_of("pub3", 41)) is None
    assert parse_message("other/pub3/42", payload_of("pub3", 42)) is None


def test_cut_off_vnodes_are_those_whose_leader_lost_its_majority() -> None:
    placement = {0: ["n1", "n2", "n3"], 1: ["n2", "n3", "n4"], 2: ["n1", "n4", "n5"]}
    leaders = {0: "n1", 1: "n2", 2: "n5"}
    blocked = {"n1": {"n2", "n3", "n4"}, "n2": {"n1"}, "n3": {"n1"}, "n4": {"n1"}}
    # n1 leads shard 0 but reaches none of its replicas; shard 2's leader n5 reaches n4.
    assert cut_off(blocked, leaders, placement) == [0]


def test_the_schedule_is_reproducible_and_runs_every_nemesis_each_cycle() -> None:
    names = list(NEMESES)
    first = [(p.nemesis, p.hold_s, p.quiet_s, p.rng.random()) for p in islice(Schedule(names, 7), 30)]
    again = [(p.nemesis, p.hold_s, p.quiet_s, p.rng.random()) for p in islice(Schedule(names, 7), 30)]
    other = [(p.nemesis, p.hold_s) for p in islice(Schedule(names, 8), 30)]
    assert first == again
    assert [(n, h) for n, h, _, _ in first] != other
    cycle = [n for n, _, _, _ in first[: len(names)]]
    assert sorted(cycle) == sorted(names)


def test_options_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert runner.main(["--nemesis", "kill-everything"]) == runner.EXIT_USAGE
    assert "unknown nemesis" in capsys.readouterr().err
    assert runner.main(["--nodes", "2"]) == runner.EXIT_USAGE
    with pytest.raises(SystemExit) as exit_info:
        runner.main(["--help"], prog="mqds chaos")
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith("usage: mqds chaos")
    for option in ("--duration", "--nemesis", "--nodes", "--seed", "--report-json", "--network"):
        assert option in help_text
    for name in NEMESES:
        assert name in help_text
    opts, _ = runner.parse_options(["--nemesis", "wipe-node,partition", "--seed", "3", "--hold", "1-2"])
    assert opts.nemeses == ["wipe-node", "partition"] and opts.seed == 3 and opts.hold_s == (1.0, 2.0)


def test_the_clock_offset_is_for_fault_injection_only() -> None:
    with pytest.raises(ConfigError, match="fault_injection"):
        NodeConfig(fault_clock_offset_s=30.0).validate()
    assert NodeConfig(fault_clock_offset_s=-30.0, fault_injection=True).validate().fault_clock_offset_s == -30.0
