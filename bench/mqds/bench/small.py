"""``mqds bench --small-writes``: the small-write scenarios of "Small writes at full speed", against their targets.

Against one cluster, each round runs every scenario once (with its baseline,
where it has one: the old path at the same concurrency), the order reversed
on every other round, so a slow spell of the machine falls on both sides of a
comparison. The figures of a scenario are those of all its rounds together:

- one writer, 1 msg/call: 1 publisher, blocking StoreBatch calls of one
  message; target p50 at most 2 ms.
- 1-msg calls, 64 in flight: PUBLISHERS processes each keeping IN_FLIGHT
  pipelined ``store_async`` calls of one message outstanding; target
  50,000 msg/s. Baseline: blocking StoreBatch calls of one message from
  IN_FLIGHT threads in each of the same processes.
- 1-msg calls, 1 process x 1000 in flight: one publisher process keeping
  1,000 pipelined ``store_async`` calls of one message outstanding (the
  shape of the peer's pipelined publish: one client process, 1,000 PubAcks
  outstanding); its target is a ratio to the peer.
- ExHook, 64 concurrent OnMessagePublish: an ``mqds exhook`` process (rules
  that store every message) driven by 64 concurrent grpc.aio callers (in two
  processes); target 20,000 msg/s. Ceiling: the same callers against a
  second provider whose rules store nothing, which answers each call at once:
  what the callers and a provider cost on this machine before anything is
  stored.
- batched, 1,000 msgs/call: PUBLISHERS processes, blocking calls of BATCH
  messages (``mqds bench``'s default load); target 100,000 msg/s.

CPU per 1,000 acknowledged messages is that of the load processes (their
loops only), of the ExHook provider in its scenario, and of the cluster's
node processes when this command knows them (``--start-cluster`` or
``--data-dir``), read from ``/proc`` between the start and the end of a run.

With ``--peer-anchors DIR`` the peer's benchmark (NATS JetStream,
:mod:`mqds.bench.peer`) runs after each round, so the two alternate in one
sitting, and a second table sets mqds's figures beside the peer's with their
ratios: pipelined one-message writes (1 x 1000 and PUBLISHERS x IN_FLIGHT)
against JetStream's pipelined publish, one writer's p50 against its
``publish_sync`` p50, and ExHook against its no-store ceiling.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mqds.bench.cli_process import CliProcess
from mqds.bench.exhook_load import run_exhook_load
from mqds.bench.load import TOPIC_PREFIX, RunResult, pct_ms, publisher_ids, run_load, shard_leaders
from mqds.bench.mqtt import _cpu_total
from mqds.bench.peer import PeerFailed, PeerMissing, PeerSetup, PeerSummary, locate, ratio, run_peer
from mqds.cli.console import EXIT_OK, EXIT_USAGE, CommandError, ProgressLine, bar, connection, table
from mqds.client import Client, Message
from mqds.client.connection import parse_endpoints
from mqds.tools import cluster_command

DEFAULT_DURATION_S = 5.0
DEFAULT_IN_FLIGHT = 64
# One client process with this many one-message calls outstanding: the peer's pipelined publish (its --window).
SINGLE_PROCESS_IN_FLIGHT = 1000
EXHOOK_CALLERS = 64
EXHOOK_PROCESSES = 2
# The rule that makes the provider store every message it is called with (QoS 1 and 2).
EXHOOK_RULES = '[[rule]]\nhook = "message.publish"\ntopic = "#"\naction = "on_message_publish"\n'
# The ceiling's provider: the same rule for topics the load never publishes, so it answers at once.
EXHOOK_NOTHING_RULES = EXHOOK_RULES.replace('topic = "#"', 'topic = "mqds-bench-stores-nothing/#"')


@dataclass(frozen=True)
class Target:
    metric: str  # "p50_ms" or "acked_msgs_per_s"
    value: float
    at_most: bool  # True: the figure must be at most value; False: at least

    def text(self) -> str:
        if self.metric == "p50_ms":
            return f"p50 <= {self.value:g} ms"
        return f">= {self.value:,.0f} msg/s"

    def met(self, report: dict[str, Any]) -> bool:
        figure = float(report[self.metric])
        return figure <= self.value if self.at_most else figure >= self.value

    def as_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "max" if self.at_most else "min": self.value, "text": self.text()}


@dataclass
class Figures:
    """One side of a scenario over all its rounds."""

    label: str
    messages: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    load_cpu_s: float = 0.0
    failed_calls: int = 0
    node_cpu_s: float | None = None
    node_switches: int | None = None

    def add(self, result: RunResult, seconds: float, watched_cpu_s: float | None) -> None:
        self.messages += result.acked_msgs
        self.seconds += seconds
        self.latencies += result.latencies_s
        self.cpu_s += result.load_cpu_s + (watched_cpu_s or 0.0)
        self.load_cpu_s += result.load_cpu_s
        self.failed_calls += result.failed_batches

    def add_nodes(self, cpu_s: float, switches: int) -> None:
        """The nodes' CPU and context switches over one run (only when the command controls the nodes)."""
        self.node_cpu_s = (self.node_cpu_s or 0.0) + cpu_s
        self.node_switches = (self.node_switches or 0) + switches

    def report(self) -> dict[str, Any]:
        ordered = sorted(self.latencies)
        return {
            "path": self.label,
            "acked_msgs": self.messages,
            "acked_msgs_per_s": round(self.messages / self.seconds, 1) if self.seconds else 0.0,
            "p50_ms": round(pct_ms(ordered, 0.5), 2),
            "p99_ms": round(pct_ms(ordered, 0.99), 2),
            "cpu_ms_per_1k": round(self.cpu_s * 1_000_000 / self.messages, 1) if self.messages else None,
            # The load processes' share of cpu_ms_per_1k (the rest: nodes, and the provider in its scenario).
            "load_cpu_ms_per_1k": round(self.load_cpu_s * 1_000_000 / self.messages, 1) if self.messages else None,
            "failed_calls": self.failed_calls,
            # Where a small call's cost goes: the nodes' CPU and their threads' context switches per message.
            "node_cpu_ms_per_1k": (
                round(self.node_cpu_s * 1_000_000 / self.messages, 1)
                if self.messages and self.node_cpu_s is not None
                else None
            ),
            "node_switches_per_msg": (
                round(self.node_switches / self.messages, 1)
                if self.messages and self.node_switches is not None
                else None
            ),
        }


