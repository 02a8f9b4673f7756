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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mqds.bench import TOPIC_PREFIX, RunResult, pct_ms, publisher_ids, run_load, shard_leaders
from mqds.bench_exhook import run_exhook_load
from mqds.cli import local_cluster
from mqds.cli.bench_mqtt import _cpu_total
from mqds.cli.console import EXIT_OK, EXIT_USAGE, CommandError, ProgressLine, bar, connection, table
from mqds.cli.subprocess_cli import CliProcess
from mqds.client import Client, Message
from mqds.client.client import parse_endpoints

DEFAULT_DURATION_S = 5.0
DEFAULT_IN_FLIGHT = 64
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
    target: Target
    run: Runner
    figures: Figures
    watch_pids: list[int] = field(default_factory=list)  # processes whose CPU counts besides the nodes'
    baseline_run: Runner | None = None
    baseline: Figures | None = None
    ceiling_run: Runner | None = None  # the same load where nothing is stored: the most the scenario can reach
    ceiling: Figures | None = None
    ceiling_pids: list[int] = field(default_factory=list)

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
        cluster = local_cluster.for_benchmark(opts, stack, "mqds-bench-small-")
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


def run(opts: argparse.Namespace) -> int:
    check(opts)
    duration = opts.duration if opts.duration is not None else DEFAULT_DURATION_S
    in_flight = opts.in_flight if opts.in_flight is not None else DEFAULT_IN_FLIGHT
    publishers, size = opts.publishers, opts.size
    settings = connection(opts, 30.0)

    def say(text: str) -> None:
        if not opts.json:
            print(text, flush=True)

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
        finally:
            line.close()
    reports = []
    for scenario in scenarios:
        report = {"name": scenario.name, **scenario.figures.report()}
        report["target"] = scenario.target.as_json()
        report["met"] = scenario.target.met(report)
        if scenario.baseline is not None:
            report["baseline"] = scenario.baseline.report()
        if scenario.ceiling is not None:
            report["ceiling"] = scenario.ceiling.report()
        reports.append(report)
    main = reports[1]
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
            "scenarios": reports,
        }
        print(json.dumps(summary, indent=2))
        return EXIT_OK
    rows: list[list[object]] = []
    for report in reports:
        rows.append(_row(report["name"], report, report["target"]["text"], "PASS" if report["met"] else "MISS"))
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
    return EXIT_OK


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
