"""The chaos checker finds each kind of violation; the schedule is reproducible; the options are checked."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from itertools import islice
from pathlib import Path
from typing import cast

import pytest

from mqds.chaos import runner
from mqds.chaos.checker import (
    CheckResult,
    Convergence,
    ReplicaState,
    check,
    check_consumers,
    check_reads,
    longest_gap,
    write_outages,
)
from mqds.chaos.history import (
    PUBSUB,
    QUEUE,
    Ack,
    FaultRecord,
    History,
    ReadMessage,
    parse_message,
    payload_of,
    topic_of,
)
from mqds.chaos.nemesis import DISK_NEMESES, NEMESES, Schedule, cut_off
from mqds.chaos.report import json_report, text_report
from mqds.chaos.workload import PubsubConsumer, QueueConsumer, SessionConsumer
from mqds.client import Client, Message
from mqds.client import errors as E
from mqds.protocol.topics import matches
from mqds.server.config import ConfigError, NodeConfig


def history_with(acked: dict[tuple[str, int], Ack], attempted_only: Sequence[tuple[str, int]] = ()) -> History:
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


def consumed(
    history: History, name: str, mode: str, deliveries: list[ReadMessage], topic_filter: str = "chaos/#"
) -> None:
    """Register consumer ``name`` and record ``deliveries`` as its fetches returned them, drained."""
    history.add_consumer(name, mode, topic_filter).drained = True
    history.record_delivered(name, deliveries)


def consumers_checked(history: History) -> CheckResult:
    result = CheckResult(counts=history.counts())
    check_consumers(history, result)
    return result


def test_a_pubsub_consumer_that_missed_an_acknowledged_message_fails() -> None:
    history = history_with({**acks("a", [0, 1]), **acks("a", [2], at=11.0)}, attempted_only=[("a", 3)])
    history.faults.append(FaultRecord(1, "partition", ["n3"], "", started=10.0, healed=13.0, recovered=14.0))
    consumed(history, "sub-1", PUBSUB, stored("a", [0, 1, 2]))
    consumed(history, "sub-2", PUBSUB, stored("a", [0, 1]))  # a#3 was never acknowledged: not required
    result = consumers_checked(history)
    assert result.violation_counts() == {"consumer-lost": 1}
    (lost,) = result.of_kind("consumer-lost")
    assert (lost.sender, lost.seq, lost.shard, lost.where) == ("a", 2, 1, "during fault #1 partition")
    assert "sub-2" in lost.detail
    assert result.consumer_loss_classes == {"consumer sub-2: shard 1, during fault #1 partition": 1}
    sub1, sub2 = result.consumers
    assert (sub1.name, sub1.expected, sub1.missing, sub2.missing) == ("sub-1", 3, 0, 1)
    assert result.counts["consumer_missing"] == 1


def test_redeliveries_pass_and_are_counted_per_consumer() -> None:
    history = history_with({**acks("a", [0, 1, 2]), **acks("b", [0, 1], shard=2)})
    # sub-1's acknowledgement of a#0..a#1 was lost: they came again, then the rest.
    again = [*stored("a", [0, 1]), *stored("a", [0, 1, 2]), *stored("b", [0, 1], shard=2)]
    consumed(history, "sub-1", PUBSUB, again)
    consumed(history, "sub-2", PUBSUB, [*stored("a", [0, 1, 2]), *stored("b", [0, 1], shard=2)])
    result = consumers_checked(history)
    assert result.passed, result.findings
    by_name = {c.name: c for c in result.consumers}
    assert (by_name["sub-1"].delivered, by_name["sub-1"].distinct, by_name["sub-1"].redelivered) == (7, 5, 2)
    assert by_name["sub-2"].redelivered == 0 and by_name["sub-2"].missing == 0
    assert result.counts["consumer_redelivered"] == 2 and result.counts["consumer_delivered"] == 12
    # The report shows them, and the JSON has the same figures.
    run = {"seed": 1, "nodes": 3, "shards": 4, "nemeses": ["partition"], "elapsed_s": 1.0, "duration_s": 1.0}
    text = text_report({**run, "network": "hook", "readers": 0}, result, [])
    assert "every consumer got everything" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("sub-1"))
    assert row.split()[:7] == ["sub-1", "pubsub", "chaos/#", "7", "5", "2", "-"]
    data = json_report(run, result, [])
    assert data["consumers"][0]["redelivered"] == 2 and data["passed"] is True


def test_queue_consumers_cover_their_filter_between_them() -> None:
    history = history_with({**acks("q", [0, 1, 2, 3]), **acks("other", [0, 1])})
    # Each got part of the queue, q#1 both (an ack that came too late for the other one); "other" is out of scope.
    consumed(history, "queue-1", QUEUE, stored("q", [0, 1]), topic_filter="chaos/q/#")
    consumed(history, "queue-2", QUEUE, [*stored("q", [1, 2, 3]), *stored("q", [3])], topic_filter="chaos/q/#")
    result = consumers_checked(history)
    assert result.passed, result.findings
    one, two = result.consumers
    assert (one.expected, one.missing, one.also_to_others, one.redelivered) == (4, 0, 1, 0)
    assert (two.distinct, two.also_to_others, two.redelivered) == (3, 1, 1)
    # Neither got q#3: one consumer-lost for the pair, not one per consumer.
    short = history_with(acks("q", [0, 1, 2, 3]))
    consumed(short, "queue-1", QUEUE, stored("q", [0, 1]), topic_filter="chaos/q/#")
    consumed(short, "queue-2", QUEUE, stored("q", [1, 2]), topic_filter="chaos/q/#")
    failed = consumers_checked(short)
    (lost,) = failed.of_kind("consumer-lost")
    assert (lost.sender, lost.seq) == ("q", 3) and "queue consumers queue-1,queue-2" in lost.detail
    assert [c.missing for c in failed.consumers] == [1, 1]


def test_a_pubsub_consumer_getting_a_sender_out_of_order_fails() -> None:
    history = history_with({**acks("a", [0, 1, 2, 3]), **acks("b", [0, 1], shard=2)})
    # Redelivering a#0 after a#1 is fine; a first delivery of a#2 after a#3 is not.
    deliveries = [*stored("a", [0, 1, 0]), *stored("b", [0]), *stored("a", [3, 2]), *stored("b", [1])]
    consumed(history, "sub-1", PUBSUB, deliveries)
    result = consumers_checked(history)
    (finding,) = result.of_kind("consumer-order")
    assert (finding.sender, finding.seq) == ("a", 2) and "after seq 3" in finding.detail
    assert result.violation_counts() == {"consumer-order": 1}
    assert result.consumers[0].redelivered == 1


def test_a_consumer_delivery_never_attempted_or_not_stored_fails() -> None:
    history = history_with(acks("a", [0]), attempted_only=[("a", 1)])
    consumed(history, "sub-1", PUBSUB, [*stored("a", [0, 1]), ReadMessage("ghost", 3, 2, 7)])
    result = check(history, stored("a", [0]), [], n_shards=4)
    (ghost,) = result.of_kind("consumer-unexpected")
    (gone,) = result.of_kind("consumer-vanished")
    assert (ghost.sender, ghost.seq, gone.sender, gone.seq) == ("ghost", 3, "a", 1)
    assert result.counts["consumer_unexpected"] == 1


def test_a_consumer_that_did_not_drain_says_so_in_its_losses() -> None:
    history = history_with(acks("a", [0, 1]))
    history.add_consumer("sub-1", PUBSUB, "chaos/#")
    history.record_delivered("sub-1", stored("a", [0]))
    result = consumers_checked(history)
    (lost,) = result.of_kind("consumer-lost")
    assert "did not finish draining" in lost.detail and result.consumers[0].drained is False
    with pytest.raises(ValueError, match="registered twice"):
        history.add_consumer("sub-1", PUBSUB, "chaos/#")


class InMemorySessions:
    """``fetch_offline``/``ack`` with the semantics of the real ones over fixed stored messages; the first
    ``failing_acks`` acks and ``failing_fetches`` fetches fail with ``error`` (as faults make them)."""

    def __init__(
        self, messages: list[Message], failing_acks: int = 0, failing_fetches: int = 0, error: E.MqdsError | None = None
    ) -> None:
        self.messages = sorted(messages, key=lambda m: (m.timestamp_us or 0, m.shard or 0))
        self.positions: dict[tuple[str, str], dict[int, int]] = {}
        self.queue_acked: set[tuple[int, int]] = set()
        self.acked: list[tuple[str, int, int]] = []
        self.failing_acks = failing_acks
        self.failing_fetches = failing_fetches
        self.error = error or E.UnavailableError(E.Reason.NO_LEADER, "no leader (injected)")
        self.lock = threading.Lock()

    def fetch_offline(
        self,
        clientid: str,
        topic_filter: str,
        mode: str = "pubsub",
        max_count: int = 500,
        time_range_s: float | None = None,
        *,
        include_qos0: bool = False,
        timeout_s: float | None = None,
    ) -> list[Message]:
        with self.lock:
            if self.failing_fetches:
                self.failing_fetches -= 1
                raise self.error
            after = self.positions.get((clientid, topic_filter), {})
            found = [
                m
                for m in self.messages
                if matches(topic_filter, m.topic)
                and (
                    (m.shard or 0, m.timestamp_us or 0) not in self.queue_acked
                    if mode == QUEUE
                    else (m.timestamp_us or 0) > after.get(m.shard or 0, 0)
                )
            ]
            return found[:max_count]

    def ack(
        self, clientid: str, topic_filter: str, message: Message, mode: str = "pubsub", timeout_s: float | None = None
    ) -> None:
        shard, ts = message.shard or 0, message.timestamp_us or 0
        with self.lock:
            if self.failing_acks:
                self.failing_acks -= 1
                raise self.error
            self.acked.append((clientid, shard, ts))
            if mode == QUEUE:
                self.queue_acked.add((shard, ts))
            else:
                position = self.positions.setdefault((clientid, topic_filter), {})
                position[shard] = max(position.get(shard, 0), ts)

    def close(self) -> None:
        pass


def as_stored(sender: str, seqs: list[int], shard: int) -> list[Message]:
    """The workload's messages as fetch_offline returns them (with their positions)."""
    return [
        Message(topic_of(sender, s), payload_of(sender, s), sender, 1, timestamp_us=1000 + s, shard=shard) for s in seqs
    ]