# A scenario's run: (progress, sample) -> what it measured.
Runner = Callable[[Callable[[int, float, float], None], Callable[[], float | None]], RunResult]


@dataclass
class Scenario:
    name: str
    target: Target | None  # None: its target is a ratio to the peer (see Comparison)
    run: Runner
    figures: Figures
    watch_pids: list[int] = field(default_factory=list)  # processes whose CPU counts besides the nodes'
    baseline_run: Runner | None = None
    baseline: Figures | None = None
    ceiling_run: Runner | None = None  # the same load where nothing is stored: the most the scenario can reach
    ceiling: Figures | None = None
    ceiling_pids: list[int] = field(default_factory=list)
    shape: str = ""  # the key of its figures in the comparison with the peer

    def side(self, kind: str) -> tuple[Runner, Figures, list[int], str]:
        """The runner, figures, watched processes and title suffix of ``kind``: "", "baseline" or "ceiling"."""
        if kind == "baseline":
            assert self.baseline_run is not None and self.baseline is not None
            return self.baseline_run, self.baseline, [], " (baseline)"
        if kind == "ceiling":
            assert self.ceiling_run is not None and self.ceiling is not None
            return self.ceiling_run, self.ceiling, self.ceiling_pids, " (ceiling)"
        return self.run, self.figures, self.watch_pids, ""


class _ExhookProcess(CliProcess):
    """``mqds exhook`` as a subprocess with rules that store every message; its address once it serves."""

    def __init__(
        self, workdir: Path, endpoints: list[str], opts: argparse.Namespace, rules: str = EXHOOK_RULES
    ) -> None:
        config = workdir / ("store-every-message.toml" if rules == EXHOOK_RULES else "store-nothing.toml")
        config.write_text(rules)
        command = ["--endpoints", ",".join(endpoints)]
        if opts.tls:
            command.append("--tls")
        for option in ("token", "tls_ca", "tls_cert", "tls_key", "tls_server_name"):
            if getattr(opts, option, None):
                command += [f"--{option.replace('_', '-')}", getattr(opts, option)]
        command += ["exhook", "--config", str(config), "--listen", "127.0.0.1:0"]
        super().__init__(command, workdir / f"{config.stem}.out", r"serving \S+ on (\S+) ", "mqds exhook")
        self.address = self.ready.group(1)


