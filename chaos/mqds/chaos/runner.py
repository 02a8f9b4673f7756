"""``python -m mqds.chaos``: start a cluster, run the workload under faults, heal, drain, check, report.

The nodes run with small Raft logs and segments and a short Raft compaction
interval (``--raft-compaction-interval-s``, 3 s), so logs compact all the
time and an idle spell of a few seconds is enough for the ``idle-restart``
nemeses: they pause the workload's writers (:class:`WorkloadPause`) for
twice the interval plus 2 s, restart one node or all of them, and the runner
resumes the workload once the cluster is ready again. Hostile clients
(``--hostile``, on by default; :mod:`mqds.chaos.hostile`) send odd and
malicious requests over raw gRPC beside the workload for the whole run; the
checker fails the run on an INTERNAL or UNKNOWN answer to any of them, and
the report counts their answers per request kind and status.

:func:`main` is the entry point (``main(argv) -> exit code``): 0 when the
checker found nothing wrong, 1 on any violation, 2 for bad options, 3 when the
run itself could not be carried out (the cluster did not start, the network
could not be set up). :func:`run` does the work and returns the report, for
tests.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc

from mqds.chaos import nemesis as nem
from mqds.chaos.checker import CheckResult, Convergence, Finding, ReplicaState, check
from mqds.chaos.cluster import ChaosCluster
from mqds.chaos.history import TOPIC_FILTER, TOPIC_ROOT, FaultRecord, History, ReadMessage, parse_message
from mqds.chaos.hostile import HostileClients
from mqds.chaos.network import NetworkError, make_network
from mqds.chaos.report import json_report, text_report
from mqds.chaos.workload import (
    QUEUE_BATCH,
    QUEUE_INTERVAL_S,
    QUEUE_SENDER,
    Publisher,
    PubsubConsumer,
    QueueConsumer,
    Reader,
    SessionConsumer,
    WorkloadPause,
    senders_for_shards,
)
from mqds.client import Client
from mqds.client import errors as E
from mqds.server.raft.group import META_GROUP
from mqds.v1 import cluster_pb2 as clpb

log = logging.getLogger(__name__)

EXIT_PASSED, EXIT_VIOLATION, EXIT_USAGE, EXIT_HARNESS = 0, 1, 2, 3
PROG = "python -m mqds.chaos"

# Bounds of the phases after the faults (every wait of a run is bounded).
READY_TIMEOUT_S = 120.0
CONVERGE_TIMEOUT_S = 120.0
FINAL_READ_TIMEOUT_S = 120.0


class HarnessError(RuntimeError):
    """The run could not be carried out (not a finding about the cluster)."""


@dataclass
class Options:
    duration_s: float = 120.0
    nemeses: list[str] = field(default_factory=lambda: list(nem.NEMESES))
    nodes: int = 5
    shards: int = 8
    seed: int = 0
    network: str = "auto"
    multi_publishers: int = 2
    readers: int = 2
    pubsub_consumers: int = 2
    queue_consumers: int = 2
    consumer_poll_s: float = 2.0
    batch: int = 10
    interval_s: float = 0.05
    call_timeout_s: float = 3.0
    hold_s: tuple[float, float] = (3.0, 8.0)
    quiet_s: tuple[float, float] = (2.0, 5.0)
    drain_timeout_s: float = 60.0
    generation_interval_s: float = 20.0
    raft_log_max_bytes: int = 64 * 1024
    raft_segment_bytes: int = 1024 * 1024
    raft_compaction_interval_s: float = 3.0
    hostile: bool = True
    hostile_interval_s: float = 0.5
    work_dir: Path | None = None
    keep: bool = False
    report_json: Path | None = None
    progress_s: float = 5.0

    @property
    def idle_s(self) -> float:
        """The idle-restart nemeses' idle spell: two compaction intervals and 2 s."""
        return 2 * self.raft_compaction_interval_s + 2.0


def _range(text: str) -> tuple[float, float]:
    low, sep, high = text.partition("-")
    try:
        a = float(low)
        b = float(high) if sep else a
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds, or MIN-MAX") from None
    if a < 0 or b < a:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 0 <= MIN <= MAX")
    return a, b