def run_to_drained(consumers: Sequence[SessionConsumer]) -> None:
    for consumer in consumers:
        consumer.start()
    time.sleep(0.2)
    for consumer in consumers:
        consumer.finish()
    for consumer in consumers:
        consumer.thread.join(10)
        assert not consumer.thread.is_alive()


def test_a_pubsub_consumer_gets_again_what_a_lost_ack_left_and_acks_the_last_of_each_shard() -> None:
    history = history_with({**acks("a", [0, 1, 2]), **acks("b", [0, 1], shard=2)})
    sessions = InMemorySessions([*as_stored("a", [0, 1, 2], 1), *as_stored("b", [0, 1], 2)], failing_acks=1)
    consumer = PubsubConsumer("sub-1", lambda: cast(Client, sessions), history, poll_s=0.01)
    run_to_drained([consumer])
    # The first fetch's first ack failed: the next fetch gave all five again, then one ack per shard.
    assert consumer.log.drained and consumer.log.errors == 1 and consumer.log.acks == 2
    assert sessions.acked == [("sub-1", 1, 1002), ("sub-1", 2, 1001)]
    assert [m.key for m in history.deliveries("sub-1")] == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2)] * 2
    result = consumers_checked(history)
    assert result.passed, result.findings
    assert result.consumers[0].redelivered == 5 and not history.anomalies