def _warm_up_exhook(address: str) -> None:
    """A few calls, so that the provider's connections and streams to the cluster are open before the runs."""
    import grpc

    from mqds.broker.exhook.v3 import exhook_pb2 as pb
    from mqds.broker.exhook.v3 import exhook_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.HookProviderStub(channel)
        for i in range(20):
            message = pb.Message(
                node="emqx@bench", id=f"warm-up-{i}", qos=1, topic=f"{TOPIC_PREFIX}/warm-up/{i}", payload=b"x"
            )
            try:
                stub.OnMessagePublish(pb.MessagePublishRequest(message=message), timeout=30)
            except grpc.RpcError as err:
                raise CommandError(f"mqds exhook refused a warm-up OnMessagePublish: {err.details()}") from None


@contextlib.contextmanager
def _cluster(opts: argparse.Namespace) -> Iterator[tuple[list[str], list[int]]]:
    """The endpoints and the node pids (empty when unknown) of the cluster to run against."""
    with contextlib.ExitStack() as stack:
        cluster = cluster_command.for_benchmark(opts, stack, "mqds-bench-small-")
        if cluster is not None:
            yield cluster.addresses, [p.pid for p in cluster.nodes.values() if p.pid is not None]
        else:
            yield parse_endpoints(opts.endpoints), []


def check(opts: argparse.Namespace) -> None:
    """Usage mistakes of --small-writes (the common ones are checked by ``mqds bench`` first)."""
    if opts.rate or opts.kill_leader or opts.mqtt:
        raise CommandError("--small-writes runs its own scenarios: no --rate, --kill-leader or --mqtt", EXIT_USAGE)
    if opts.rounds < 1:
        raise CommandError("--rounds must be at least 1", EXIT_USAGE)


def _peer_setup(opts: argparse.Namespace, peer: PeerSummary) -> PeerSetup | None:
    """The peer to run after each round (None without --peer-anchors, or when it is not installed: then says so)."""
    if opts.peer_anchors is None:
        return None
    try:
        return locate(opts.peer_anchors, opts.peer_python, opts.peer_nats_server, opts.peer_args or "")
    except PeerMissing as err:
        peer.error = str(err)
        print(f"mqds bench: {err}; measuring mqds only", file=sys.stderr, flush=True)
        return None