def _nemeses(text: str) -> list[str]:
    if text == "mix":
        return list(nem.NEMESES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in nem.NEMESES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown nemesis {', '.join(unknown) or text!r}; choose from {', '.join(nem.NEMESES)} or 'mix'"
        )
    return list(dict.fromkeys(names))


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    nemesis_help = "; ".join(f"{name}: {cls.description}" for name, cls in nem.NEMESES.items())
    parser = argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Start a real multi-process mqds cluster, write and read it while injecting faults, heal, drain, and "
            "check the history: every acknowledged message read back, nothing unexpected, no duplicates, each "
            "sender's messages in order, replicas identical, every acknowledged message delivered to the "
            "persistent-session consumers (redeliveries counted); report how long writes stopped per fault. Exit code "
            "0 = passed, 1 = a violation, 2 = bad options, 3 = the run could not be carried out."
        ),
        epilog="nemeses:\n  " + "\n  ".join(f"{n:<16} {cls.description}" for n, cls in nem.NEMESES.items()),
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds of faults under load; faults go on past it until every chosen nemesis ran once (default 120)",
    )
    parser.add_argument(
        "--nemesis",
        type=_nemeses,
        default="mix",
        metavar="LIST",
        help="'mix' (all, in a seeded order, each once per cycle), one nemesis, or a comma list. " + nemesis_help,
    )
    parser.add_argument("--nodes", type=int, default=5, metavar="N", help="nodes in the cluster, 3 or more (default 5)")
    parser.add_argument("--shards", type=int, default=8, metavar="N", help="vnodes, 3 replicas each (default 8)")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="N",
        help="seed of the fault schedule (order, hold times, targets); printed, so a run can be replayed "
        "(default: random)",
    )
    parser.add_argument("--report-json", type=Path, metavar="PATH", help="also write the report as JSON to PATH")
    parser.add_argument(
        "--network",
        choices=("auto", "netns", "hook"),
        default="auto",
        help="netns: each node in its own network namespace, partitions are tc filters (needs root, ip, tc); "
        "hook: nodes on loopback, partitions through the nodes' Raft fault hook; auto: netns when possible "
        "(default auto)",
    )
    parser.add_argument(
        "--multi-publishers",
        type=int,
        default=2,
        metavar="N",
        help="publishers whose every call spans three shards, besides one publisher per shard (default 2)",
    )
    parser.add_argument(
        "--readers", type=int, default=2, metavar="N", help="readers tailing with iterators; odd ones stale_ok (2)"
    )
    parser.add_argument(
        "--pubsub-consumers",
        type=int,
        default=2,
        metavar="N",
        help="persistent-session consumers with their own read position on chaos/#: fetch_offline, ack (2)",
    )
    parser.add_argument(
        "--queue-consumers",
        type=int,
        default=2,
        metavar="N",
        help="consumers sharing queue mode on the topics of a slow sender of their own: fetch_offline, ack each (2)",
    )
    parser.add_argument(
        "--consumer-poll",
        type=float,
        default=2.0,
        metavar="S",
        help="once caught up, a consumer fetches every S seconds; each fetch reads every shard, and acks are Raft "
        "writes, so a shorter S costs the publishers throughput (2)",
    )
    parser.add_argument("--batch", type=int, default=10, metavar="N", help="messages per store_batch call (10)")
    parser.add_argument(
        "--interval", type=float, default=0.05, metavar="S", help="pause of each publisher between calls (0.05)"
    )
    parser.add_argument(
        "--call-timeout",
        type=float,
        default=3.0,
        metavar="S",
        help="deadline of each store_batch call; a call that runs out is retried with its sequence (default 3)",
    )
    parser.add_argument(
        "--hold", type=_range, default=(3.0, 8.0), metavar="MIN-MAX", help="how long a fault lasts, s (3-8)"
    )
    parser.add_argument(
        "--quiet", type=_range, default=(2.0, 5.0), metavar="MIN-MAX", help="time between faults, s (2-5)"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="after the faults, how long publishers may keep retrying unacknowledged calls (default 60)",
    )
    parser.add_argument(
        "--generation-interval",
        type=float,
        default=20.0,
        metavar="S",
        help="the nodes' generation_interval_s: generations turn during the run, and clock skew moves them (20)",
    )
    parser.add_argument(
        "--raft-log-max-bytes",
        type=int,
        default=64 * 1024,
        metavar="N",
        help="the nodes' raft_log_max_bytes: small, so logs compact and a wiped node needs a snapshot (65536)",
    )
    parser.add_argument(
        "--raft-segment-bytes",
        type=int,
        default=1024 * 1024,
        metavar="N",
        help="the nodes' raft_segment_bytes: small, so the Raft log starts new segments and deletes old ones "
        "while nodes are killed (1048576)",
    )
    parser.add_argument(
        "--raft-compaction-interval-s",
        type=float,
        default=3.0,
        metavar="S",
        help="the nodes' raft_compaction_interval_s: short, so the idle-restart nemeses' idle spell (twice this "
        "plus 2 s, with no writes) outlasts it and every group compacts while idle (3)",
    )
    parser.add_argument(
        "--hostile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hostile clients beside the workload for the whole run: deep topics, thousands of repeated shards, "
        "empty batches, garbage bytes, admin calls without credentials (and some with the secret, invalid), "
        "bursts of slow calls on one connection, over raw gRPC; any INTERNAL or UNKNOWN answer fails the run "
        "(default on)",
    )
    parser.add_argument(
        "--hostile-interval",
        type=float,
        default=0.5,
        metavar="S",
        help="seconds between two hostile requests (0.5)",
    )
    parser.add_argument(
        "--work-dir", type=Path, metavar="DIR", help="where the nodes' data and logs go (default: a new temp dir)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work dir (it is always kept when the run fails)")
    parser.add_argument(
        "--progress", type=float, default=5.0, metavar="S", help="seconds between progress lines; 0 = none (5)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the harness does (to stderr)")
    return parser