def test_queue_consumers_share_the_queue_and_a_non_retriable_error_is_an_anomaly() -> None:
    history = history_with(acks("q", list(range(30)), shard=3))
    refused = E.InvalidArgumentError(E.Reason.INVALID_REQUEST, "refused (injected)")
    sessions = InMemorySessions(as_stored("q", list(range(30)), 3), failing_fetches=1, error=refused)
    pair = [
        QueueConsumer(
            f"queue-{i}",
            lambda: cast(Client, sessions),
            history,
            topic_filter="chaos/q/#",
            max_count=7,
            poll_s=0.02,
            phase_s=0.01 * (i - 1),
        )
        for i in (1, 2)
    ]
    run_to_drained(pair)
    assert all(c.log.drained for c in pair)
    # Every message was acknowledged (one call each), so the queue is empty for both.
    assert {ts for _, _, ts in sessions.acked} == {1000 + s for s in range(30)}
    assert sessions.fetch_offline("anyone", "chaos/q/#", mode=QUEUE) == []
    result = check(history, stored("q", list(range(30)), shard=3), [], n_shards=4)
    assert result.violation_counts() == {"consumer-error": 1}, result.findings
    assert sum(c.errors for c in result.consumers) == 1
    assert result.consumers[0].missing == result.consumers[1].missing == 0


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
    assert opts.disk_mode == "off"