def run(opts: argparse.Namespace) -> int:
    check(opts)
    duration = opts.duration if opts.duration is not None else DEFAULT_DURATION_S
    in_flight = opts.in_flight if opts.in_flight is not None else DEFAULT_IN_FLIGHT
    publishers, size = opts.publishers, opts.size
    settings = connection(opts, 30.0)

    def say(text: str) -> None:
        if not opts.json:
            print(text, flush=True)

    peer = PeerSummary()
    peer_setup = _peer_setup(opts, peer)
    with contextlib.ExitStack() as stack:
        endpoints, node_pids = stack.enter_context(_cluster(opts))
        client = stack.enter_context(Client(endpoints, settings=settings))
        n_shards = client.cluster_map().n_shards
        # Warm up: a store on each vnode a publisher writes to (leaders settled, connections open).
        for sender in publisher_ids(publishers, n_shards, shard_leaders(endpoints, settings)):
            client.store_batch([Message(f"{TOPIC_PREFIX}/{sender}/0", b"x", sender=sender, qos=1)])
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mqds-bench-exhook-")))
        provider = _ExhookProcess(workdir, endpoints, opts)
        stack.callback(provider.stop)
        _warm_up_exhook(provider.address)
        idle_provider = _ExhookProcess(workdir, endpoints, opts, EXHOOK_NOTHING_RULES)
        stack.callback(idle_provider.stop)
        _warm_up_exhook(idle_provider.address)

        def load(n: int, batch: int, *, threads: int = 1, flight: int = 0) -> Runner:
            def runner(progress: Callable[[int, float, float], None], sample: Callable[[], float | None]) -> RunResult:
                return run_load(
                    endpoints,
                    n_shards,
                    n,
                    batch,
                    size,
                    duration,
                    progress=progress,
                    settings=settings,
                    threads=threads,
                    in_flight=flight,
                    sample=sample,
                )

            return runner

        def exhook(address: str) -> Runner:
            def runner(progress: Callable[[int, float, float], None], sample: Callable[[], float | None]) -> RunResult:
                return run_exhook_load(
                    address, EXHOOK_CALLERS, EXHOOK_PROCESSES, size, duration, progress=progress, sample=sample
                )

            return runner

        calls = publishers * in_flight
        scenarios = [
            Scenario(
                "one writer, 1 msg/call",
                Target("p50_ms", 2.0, at_most=True),
                load(1, 1),
                Figures("1 publisher, blocking store_batch"),
                shape="single",
            ),
            Scenario(
                f"1-msg calls, {in_flight} in flight",
                Target("acked_msgs_per_s", 50_000, at_most=False),
                load(publishers, 1, flight=in_flight),
                Figures(f"{publishers} publishers x {in_flight} store_async in flight"),
                baseline_run=load(publishers, 1, threads=in_flight),
                baseline=Figures(
                    f"{publishers} publishers x {in_flight} threads, blocking store_batch ({calls} calls)"
                ),
                shape="pipelined_8x64",
            ),
            Scenario(
                f"1-msg calls, 1 process x {SINGLE_PROCESS_IN_FLIGHT} in flight",
                None,
                load(1, 1, flight=SINGLE_PROCESS_IN_FLIGHT),
                Figures(f"1 publisher x {SINGLE_PROCESS_IN_FLIGHT} store_async in flight"),
                shape="pipelined_1x1000",
            ),
            Scenario(
                f"ExHook, {EXHOOK_CALLERS} concurrent OnMessagePublish",
                Target("acked_msgs_per_s", 20_000, at_most=False),
                exhook(provider.address),
                Figures(f"mqds exhook, {EXHOOK_CALLERS} grpc.aio callers in {EXHOOK_PROCESSES} processes"),
                watch_pids=[provider.proc.pid],
                ceiling_run=exhook(idle_provider.address),
                ceiling=Figures("the same callers, a provider whose rules store nothing"),
                ceiling_pids=[idle_provider.proc.pid],
                shape="exhook",
            ),
            Scenario(
                f"batched, {opts.batch:,} msgs/call",
                Target("acked_msgs_per_s", 100_000, at_most=False),
                load(publishers, opts.batch),
                Figures(f"{publishers} publishers, blocking store_batch"),
            ),
        ]
        say(
            f"mqds bench --small-writes: {len(scenarios)} scenarios (and a baseline and a ceiling), "
            f"{duration:g} s each, "
            f"{opts.rounds} round(s) alternating, {size} B payloads, against {len(endpoints)} node(s), "
            f"{n_shards} vnodes"
            + ("" if node_pids else "; CPU: load processes and provider only (nodes not started by this command)")
            + ("; the peer's benchmark after each round" if peer_setup is not None else "")
        )
        runs: list[tuple[Scenario, str]] = []
        for scenario in scenarios:
            runs.append((scenario, ""))
            if scenario.baseline_run is not None:
                runs.append((scenario, "baseline"))
            if scenario.ceiling_run is not None:
                runs.append((scenario, "ceiling"))
        line = ProgressLine()
        try:
            for round_no in range(opts.rounds):
                order = runs if round_no % 2 == 0 else list(reversed(runs))
                for step, (scenario, kind) in enumerate(order, 1):
                    runner, figures, watched, suffix = scenario.side(kind)
                    title = f"round {round_no + 1}/{opts.rounds} run {step}/{len(order)} {scenario.name}{suffix}"

                    def progress(acked: int, elapsed_s: float, duration_s: float, title: str = title) -> None:
                        rate = acked / elapsed_s if elapsed_s > 0 else 0.0
                        line.show(
                            f"  {title}  {bar(elapsed_s / duration_s, 12)} {elapsed_s:4.1f}/{duration_s:g} s  "
                            f"{acked:>9,} acknowledged  {rate:>8,.0f} msg/s",
                            final=elapsed_s >= duration_s,
                        )

                    pids = node_pids + watched
                    marks: list[tuple[float | None, int | None]] = []

                    def sample(
                        pids: list[int] = pids, marks: list[tuple[float | None, int | None]] = marks
                    ) -> float | None:
                        if node_pids:
                            marks.append((_cpu_total(node_pids), _switches(node_pids)))
                        return _cpu_total(pids) if pids else 0.0

                    try:
                        result = runner(progress, sample)
                    except RuntimeError as err:
                        raise CommandError(f"{title}: the load run failed: {err}") from None
                    figures.add(result, duration, result.sampled)
                    if len(marks) >= 2:
                        (cpu0, sw0), (cpu1, sw1) = marks[0], marks[-1]
                        if None not in (cpu0, sw0, cpu1, sw1):
                            assert cpu0 is not None and cpu1 is not None and sw0 is not None and sw1 is not None
                            figures.add_nodes(cpu1 - cpu0, sw1 - sw0)
                    say(
                        f"  round {round_no + 1}  {scenario.name + suffix:<42} "
                        f"{result.acked_msgs_per_s:>9,.0f} msg/s  p50 {result.p50_ms:6.2f} ms  "
                        f"p99 {result.p99_ms:7.2f} ms"
                    )
                if peer_setup is not None and peer.error is None:
                    line.close()
                    _peer_round(peer_setup, peer, round_no, opts.rounds, size, say)
        finally:
            line.close()
    reports = []
    for scenario in scenarios:
        report = {"name": scenario.name, **scenario.figures.report()}
        report["target"] = scenario.target.as_json() if scenario.target is not None else None
        report["met"] = scenario.target.met(report) if scenario.target is not None else None
        if scenario.shape:
            report["shape"] = scenario.shape
        if scenario.baseline is not None:
            report["baseline"] = scenario.baseline.report()
        if scenario.ceiling is not None:
            report["ceiling"] = scenario.ceiling.report()
        reports.append(report)
    main = next(r for r in reports if r.get("shape") == "pipelined_8x64")
    if opts.json:
        summary = {
            "mode": "small_writes",
            "rounds": opts.rounds,
            "duration_s": duration,
            "size": size,
            "publishers": publishers,
            "in_flight": in_flight,
            "nodes_cpu_counted": bool(node_pids),
            "acked_msgs_per_s": main["acked_msgs_per_s"],
            "p50_ms": main["p50_ms"],
            "p99_ms": main["p99_ms"],
            **comparison(reports, peer if opts.peer_anchors is not None else None),
            "scenarios": reports,
        }
        print(json.dumps(summary, indent=2))
        return EXIT_OK
    rows: list[list[object]] = []
    for report in reports:
        target = report["target"]
        if target is None:
            rows.append(_row(report["name"], report, "(beside the peer)", ""))
        else:
            rows.append(_row(report["name"], report, target["text"], "PASS" if report["met"] else "MISS"))
        base = report.get("baseline")
        if base is not None:
            ratio = report["acked_msgs_per_s"] / base["acked_msgs_per_s"] if base["acked_msgs_per_s"] else 0.0
            rows.append(_row("  baseline (old path, same concurrency)", base, f"new/old {ratio:.2f}x", ""))
        ceiling = report.get("ceiling")
        if ceiling is not None:
            ratio = report["acked_msgs_per_s"] / ceiling["acked_msgs_per_s"] if ceiling["acked_msgs_per_s"] else 0.0
            rows.append(_row("  ceiling (nothing stored)", ceiling, f"stored/ceiling {ratio:.2f}x", ""))
    say("")
    say(
        table(
            [
                "scenario",
                "path",
                "msg/s",
                "p50 ms",
                "p99 ms",
                "CPU ms/1k msgs",
                "nodes",
                "switches/msg",
                "target",
                "result",
            ],
            rows,
            right=(2, 3, 4, 5, 6, 7),
        )
    )
    cpu_note = "nodes + load + provider" if node_pids else "load + provider only: nodes not started by this command"
    say(
        f"(figures over {opts.rounds} round(s) of {duration:g} s; CPU: {cpu_note}; nodes: the nodes' share of it; "
        "switches/msg: the nodes' threads' context switches per message)"
    )
    if opts.peer_anchors is not None:
        say("")
        say(peer_table(comparison(reports, peer), peer))
    return EXIT_OK