def parse_options(argv: Sequence[str] | None, prog: str = PROG) -> tuple[Options, argparse.Namespace]:
    parser = build_parser(prog)
    ns = parser.parse_args(argv)
    if ns.nodes < 3:
        parser.error("--nodes must be 3 or more (a majority must survive a minority failing)")
    counts = (ns.readers, ns.multi_publishers, ns.pubsub_consumers, ns.queue_consumers)
    if ns.shards < 1 or ns.batch < 1 or min(counts) < 0:
        parser.error(
            "--shards and --batch must be 1 or more; --readers, --multi-publishers, --pubsub-consumers and "
            "--queue-consumers 0 or more"
        )
    if ns.consumer_poll <= 0:
        parser.error("--consumer-poll must be greater than 0")
    if ns.duration <= 0 or ns.call_timeout <= 0 or ns.drain_timeout <= 0:
        parser.error("--duration, --call-timeout and --drain-timeout must be greater than 0")
    if ns.raft_compaction_interval_s <= 0 or ns.hostile_interval <= 0:
        parser.error("--raft-compaction-interval-s and --hostile-interval must be greater than 0")
    opts = Options(
        duration_s=ns.duration,
        nemeses=ns.nemesis if isinstance(ns.nemesis, list) else _nemeses(ns.nemesis),
        nodes=ns.nodes,
        shards=ns.shards,
        seed=ns.seed if ns.seed is not None else random.SystemRandom().randrange(1, 2**31),
        network=ns.network,
        multi_publishers=ns.multi_publishers,
        readers=ns.readers,
        pubsub_consumers=ns.pubsub_consumers,
        queue_consumers=ns.queue_consumers,
        consumer_poll_s=ns.consumer_poll,
        batch=ns.batch,
        interval_s=ns.interval,
        call_timeout_s=ns.call_timeout,
        hold_s=ns.hold,
        quiet_s=ns.quiet,
        drain_timeout_s=ns.drain_timeout,
        generation_interval_s=ns.generation_interval,
        raft_log_max_bytes=ns.raft_log_max_bytes,
        raft_segment_bytes=ns.raft_segment_bytes,
        raft_compaction_interval_s=ns.raft_compaction_interval_s,
        hostile=ns.hostile,
        hostile_interval_s=ns.hostile_interval,
        work_dir=ns.work_dir,
        keep=ns.keep,
        report_json=ns.report_json,
        progress_s=ns.progress,
    )
    return opts, ns


@dataclass
class Report:
    """What a run produced."""

    run: dict[str, Any]
    result: CheckResult
    faults: list[FaultRecord]
    text: str
    json: dict[str, Any]
    work_dir: Path

    @property
    def passed(self) -> bool:
        return self.result.passed