def test_the_disk_nemeses_run_on_fault_filesystems_only(capsys: pytest.CaptureFixture[str]) -> None:
    disk = {"power-loss-node", "power-loss-minority", "power-loss-all", "disk-full", "disk-error", "disk-slow"}
    assert disk == DISK_NEMESES and disk <= set(NEMESES)
    # mix: the disk nemeses only on fault filesystems; naming one puts the nodes on them (posix by default).
    opts, _ = runner.parse_options([])
    assert set(opts.nemeses) == set(NEMESES) - disk and opts.disk_mode == "off"
    assert runner.Options().nemeses == opts.nemeses
    opts, _ = runner.parse_options(["--disk", "journal"])
    assert opts.nemeses == list(NEMESES) and opts.disk_mode == "journal"
    opts, _ = runner.parse_options(["--nemesis", "power-loss-all,kill-node"])
    assert opts.disk_mode == "posix"
    assert runner.main(["--nemesis", "disk-full", "--disk", "off"]) == runner.EXIT_USAGE
    assert "need a disk" in capsys.readouterr().err


def test_the_clock_offset_is_for_fault_injection_only() -> None:
    with pytest.raises(ConfigError, match="fault_injection"):
        NodeConfig(fault_clock_offset_s=30.0).validate()
    assert NodeConfig(fault_clock_offset_s=-30.0, fault_injection=True).validate().fault_clock_offset_s == -30.0


# -- hostile clients ------------------------------------------------------------------------


def hostile_history(answers: Sequence[tuple[str, str]], must_refuse: Sequence[str] = ()) -> History:
    history = history_with(acks("a", [0, 1]))
    history.add_hostile(set(must_refuse))
    for kind, code in answers:
        history.record_hostile(kind, "n1", code, f"{code.lower()} answer")
    return history


def test_hostile_answers_that_refuse_clearly_pass_and_are_counted_per_kind_and_status() -> None:
    history = hostile_history(
        [
            ("get-fences-200k-shards", "INVALID_ARGUMENT"),
            ("get-fences-200k-shards", "INVALID_ARGUMENT"),
            ("join-node-no-credentials", "UNAUTHENTICATED"),
            ("burst", "OK"),
            ("burst", "RESOURCE_EXHAUSTED"),
            ("deep-topic-store", "UNAVAILABLE"),
        ],
        must_refuse=["join-node-no-credentials"],
    )
    result = check(history, stored("a", [0, 1]), [], n_shards=2)
    assert result.passed, result.findings
    assert result.hostile is not None and result.hostile["sent"] == 6
    assert result.hostile["by_kind"]["get-fences-200k-shards"] == {"INVALID_ARGUMENT": 2}
    assert result.hostile["by_kind"]["burst"] == {"OK": 1, "RESOURCE_EXHAUSTED": 1}
    assert result.hostile["by_status"]["INVALID_ARGUMENT"] == 2
    assert result.counts["hostile_sent"] == 6 and result.counts["hostile_internal"] == 0
    run = {"seed": 1, "nodes": 3, "shards": 2, "nemeses": ["kill-leader"], "elapsed_s": 1.0, "duration_s": 1.0}
    text = text_report({**run, "network": "hook", "readers": 0}, result, [])
    assert "hostile clients" in text and "requests sent 6" in text
    assert "join-node-no-credentials" in text and "(must be refused)" in text
    data = json_report(run, result, [])
    assert data["hostile"]["by_status"]["UNAUTHENTICATED"] == 1 and data["passed"] is True