def _peer_round(
    setup: PeerSetup, peer: PeerSummary, round_no: int, rounds: int, size: int, say: Callable[[str], None]
) -> None:
    """One run of the peer's benchmark after an mqds round; a failure ends the peer's runs (mqds's go on)."""
    say(f"  round {round_no + 1}/{rounds}  the peer's benchmark ({setup.script.name}, {setup.nats_server}) ...")

    def echo(text: str) -> None:
        print(f"    peer: {text}", file=sys.stderr, flush=True)

    try:
        run = run_peer(setup, window=SINGLE_PROCESS_IN_FLIGHT, size=size, echo=echo)
    except (PeerFailed, OSError) as err:
        peer.error = str(err)
        print(f"mqds bench: {err}; no more runs of the peer, mqds's figures go on", file=sys.stderr, flush=True)
        return
    peer.runs.append(run)
    cpu = "" if run.pipelined_cpu_ms_per_1k is None else f" ({run.pipelined_cpu_ms_per_1k:,.1f} ms CPU per 1,000)"
    redone = f"; it redid {run.discarded} run(s) other processes disturbed" if run.discarded else ""
    say(
        f"  round {round_no + 1}  {'the peer: JetStream ' + run.server_version:<42} "
        f"{run.pipelined_msgs_per_s:>9,.0f} msg/s pipelined{cpu}, publish_sync p50 {run.sync_p50_ms:.2f} ms{redone}"
    )