class ChaosRun:
    """One run: its cluster, workload, schedule and history."""

    def __init__(self, opts: Options, out: TextIO = sys.stderr) -> None:
        self.opts = opts
        self.out = out
        self.history = History()
        self.harness_findings: list[Finding] = []
        self.current = "starting"
        self.publishers: list[Publisher] = []
        self.readers: list[Reader] = []
        self.consumers: list[SessionConsumer] = []
        self.hostile: HostileClients | None = None
        self.pause = WorkloadPause(self.history)
        self._progress_stop = threading.Event()
        self.cluster: ChaosCluster | None = None

    # -- output --------------------------------------------------------------------

    def say(self, text: str) -> None:
        print(f"[{self.history.clock():7.1f}s] {text}", file=self.out, flush=True)

    def _progress(self) -> None:
        while not self._progress_stop.wait(self.opts.progress_s):
            c = self.history.counts()
            reads = sum(r.read for r in self.readers)
            hostile = self.history.hostile
            bad = f" ({len(hostile.answers)} bad)" if hostile and hostile.answers else ""
            self.say(
                f"acked {c['acked']:,}/{c['attempted']:,} msgs, calls unknown {c['calls_unknown']:,} "
                f"partial {c['calls_partial']:,} failed {c['calls_failed']:,} | read {reads:,} | "
                f"delivered {c['consumer_deliveries']:,} | "
                + (f"hostile {hostile.sent:,}{bad} | " if hostile else "")
                + f"faults {len(self.history.faults)} | {self.current}"
            )

    # -- the phases -------------------------------------------------------------------

    def _client(self) -> Client:
        assert self.cluster is not None
        return self.cluster.client(timeout_s=self.opts.call_timeout_s)

    def _start_workload(self) -> None:
        opts = self.opts
        shards = list(range(opts.shards))
        for sender in senders_for_shards("pub", opts.shards, shards):
            self.publishers.append(self._publisher(sender, [sender]))
        for i in range(opts.multi_publishers):
            picks = [(i * 3 + k) % opts.shards for k in range(3)]
            senders = senders_for_shards(f"multi{i}-", opts.shards, sorted(set(picks)))
            self.publishers.append(self._publisher(f"multi{i}", senders))
        if opts.queue_consumers:
            # The queue consumers' topics: a sender of their own, written slowly (see QueueConsumer).
            self.publishers.append(
                self._publisher(QUEUE_SENDER, [QUEUE_SENDER], batch=QUEUE_BATCH, interval_s=QUEUE_INTERVAL_S)
            )
        for i in range(opts.readers):
            self.readers.append(Reader(f"reader{i}", self._client, self.history, stale_ok=i % 2 == 1))
        self._make_consumers()
        if opts.hostile:
            assert self.cluster is not None
            self.hostile = HostileClients(
                self.cluster, self.history, opts.shards, seed=opts.seed, interval_s=opts.hostile_interval_s
            )
            self.pause.add("hostile", self.hostile.gate)
        for publisher in self.publishers:
            self.pause.add(publisher.name, publisher.gate)
            publisher.start()
        for reader in self.readers:
            reader.start()
        for consumer in self.consumers:
            self.pause.add(consumer.name, consumer.gate)
            consumer.start()
        if self.hostile is not None:
            self.hostile.start()

    def _make_consumers(self) -> None:
        """The pubsub consumers on ``chaos/#``; the queue consumers on the queue sender's topics (see QueueConsumer)."""
        opts = self.opts
        # max_count: a turn's worth of messages in one fetch (the publishers write several hundred a second).
        for i in range(opts.pubsub_consumers):
            self.consumers.append(
                PubsubConsumer(
                    f"chaos-sub-{i + 1}", self._client, self.history, max_count=2000, poll_s=opts.consumer_poll_s
                )
            )
        for i in range(opts.queue_consumers):
            self.consumers.append(
                QueueConsumer(
                    f"chaos-queue-{i + 1}",
                    self._client,
                    self.history,
                    topic_filter=f"{TOPIC_ROOT}/{QUEUE_SENDER}/#",
                    max_count=100,
                    poll_s=opts.consumer_poll_s,
                    phase_s=opts.consumer_poll_s * i / opts.queue_consumers,
                )
            )

    def _publisher(
        self, name: str, senders: list[str], *, batch: int | None = None, interval_s: float | None = None
    ) -> Publisher:
        return Publisher(
            name,
            senders,
            self._client,
            self.history,
            self.opts.shards,
            batch=self.opts.batch if batch is None else batch,
            interval_s=self.opts.interval_s if interval_s is None else interval_s,
            call_timeout_s=self.opts.call_timeout_s,
        )

    def _check_nodes(self, env: nem.Env) -> None:
        """Any node that should run but exited on its own is a crash: record it and start it again."""
        assert self.cluster is not None
        for node_id, proc in list(self.cluster.nodes.items()):
            if proc.running:
                continue
            tail = proc.output()[-1500:]
            self.harness_findings.append(
                Finding("node-crashed", f"{node_id} exited by itself (log tail: {tail!r})", where=self.current)
            )
            self.say(f"node {node_id} exited by itself; starting it again")
            try:
                env.start(node_id)
            except (RuntimeError, TimeoutError) as err:
                self.harness_findings.append(Finding("node-crashed", f"{node_id} does not start again: {err}"))

    def _wait_ready(self, what: str) -> bool:
        assert self.cluster is not None
        try:
            self.cluster.wait_ready(READY_TIMEOUT_S)
            return True
        except (TimeoutError, grpc.RpcError, RuntimeError) as err:
            detail = str(err)
            try:
                leaderless = sorted(set(range(self.opts.shards)) - set(self.cluster.leaders()))
                detail = f"vnodes without a leader: {leaderless or 'none'}; {err}"
                detail += "; " + self._raft_states(leaderless)
                detail += "; " + self._unready_states()
            except (grpc.RpcError, RuntimeError):
                pass
            self.harness_findings.append(
                Finding("not-recovered", f"{what}: the cluster was not ready within {READY_TIMEOUT_S:g}s: {detail}")
            )
            self.say(f"{what}: cluster not ready after {READY_TIMEOUT_S:g}s ({detail})")
            return False

    def _raft_states(self, shards: list[int]) -> str:
        """What each live replica of ``shards`` says about its group (for a finding's detail)."""
        return "; ".join(self._replica_states(lambda status, r: r.group in shards))

    def _unready_states(self) -> str:
        """Each replica of each live node that is not ready: its Raft state (for a finding's detail)."""
        return "; ".join(self._replica_states(lambda status, r: not status.ready)) or "every live node is ready"

    def _replica_states(self, wanted: Callable[[clpb.NodeStatus, clpb.ReplicaStatus], bool]) -> list[str]:
        """One line per replica of the live nodes that ``wanted(status, replica)`` picks."""
        assert self.cluster is not None
        states = []
        for node_id in self.cluster.live():
            try:
                status = self.cluster.status(node_id, timeout_s=2)
            except grpc.RpcError:
                states.append(f"{node_id}: no answer")
                continue
            states += [
                f"{node_id}{'' if status.ready else ' (not ready)'}/"
                f"{'meta' if r.group == META_GROUP else f'shard {r.group}'}: role {r.role} term {r.term} "
                f"leader {r.leader or '-'} members {','.join(r.members)} log {r.last_log_index} "
                f"commit {r.commit_index} applied {r.applied_index}"
                for r in status.replicas
                if wanted(status, r)
            ]
        return states

    def _faults(self, env: nem.Env) -> None:
        opts = self.opts
        schedule = nem.Schedule(opts.nemeses, opts.seed, opts.hold_s, opts.quiet_s)
        ran: set[str] = set()
        started = self.history.clock()
        # Past the duration only to give every nemesis its turn; never more than twice as long.
        while True:
            elapsed = self.history.clock() - started
            if elapsed >= opts.duration_s and (ran >= set(opts.nemeses) or elapsed >= 2 * opts.duration_s + 300):
                break
            planned = next(schedule)
            self.current = f"quiet before #{planned.index} {planned.nemesis}"
            time.sleep(planned.quiet_s)
            self._check_nodes(env)
            self._one_fault(env, planned)
            ran.add(planned.nemesis)

    def _one_fault(self, env: nem.Env, planned: nem.Planned) -> None:
        nemesis = nem.NEMESES[planned.nemesis]()
        hold = min(max(planned.hold_s, nemesis.min_hold_s()), nemesis.max_hold_s())
        fault = FaultRecord(planned.index, planned.nemesis, [], "", started=self.history.clock())
        self.current = f"fault #{planned.index} {planned.nemesis} (injecting)"
        try:
            injection = nemesis.inject(env, planned.rng)
        except Exception as err:
            fault.error = f"inject failed: {err}"
            self.say(f"#{planned.index} {planned.nemesis}: inject failed: {err}")
            log.debug("inject failed", exc_info=True)
            self.harness_findings.append(Finding("fault-error", f"#{planned.index} {planned.nemesis}: {err}"))
        else:
            fault.targets, fault.detail, fault.affected_shards = (
                injection.targets,
                injection.detail,
                injection.affected_shards,
            )
        self.history.add_fault(fault)
        self.say(
            f"#{fault.index} {fault.nemesis} on {','.join(fault.targets) or '-'}: {fault.detail} "
            f"(vnodes hit: {fault.affected_shards or '-'}); holding {hold:.1f}s"
        )
        self.current = f"fault #{fault.index} {fault.nemesis} on {','.join(fault.targets) or '-'}"
        time.sleep(hold)
        try:
            fault.notes += nemesis.heal(env)
        except nem.NotRecovered as err:
            fault.error = (fault.error + "; " if fault.error else "") + f"not recovered: {str(err)[:300]}"
            self.say(f"#{fault.index} {fault.nemesis}: {err}")
            self.harness_findings.append(Finding("not-recovered", f"#{fault.index} {fault.nemesis}: {err}"))
        except Exception as err:
            fault.error = (fault.error + "; " if fault.error else "") + f"heal failed: {err}"
            self.say(f"#{fault.index} heal failed: {err}")
            self.harness_findings.append(Finding("fault-error", f"#{fault.index} {fault.nemesis} heal: {err}"))
        fault.healed = self.history.clock()
        self.current = f"recovering from #{fault.index} {fault.nemesis}"
        self._check_nodes(env)
        if self._wait_ready(f"after fault #{fault.index} {fault.nemesis}"):
            fault.recovered = self.history.clock()
        if fault.nemesis == "wipe-node" and fault.targets:
            fault.notes.append(self._snapshots_note(fault.targets[0]))
        self.say(
            f"#{fault.index} healed after {fault.healed - fault.started:.1f}s, "
            f"ready {(fault.recovered or fault.healed) - fault.healed:.1f}s later"
        )
        if self.pause.paused:
            fault.paused_at = self.pause.resume()
            fault.resumed_at = self.history.clock()
            self.say(
                f"#{fault.index} workload resumed, {fault.resumed_at - (fault.paused_at or 0):.1f}s after its pause"
            )

    def _snapshots_note(self, node_id: str) -> str:
        assert self.cluster is not None
        try:
            status = self.cluster.status(node_id)
        except grpc.RpcError as err:
            return f"status of {node_id} unavailable: {err.code()}"
        installed = sum(r.snapshots_installed for r in status.replicas if r.group < self.opts.shards)
        return f"{node_id} installed {installed} snapshot(s)"

    def _heal_everything(self, env: nem.Env) -> None:
        """After the last fault: every node running, resumed and connected."""
        assert self.cluster is not None
        self.pause.resume()
        for node_id in list(self.cluster.paused):
            self.cluster.resume(node_id)
        self._check_nodes(env)
        try:
            self.cluster.network.heal(self.cluster.live())
        except (grpc.RpcError, NetworkError) as err:
            self.say(f"healing the network failed: {err}")
        self._wait_ready("after the last fault")

    def _drain(self) -> None:
        self.current = "draining"
        if self.hostile is not None:
            self.hostile.stop()
        for p in self.publishers:
            p.stop.set()
        deadline = time.monotonic() + self.opts.drain_timeout_s
        for p in self.publishers:
            p.thread.join(max(0.0, deadline - time.monotonic()))
        for p in self.publishers:
            p.abandon.set()
        for p in self.publishers:
            p.thread.join(self.opts.call_timeout_s + 10)
            if p.thread.is_alive():
                self.harness_findings.append(Finding("fault-error", f"publisher {p.name} did not stop"))
        self.history.workload_ended = self.history.clock()
        if self.hostile is not None:
            self.hostile.thread.join(30)
            if self.hostile.thread.is_alive():
                self.harness_findings.append(Finding("fault-error", "the hostile clients did not stop"))
        # Consumers go on until a fetch begun from now on comes back empty: they got everything.
        for consumer in self.consumers:
            consumer.finish()
        # Give the readers a moment to catch up with the last writes, then stop them.
        time.sleep(2.0)
        for reader in self.readers:
            reader.stop()
        for r in self.readers:
            r.thread.join(15)
        self._drain_consumers()

    def _drain_consumers(self) -> None:
        """Wait (``--drain-timeout`` at most) for every consumer to fetch nothing new, then stop them."""
        self.current = "draining the consumers"
        deadline = time.monotonic() + self.opts.drain_timeout_s
        for c in self.consumers:
            c.thread.join(max(0.0, deadline - time.monotonic()))
        for c in self.consumers:
            if c.thread.is_alive():
                self.say(f"consumer {c.name} had not fetched everything {self.opts.drain_timeout_s:g}s into the drain")
                c.stop()
        for c in self.consumers:
            c.thread.join(self.opts.call_timeout_s + 10)
            if c.thread.is_alive():
                self.harness_findings.append(Finding("fault-error", f"consumer {c.name} did not stop"))

    def _final_read(self) -> tuple[list[ReadMessage] | None, int]:
        """Everything stored, from the leaders; from any replica if some vnode has no leader (a finding)."""
        self.current = "reading everything back"
        last: Exception | None = None
        deadline = time.monotonic() + FINAL_READ_TIMEOUT_S
        for stale_ok in (False, True):
            while True:
                try:
                    final = self._replay(stale_ok)
                except E.MqdsError as err:
                    last = err
                    if time.monotonic() > deadline:
                        break
                    self.say(f"final read failed ({err}); again")
                    time.sleep(5)
                    continue
                if stale_ok:
                    self.harness_findings.append(
                        Finding("unreadable", f"no linearizable read of everything after healing: {last}")
                    )
                return final
            deadline = time.monotonic() + FINAL_READ_TIMEOUT_S / 2
        self.harness_findings.append(Finding("unreadable", f"could not read everything back, even stale: {last}"))
        return None, 0

    def _replay(self, stale_ok: bool) -> tuple[list[ReadMessage], int]:
        with self._client() as client:
            out: list[ReadMessage] = []
            bad = 0
            for m in client.replay(TOPIC_FILTER, batch_size=5000, stale_ok=stale_ok):
                key = parse_message(m.topic, m.payload)
                if key is None:
                    bad += 1
                    continue
                out.append(ReadMessage(key[0], key[1], int(m.shard or 0), int(m.timestamp_us or 0)))
            return out, bad

    def _convergence(self) -> list[Convergence]:
        self.current = "checking replicas"
        cluster = self.cluster
        assert cluster is not None
        deadline = time.monotonic() + CONVERGE_TIMEOUT_S
        out = []
        for shard in range(self.opts.shards):
            while True:
                detail = ""
                states: list[ReplicaState] = []
                try:
                    replicas = cluster.placement()[shard]
                    digests = cluster.digests(shard)
                    states = [
                        ReplicaState(n, d.applied_index, d.sha256, d.keys) for n, d in digests.items() if n in replicas
                    ]
                    missing = sorted(set(replicas) - set(digests))
                    if missing:
                        detail = f"no digest from {missing}"
                    converged = not missing and len({(s.applied_index, s.sha256) for s in states}) == 1
                except (grpc.RpcError, RuntimeError) as err:
                    converged, detail = False, f"digest failed: {err}"
                if converged or time.monotonic() > deadline:
                    out.append(Convergence(shard, converged, states, detail))
                    break
                time.sleep(0.5)
        return out

    # -- the whole run -------------------------------------------------------------------

    def execute(self) -> Report:
        opts = self.opts
        work = opts.work_dir or Path(tempfile.mkdtemp(prefix="mqds-chaos-"))
        work.mkdir(parents=True, exist_ok=True)
        try:
            network = make_network(opts.network)
        except NetworkError as err:
            raise HarnessError(str(err)) from None
        progress = threading.Thread(target=self._progress, name="chaos-progress", daemon=True)
        failed = True
        run_info: dict[str, Any] = {}
        try:
            self.say(
                f"seed {opts.seed}: {opts.nodes} nodes, {opts.shards} shards, network {network.kind}, "
                f"nemeses {','.join(opts.nemeses)}; work dir {work}"
            )
            args = [
                f"--raft-log-max-bytes={opts.raft_log_max_bytes}",
                f"--raft-segment-bytes={opts.raft_segment_bytes}",
                f"--generation-interval-s={opts.generation_interval_s}",
                f"--raft-compaction-interval-s={opts.raft_compaction_interval_s}",
            ]
            try:
                self.cluster = ChaosCluster(
                    work / "cluster", opts.nodes, network=network, n_shards=opts.shards, args=args
                )
                self.cluster.start(READY_TIMEOUT_S)
            except (RuntimeError, TimeoutError, OSError, NetworkError) as err:
                raise HarnessError(f"the cluster did not start: {err}") from None
            env = nem.Env(
                self.cluster,
                self.history,
                self.say,
                opts.generation_interval_s,
                workload=self.pause,
                compaction_interval_s=opts.raft_compaction_interval_s,
                idle_s=opts.idle_s,
                pause_timeout_s=2 * opts.call_timeout_s + 10,
            )
            self._start_workload()
            if opts.progress_s > 0:
                progress.start()
            time.sleep(3.0)  # writes flowing before the first fault
            began = self.history.clock()
            self._faults(env)
            self.current = "healing"
            self._heal_everything(env)
            self._drain()
            final, unparsable = self._final_read()
            convergence = self._convergence()
            self._progress_stop.set()
            result = check(self.history, final, convergence, opts.shards, unparsable)
            result.findings.extend(self.harness_findings)
            run_info = {
                "seed": opts.seed,
                "nodes": opts.nodes,
                "shards": opts.shards,
                "nemeses": opts.nemeses,
                "duration_s": opts.duration_s,
                "elapsed_s": round((self.history.workload_ended or self.history.clock()) - began, 1),
                "network": network.kind,
                "publishers": len(self.publishers),
                "readers": len(self.readers),
                "session_consumers": len(self.consumers),
                "consumer_poll_s": opts.consumer_poll_s,
                "batch": opts.batch,
                "call_timeout_s": opts.call_timeout_s,
                "generation_interval_s": opts.generation_interval_s,
                "raft_compaction_interval_s": opts.raft_compaction_interval_s,
                "idle_s": opts.idle_s,
                "hostile": opts.hostile,
                "work_dir": str(work),
            }
            faults = list(self.history.faults)
            report = Report(
                run_info,
                result,
                faults,
                text_report(run_info, result, faults),
                json_report(run_info, result, faults),
                work,
            )
            failed = not result.passed
            return report
        finally:
            self._progress_stop.set()
            self.pause.resume()
            if self.hostile is not None:
                self.hostile.stop()
            for p in self.publishers:
                p.stop.set()
                p.abandon.set()
            for r in self.readers:
                r.stop()
            for consumer in self.consumers:
                consumer.stop()
            if self.cluster is not None:
                self.cluster.kill_all()
            network.close()
            if failed or opts.keep:
                self.say(f"work dir kept: {work}")
            elif opts.work_dir is None:
                shutil.rmtree(work, ignore_errors=True)