@pytest.mark.parametrize("code", ["INTERNAL", "UNKNOWN"])
def test_an_internal_answer_to_a_hostile_request_fails_the_run(code: str) -> None:
    history = hostile_history([("get-streams-2000-shards", "INVALID_ARGUMENT"), ("deep-topic-queue-ack", code)])
    result = check(history, stored("a", [0, 1]), [], n_shards=2)
    assert not result.passed
    (finding,) = result.of_kind("hostile-internal")
    assert "deep-topic-queue-ack to n1" in finding.detail and code in finding.detail
    assert result.violation_counts() == {"hostile-internal": 1}
    assert result.counts["hostile_internal"] == 1
    run = {"seed": 1, "nodes": 3, "shards": 2, "nemeses": [], "elapsed_s": 1.0, "duration_s": 1.0}
    text = text_report({**run, "network": "hook", "readers": 0}, result, [])
    assert "RESULT: FAIL (hostile-internal 1)" in text and "deep-topic-queue-ack" in text


def test_a_request_that_must_be_refused_and_succeeds_fails_the_run() -> None:
    history = hostile_history(
        [("join-node-no-credentials", "OK"), ("join-node-no-credentials", "UNAUTHENTICATED"), ("burst", "OK")],
        must_refuse=["join-node-no-credentials"],
    )
    result = check(history, stored("a", [0, 1]), [], n_shards=2)
    assert result.violation_counts() == {"hostile-accepted": 1}
    assert result.counts["hostile_accepted"] == 1


def test_the_hostile_log_keeps_a_bounded_number_of_answers_to_judge() -> None:
    history = hostile_history([("x", "INTERNAL")] * 1005)
    assert history.hostile is not None
    assert len(history.hostile.answers) == 1000 and history.hostile.dropped == 5
    result = check(history, stored("a", [0, 1]), [], n_shards=2)
    assert len(result.of_kind("hostile-internal")) == 1001
    assert result.counts["hostile_internal"] == 1005


def test_the_hostile_requests_are_what_they_claim() -> None:
    from google.protobuf.message import DecodeError

    from mqds.chaos import hostile
    from mqds.v1 import cluster_pb2 as clpb
    from mqds.v1 import sessions_pb2 as spb
    from mqds.v1 import storage_pb2 as pb

    fake = cast(hostile.HostileClients, type("H", (), {"n_shards": 4, "deep_position": None})())
    kinds = [r.kind for r in hostile.REQUESTS]
    assert len(kinds) == len(set(kinds))
    by_kind = {r.kind: r for r in hostile.REQUESTS}
    deep = pb.StoreBatchRequest.FromString(by_kind["deep-topic-store"].build(fake)).messages[0].topic
    assert deep.count("/") + 1 == 1500 and not matches(TOPIC_FILTER_OF_RUN, deep)
    ack = spb.AckRequest.FromString(by_kind["deep-topic-queue-ack"].build(fake))
    assert ack.topic_filter == deep and ack.mode == spb.QUEUE
    assert len(pb.GetFencesRequest.FromString(by_kind["get-fences-200k-shards"].build(fake)).shards) == 200_000
    for r in hostile.REQUESTS:
        raw = r.build(fake)
        if "garbage" in r.kind:
            with pytest.raises(DecodeError):
                pb.StoreBatchRequest.FromString(raw)
    # Admin calls without credentials must be refused; those with the secret name nothing that exists, so
    # none of them can destroy data (and an OK answer to any of them fails the run too).
    assert by_kind["join-node-no-credentials"].must_refuse and not by_kind["join-node-no-credentials"].secret
    for r in hostile.REQUESTS:
        if r.secret and "garbage" not in r.kind:
            assert r.must_refuse, r.kind
        if r.method in ("LeaveNode", "ForgetNode") and "garbage" not in r.kind:
            assert clpb.LeaveNodeRequest.FromString(r.build(fake)).node_id == "ghost"
        if r.method == "DropGeneration" and "garbage" not in r.kind:
            assert pb.DropGenerationRequest.FromString(r.build(fake)).shard >= 4
    assert any(r.burst > 16 for r in hostile.REQUESTS)