# The targets for the ratios, in one sitting: (key, at least / at most, value).
RATIO_TARGETS = {
    "ratio_pipelined_1x1000": (">=", 1.0),
    "ratio_pipelined_8x64": (">=", 0.8),
    "ratio_single_p50": ("<=", 1.0),
    "ratio_exhook_ceiling": (">=", 0.8),
}


def comparison(reports: list[dict[str, Any]], peer: PeerSummary | None) -> dict[str, Any]:
    """mqds's figures beside the peer's, and their ratios, under the keys ``--json`` prints.

    Throughput ratios are mqds / peer (1.0 or more: mqds is as fast); the
    p50 ratio is mqds's p50 / the peer's (1.0 or less: mqds answers as fast);
    the ExHook ratio is the storing provider's msg/s / the ceiling's. Without a
    peer its figures and the ratios to it are None (``peer_error`` says why).
    """
    shapes = {r["shape"]: r for r in reports if r.get("shape")}

    def figure(shape: str, key: str) -> float | None:
        report = shapes.get(shape)
        return None if report is None else report.get(key)

    exhook = shapes.get("exhook", {})
    ceiling = exhook.get("ceiling") or {}
    cpu: dict[str, dict[str, float | None]] = {}
    for shape, report in [*shapes.items(), *([("exhook_ceiling", ceiling)] if ceiling else [])]:
        if shape == "batched":
            continue
        cpu[shape] = {
            "total": report.get("cpu_ms_per_1k"),
            "client": report.get("load_cpu_ms_per_1k"),
            "nodes": report.get("node_cpu_ms_per_1k"),
        }
    peer_pipelined = peer.pipelined_msgs_per_s if peer is not None else None
    peer_p50 = peer.sync_p50_ms if peer is not None else None
    single_p50 = figure("single", "p50_ms")
    out: dict[str, Any] = {
        "pipelined_1x1000_msgs_s": figure("pipelined_1x1000", "acked_msgs_per_s"),
        "pipelined_8x64_msgs_s": figure("pipelined_8x64", "acked_msgs_per_s"),
        "single_p50_ms": single_p50,
        "exhook_msgs_s": exhook.get("acked_msgs_per_s"),
        "exhook_ceiling_msgs_s": ceiling.get("acked_msgs_per_s"),
        "cpu_ms_per_1000": cpu,
        "peer_publish_pipelined_msgs_s": peer_pipelined,
        "peer_publish_sync_p50_ms": peer_p50,
        "peer_cpu_ms_per_1000": {
            "publish_pipelined": peer.pipelined_cpu_ms_per_1k if peer is not None else None,
            "publish_sync": peer.sync_cpu_ms_per_1k if peer is not None else None,
        },
        "peer_runs": len(peer.runs) if peer is not None else 0,
        "peer_server_version": peer.runs[0].server_version if peer is not None and peer.runs else None,
        "peer_error": peer.error if peer is not None else None,
        "ratio_pipelined_1x1000": ratio(figure("pipelined_1x1000", "acked_msgs_per_s"), peer_pipelined),
        "ratio_pipelined_8x64": ratio(figure("pipelined_8x64", "acked_msgs_per_s"), peer_pipelined),
        "ratio_single_p50": ratio(single_p50, peer_p50),
        "ratio_exhook_ceiling": ratio(exhook.get("acked_msgs_per_s"), ceiling.get("acked_msgs_per_s")),
    }
    out["ratio_targets"] = {key: f"{op} {value:g}" for key, (op, value) in RATIO_TARGETS.items()}
    return out