def run(opts: Options, out: TextIO = sys.stderr) -> Report:
    """Carry out one run; raises HarnessError when it cannot be carried out."""
    return ChaosRun(opts, out).execute()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """``python -m mqds.chaos [options]``: the exit code (0 passed, 1 violation, 2 usage, 3 harness failure).

    ``prog`` names the command in the usage text (``mqds chaos`` runs this).
    ``--help`` prints the help and exits with SystemExit(0), as every argparse
    command does; bad options print why and return 2.
    """
    try:
        opts, ns = parse_options(argv, prog)
    except SystemExit as exit_:
        if exit_.code in (0, None):
            raise
        return EXIT_USAGE
    if threading.current_thread() is threading.main_thread():
        # A SIGTERM unwinds like Ctrl-C, so the nodes are killed and the namespaces removed.
        signal.signal(signal.SIGTERM, _interrupt)
    logging.basicConfig(
        level=logging.DEBUG if ns.verbose else logging.WARNING, format="%(asctime)s %(name)s: %(message)s"
    )
    try:
        report = run(opts)
    except HarnessError as err:
        print(f"mqds chaos: the run could not be carried out: {err}", file=sys.stderr)
        return EXIT_HARNESS
    except KeyboardInterrupt:
        print("mqds chaos: interrupted", file=sys.stderr)
        return EXIT_HARNESS
    except Exception:
        traceback.print_exc()
        return EXIT_HARNESS
    print(report.text, end="")
    if opts.report_json is not None:
        opts.report_json.parent.mkdir(parents=True, exist_ok=True)
        opts.report_json.write_text(json.dumps(report.json, indent=2) + "\n")
        print(f"JSON report: {opts.report_json}")
    sys.stdout.flush()
    return EXIT_PASSED if report.passed else EXIT_VIOLATION


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