TOPIC_FILTER_OF_RUN = "chaos/#"


# -- idle spells: pausing the workload, and the outage of a fault that paused it ---------------


def test_a_fault_that_paused_the_workload_is_measured_from_the_resumption() -> None:
    history = History()
    history.acked.update({("a", i): Ack(0, i, 0.1 * i) for i in range(30)})  # until 2.9 ...
    history.acked.update({("a", i): Ack(0, i, 0.1 * i + 10.0) for i in range(30, 60)})  # ... again from 13.0
    fault = FaultRecord(1, "idle-restart", ["n2"], "", started=3.0, healed=11.0, recovered=12.0)
    fault.affected_shards = [0]
    history.faults.append(fault)
    history.workload_ended = 20.0
    (outage,) = write_outages(history, n_shards=1, settle_s=1.0)
    assert outage.affected[0] == pytest.approx(10.0)  # the idle spell, had it not paused the workload
    fault.paused_at, fault.resumed_at = 3.0, 12.5
    (outage,) = write_outages(history, n_shards=1, settle_s=1.0)
    assert outage.affected[0] == pytest.approx(0.5)  # from the resumption to the first acknowledgement
    assert fault.end == 12.5
    run = {"seed": 1, "nodes": 3, "shards": 1, "nemeses": ["idle-restart"], "elapsed_s": 1.0, "duration_s": 1.0}
    text = text_report({**run, "network": "hook", "readers": 0}, check(history, None, [], 1), [fault])
    assert "workload paused 9.5s" in text


def test_the_workload_pause_waits_for_the_unit_in_flight_and_holds_the_next() -> None:
    from mqds.chaos.workload import PauseGate, WorkloadPause

    gate = PauseGate()
    stop = threading.Event()
    in_unit = threading.Event()
    release = threading.Event()
    units: list[float] = []

    def worker() -> None:
        while gate.enter(stop):
            try:
                in_unit.set()
                release.wait(5)
                units.append(time.monotonic())
            finally:
                gate.leave()
            time.sleep(0.01)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    assert in_unit.wait(5)
    pause = WorkloadPause(History())
    pause.add("w", gate)
    # The unit in flight does not finish within the bound: the pause says so.
    assert pause.pause(0.2) == ["w"] and pause.paused
    release.set()
    assert gate.wait_quiet(5)
    held = len(units)
    time.sleep(0.3)
    assert len(units) == held, "a unit began while paused"
    assert pause.resume() is not None and not pause.paused
    deadline = time.monotonic() + 5
    while len(units) == held and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(units) > held
    # Stopping while paused ends the worker.
    pause.pause(5)
    stop.set()
    thread.join(5)
    assert not thread.is_alive()


def test_the_idle_and_hostile_options() -> None:
    opts, _ = runner.parse_options(["--raft-compaction-interval-s", "2", "--no-hostile", "--seed", "1"])
    assert opts.raft_compaction_interval_s == 2.0 and opts.idle_s == 6.0 and opts.hostile is False
    opts, _ = runner.parse_options(["--seed", "1", "--nemesis", "idle-restart,idle-restart-all"])
    assert opts.hostile is True and opts.raft_compaction_interval_s == 3.0
    assert opts.nemeses == ["idle-restart", "idle-restart-all"]
    assert runner.main(["--raft-compaction-interval-s", "0"]) == runner.EXIT_USAGE
    assert NEMESES["idle-restart"]().max_hold_s() <= 2.0