def _meets(key: str, value: float | None) -> str:
    if value is None:
        return ""
    op, target = RATIO_TARGETS[key]
    return "PASS" if (value >= target if op == ">=" else value <= target) else "MISS"


def peer_table(figures: dict[str, Any], peer: PeerSummary) -> str:
    """The comparison as a table: each mqds figure and its CPU, the peer's, the ratio and its target."""

    def num(value: float | None, unit: str, places: int = 0) -> str:
        return "-" if value is None else f"{value:,.{places}f} {unit}"

    def cpu(entry: dict[str, float | None] | None) -> str:
        if not entry or entry.get("total") is None:
            return "-"
        split = [f"{who} {entry[who]:,.1f}" for who in ("client", "nodes") if entry.get(who) is not None]
        return f"{entry['total']:,.1f}" + (f" ({', '.join(split)})" if split else "")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.1f}"

    def rat(key: str) -> str:
        value = figures[key]
        return "-" if value is None else f"{value:.2f}x"

    shares = figures["cpu_ms_per_1000"]
    peer_cpu = figures["peer_cpu_ms_per_1000"]
    rows: list[list[object]] = [
        [
            f"pipelined 1-msg writes, 1 process x {SINGLE_PROCESS_IN_FLIGHT:,} in flight",
            num(figures["pipelined_1x1000_msgs_s"], "msg/s"),
            cpu(shares.get("pipelined_1x1000")),
            num(figures["peer_publish_pipelined_msgs_s"], "msg/s"),
            ms(peer_cpu["publish_pipelined"]),
            rat("ratio_pipelined_1x1000"),
            ">= 1.0x",
            _meets("ratio_pipelined_1x1000", figures["ratio_pipelined_1x1000"]),
        ],
        [
            "pipelined 1-msg writes, --publishers x --in-flight",
            num(figures["pipelined_8x64_msgs_s"], "msg/s"),
            cpu(shares.get("pipelined_8x64")),
            num(figures["peer_publish_pipelined_msgs_s"], "msg/s"),
            ms(peer_cpu["publish_pipelined"]),
            rat("ratio_pipelined_8x64"),
            ">= 0.8x",
            _meets("ratio_pipelined_8x64", figures["ratio_pipelined_8x64"]),
        ],
        [
            "one writer, one message at a time, p50",
            num(figures["single_p50_ms"], "ms", 2),
            cpu(shares.get("single")),
            num(figures["peer_publish_sync_p50_ms"], "ms", 2),
            ms(peer_cpu["publish_sync"]),
            rat("ratio_single_p50"),
            "<= 1.0x",
            _meets("ratio_single_p50", figures["ratio_single_p50"]),
        ],
        [
            "ExHook / its no-store ceiling (same run)",
            num(figures["exhook_msgs_s"], "msg/s"),
            cpu(shares.get("exhook")),
            "ceiling " + num(figures["exhook_ceiling_msgs_s"], "msg/s"),
            cpu(shares.get("exhook_ceiling")),
            rat("ratio_exhook_ceiling"),
            ">= 0.8x",
            _meets("ratio_exhook_ceiling", figures["ratio_exhook_ceiling"]),
        ],
    ]
    lines = [
        f"Beside the peer: {peer.describe()}",
        table(
            ["figure", "mqds", "CPU ms/1k msgs", "peer", "peer CPU ms/1k", "ratio", "target", "result"],
            rows,
            right=(1, 3, 4, 5),
        ),
        "(ratio: mqds / peer for msg/s, mqds p50 / peer p50 for latency, storing / ceiling for ExHook; "
        "CPU per 1,000 messages: mqds's load processes (client) and nodes, the peer's client process and servers)",
    ]
    if peer.error is not None:
        lines.append(f"the peer: {peer.error}")
    return "\n".join(lines)


