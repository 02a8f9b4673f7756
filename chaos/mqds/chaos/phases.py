"""The phases of a run, in order: start the cluster, start the workload, warm up, the fault
schedule, heal, drain, and the teardown that always follows.

:class:`ChaosRun` holds one run's state (its cluster, workload, history and
the harness's own findings); :func:`mqds.chaos.runner.run` calls its phases
in order and :mod:`mqds.chaos.verify` checks what they left behind.
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import grpc

from mqds.chaos import nemesis as nem
from mqds.chaos.checker import Finding
from mqds.chaos.cluster import ChaosCluster
from mqds.chaos.faultfs import unavailable_reason
from mqds.chaos.history import TOPIC_ROOT, FaultRecord, History
from mqds.chaos.hostile import HostileClients
from mqds.chaos.network import HookNetwork, NetnsNetwork, NetworkError
from mqds.chaos.options import Options
from mqds.chaos.workload import (
    QUEUE_BATCH,
    QUEUE_INTERVAL_S,
    QUEUE_SENDER,
    Follower,
    PipelinedPublisher,
    Publisher,
    PublisherThread,
    PubsubConsumer,
    QueueConsumer,
    Reader,
    SessionConsumer,
    WorkloadPause,
    senders_for_shards,
)
from mqds.client import Client
from mqds.server.raft.group import META_GROUP
from mqds.v1 import cluster_pb2 as clpb

log = logging.getLogger(__name__)

# How long the cluster may take to be ready: at the start, after each fault, after the last one.
READY_TIMEOUT_S = 120.0


class HarnessError(RuntimeError):
    """The run could not be carried out (not a finding about the cluster)."""


class ChaosRun:
    """One run: its cluster, workload, schedule and history."""

    def __init__(self, opts: Options, out: TextIO = sys.stderr) -> None:
        self.opts = opts
        self.out = out
        self.history = History()
        self.harness_findings: list[Finding] = []
        self.current = "starting"
        self.publishers: list[PublisherThread] = []
        self.readers: list[Reader] = []
        self.followers: list[Follower] = []
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
                f"followed {c['follower_deliveries']:,} | delivered {c['consumer_deliveries']:,} | "
                + (f"hostile {hostile.sent:,}{bad} | " if hostile else "")
                + f"faults {len(self.history.faults)} | {self.current}"
            )

    # -- the phases -------------------------------------------------------------------

    def client(self) -> Client:
        assert self.cluster is not None
        return self.cluster.client(timeout_s=self.opts.call_timeout_s)

    @property
    def pipelined_call_timeout_s(self) -> float:
        """The deadline of a pipelined publisher's calls: long enough for the pipeline to resend through a
        fault; the drain closes what is left."""
        return max(self.opts.call_timeout_s, self.opts.drain_timeout_s / 2)

    def start_cluster(self, work: Path, network: HookNetwork | NetnsNetwork) -> nem.Env:
        """Start the nodes (raises HarnessError when they do not start); the nemeses' environment."""
        opts = self.opts
        disk = opts.disk_mode
        self.say(
            f"seed {opts.seed}: {opts.nodes} nodes, {opts.shards} shards, network {network.kind}, disk {disk}, "
            f"nemeses {','.join(opts.nemeses)}; work dir {work}"
        )
        if disk != "off" and (reason := unavailable_reason()) is not None:
            raise HarnessError(f"the disk nemeses need a fault filesystem (FUSE), and there is none: {reason}")
        args = [
            f"--raft-log-max-bytes={opts.raft_log_max_bytes}",
            f"--raft-segment-bytes={opts.raft_segment_bytes}",
            f"--generation-interval-s={opts.generation_interval_s}",
            f"--raft-compaction-interval-s={opts.raft_compaction_interval_s}",
        ]
        try:
            self.cluster = ChaosCluster(
                work / "cluster", opts.nodes, network=network, n_shards=opts.shards, args=args, disk=disk
            )
            self.cluster.start(READY_TIMEOUT_S)
        except (RuntimeError, TimeoutError, OSError, NetworkError) as err:
            raise HarnessError(f"the cluster did not start: {err}") from None
        return nem.Env(
            self.cluster,
            self.history,
            self.say,
            opts.generation_interval_s,
            workload=self.pause,
            compaction_interval_s=opts.raft_compaction_interval_s,
            idle_s=opts.idle_s,
            # A paused worker finishes its unit first: a publisher's batch with a retry (two calls), or a
            # pipelined publisher's wave, whose calls may each take their whole (longer) deadline.
            pause_timeout_s=max(2 * opts.call_timeout_s, self.pipelined_call_timeout_s) + 10,
        )

    def warm_up(self) -> float:
        """Progress lines from now on (unless ``--progress 0``), writes flowing before the first fault;
        the time the faults begin."""
        if self.opts.progress_s > 0:
            threading.Thread(target=self._progress, name="chaos-progress", daemon=True).start()
        time.sleep(3.0)  # writes flowing before the first fault
        return self.history.clock()

    def stop_progress(self) -> None:
        self._progress_stop.set()

    def start_workload(self) -> None:
        """Publishers, readers, session consumers and the hostile clients, each in a thread of its own."""
        opts = self.opts
        shards = list(range(opts.shards))
        for sender in senders_for_shards("pub", opts.shards, shards):
            self.publishers.append(self._publisher(sender, [sender]))
        for i in range(opts.multi_publishers):
            picks = [(i * 3 + k) % opts.shards for k in range(3)]
            senders = senders_for_shards(f"multi{i}-", opts.shards, sorted(set(picks)))
            self.publishers.append(self._publisher(f"multi{i}", senders))
        for i, sender in enumerate(senders_for_shards("piped", opts.shards, shards)[: opts.pipelined_publishers]):
            self.publishers.append(
                PipelinedPublisher(
                    f"piped{i}",
                    sender,
                    self.client,
                    self.history,
                    opts.shards,
                    in_flight=opts.pipeline_in_flight,
                    interval_s=opts.interval_s,
                    call_timeout_s=self.pipelined_call_timeout_s,
                )
            )
        if opts.queue_consumers:
            # The queue consumers' topics: a sender of their own, written slowly (see QueueConsumer).
            self.publishers.append(
                self._publisher(QUEUE_SENDER, [QUEUE_SENDER], batch=QUEUE_BATCH, interval_s=QUEUE_INTERVAL_S)
            )
        for i in range(opts.readers):
            self.readers.append(Reader(f"reader{i}", self.client, self.history, stale_ok=i % 2 == 1))
        for i in range(opts.followers):
            # From the third on, each shares the client of the one two before it (served alike): their
            # subscriptions share its Follow calls, so the nodes send them shared answers (cohorts).
            twin = self.followers[i - 2] if i >= 2 else None
            self.followers.append(
                Follower(f"follower{i}", self.client, self.history, any_replica=i % 2 == 1, share_with=twin)
            )
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
        for follower in self.followers:
            follower.start()
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
                    f"chaos-sub-{i + 1}", self.client, self.history, max_count=2000, poll_s=opts.consumer_poll_s
                )
            )
        for i in range(opts.queue_consumers):
            self.consumers.append(
                QueueConsumer(
                    f"chaos-queue-{i + 1}",
                    self.client,
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
            self.client,
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

    def faults(self, env: nem.Env) -> None:
        """The seeded fault schedule: ``--duration`` of faults, longer until every chosen nemesis ran once."""
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

    def heal_everything(self, env: nem.Env) -> None:
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

    def drain(self) -> None:
        """Stop the writers (unacknowledged calls retried ``--drain-timeout`` at most), then readers and consumers."""
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
        self._drain_followers()
        self._drain_consumers()

    def _drain_followers(self) -> None:
        """Wait (``--drain-timeout`` at most) until every follower was sent every acknowledged message."""
        self.current = "draining the followers"
        deadline = time.monotonic() + self.opts.drain_timeout_s
        for f in self.followers:
            if not f.finish(deadline):
                self.say(f"follower {f.name} had not got everything {self.opts.drain_timeout_s:g}s into the drain")
        for f in self.followers:
            f.thread.join(self.opts.call_timeout_s + 10)
            if f.thread.is_alive():
                self.harness_findings.append(Finding("fault-error", f"follower {f.name} did not stop"))

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

    # -- the end ------------------------------------------------------------------------

    def teardown(self, work: Path, network: HookNetwork | NetnsNetwork, failed: bool) -> None:
        """Whatever happened: stop the workload, kill the nodes, remove the network; keep or remove the work dir."""
        opts = self.opts
        self._progress_stop.set()
        self.pause.resume()
        if self.hostile is not None:
            self.hostile.stop()
        for p in self.publishers:
            p.stop.set()
            p.abandon.set()
        for r in self.readers:
            r.stop()
        for f in self.followers:
            f.stop()
        for consumer in self.consumers:
            consumer.stop()
        if self.cluster is not None:
            self.cluster.kill_all()
            self.cluster.close_disks()
        network.close()
        if failed or opts.keep:
            self.say(f"work dir kept: {work}")
        elif opts.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