def register_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``mqds bench --small-writes --peer-anchors DIR``: the peer in the same sitting."""
    group = parser.add_argument_group("--small-writes beside the peer (NATS JetStream) in the same sitting")
    group.add_argument(
        "--peer-anchors",
        metavar="DIR",
        help="with --small-writes: after each round, run the peer's benchmark (DIR/jetstream_bench.py: NATS "
        "JetStream, 3 servers, 3 replicas, fsync before each PubAck, one client process, 1,000 PubAcks "
        "outstanding), so mqds and the peer alternate, and print each mqds figure beside the peer's with the "
        "ratio and CPU per 1,000 messages: pipelined 1-msg writes from 1 process x 1,000 in flight and from "
        "--publishers x --in-flight against its publish_pipelined msg/s, one writer's p50 against its "
        "publish_sync p50, ExHook against its no-store ceiling. DIR is the anchors directory that holds the "
        "script and setup.sh; setup.sh (once per machine) installs the peer under $ANCHORS. Where the peer is "
        "not installed this says so and prints mqds's figures alone. --json keys pipelined_1x1000_msgs_s, "
        "pipelined_8x64_msgs_s, single_p50_ms, peer_publish_pipelined_msgs_s, peer_publish_sync_p50_ms, "
        "ratio_pipelined_1x1000, ratio_pipelined_8x64, ratio_single_p50, ratio_exhook_ceiling, "
        "cpu_ms_per_1000 (per shape)",
    )
    group.add_argument(
        "--peer-python",
        metavar="PATH",
        help="the Python that runs the peer's script, with nats-py (default: $ANCHORS/venv/bin/python, "
        "where setup.sh puts it; $ANCHORS defaults to 'anchors' in the temporary directory)",
    )
    group.add_argument(
        "--peer-nats-server",
        metavar="PATH",
        help="the nats-server binary of the peer, 2.10 or newer for sync_interval: always (default: the newest "
        "$ANCHORS/bin/nats-server-<version> that setup.sh installs, else nats-server on PATH)",
    )
    group.add_argument(
        "--peer-args",
        metavar="ARGS",
        help="more arguments for the peer's script, one string (e.g. '--n 20000 --n-sync 1000' for a short "
        "run, '--base-port 15222', '--quiet-wait 0'); given after this command's own (--runs 1 --sync always "
        "--window 1000 --size SIZE --nats-server ... and a temporary --base-dir and --out), so they win",
    )


def _row(name: str, report: dict[str, Any], target: str, result: str) -> list[object]:
    def figure(key: str) -> str:
        return "-" if report.get(key) is None else f"{report[key]:,.1f}"

    return [
        name,
        report["path"],
        f"{report['acked_msgs_per_s']:,.0f}",
        f"{report['p50_ms']:.2f}",
        f"{report['p99_ms']:.2f}",
        figure("cpu_ms_per_1k"),
        figure("node_cpu_ms_per_1k"),
        figure("node_switches_per_msg"),
        target,
        result,
    ]


def _switches(pids: list[int]) -> int | None:
    """Context switches (voluntary and not) of every thread of ``pids`` so far, from /proc; None if unreadable."""
    total = 0
    try:
        for pid in pids:
            for task in Path(f"/proc/{pid}/task").iterdir():
                try:
                    status = (task / "status").read_text()
                except OSError:
                    continue  # a thread that ended meanwhile
                total += sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line)
    except OSError:
        return None
    return total
