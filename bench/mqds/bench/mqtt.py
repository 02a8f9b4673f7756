"""``mqds bench --mqtt``: QoS 1 publishes through ``mqds broker``: PUBACK after the store against amqtt's early PUBACK.

Two ``mqds broker`` processes run against the same cluster: one with the
default (a publisher's PUBACK once mqds stored the message), one with
``--early-puback`` (amqtt's own, when the message is queued). For each count
of concurrent publishers, the runs alternate between the two, round after
round. Each publisher is a paho-mqtt client keeping ``--inflight`` QoS 1
publishes awaiting their PUBACK (it sends the next one from the PUBACK of an
earlier one), so a message's latency is PUBLISH to PUBACK, with no client-side
queueing in it. CPU is read from ``/proc/<pid>/stat`` of the broker and of the
nodes (when this command knows their processes: ``--start-cluster`` or
``--data-dir``), per 1,000 acknowledged messages, from the run's start until
the broker is idle again (so the stores an early PUBACK left running count). The publishers run in this
process (one thread each), so on a small machine they compete with the broker
for CPU: compare the two modes, not the absolute figures with another machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mqds.bench.cli_process import CliProcess
from mqds.cli.console import EXIT_OK, EXIT_USAGE, CommandError
from mqds.client.connection import parse_endpoints
from mqds.tools import cluster_command

if TYPE_CHECKING:
    pass

MODES = {"after_store": [], "early": ["--early-puback"]}
LABELS = {"after_store": "PUBACK after store", "early": "early (amqtt's)"}
TOPIC = "bench/mqtt"


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("each count must be at least 1")
    return counts


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) ``pid`` used so far, from /proc; None if it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_total(pids: list[int]) -> float | None:
    values = [_cpu_s(pid) for pid in pids]
    return None if not pids or any(v is None for v in values) else sum(v for v in values if v is not None)


def _quiesce(pid: int, timeout_s: float = 30.0) -> None:
    """Wait until ``pid`` is idle (under 5 ms of CPU in 200 ms), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = _cpu_s(pid)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = _cpu_s(pid)
        if now is None or last is None or now - last < 0.005:
            return
        last = now


class _BrokerProcess(CliProcess):
    def __init__(self, workdir: Path, endpoints: list[str], port: int, extra: list[str]) -> None:
        self.port = port
        command = ["broker", "--endpoints", ",".join(endpoints), "--listen", f"127.0.0.1:{port}", *extra]
        super().__init__(
            command, workdir / f"broker-{port}.out", "mqds broker: ready", f"mqds broker {' '.join(extra)}"
        )


class _Publisher:
    """A paho-mqtt client that sends ``count`` QoS 1 messages, ``inflight`` at a time; latencies in seconds."""

    def __init__(self, port: int, clientid: str, count: int, inflight: int, payload: bytes) -> None:
        import paho.mqtt.client as mqtt

        self.count = count
        self.inflight = inflight
        self.payload = payload
        self.topic = f"{TOPIC}/{clientid}"
        self.done = threading.Event()
        self._lock = threading.Lock()  # the count of sends only: never held across a paho call (paho holds
        # its own locks while it runs on_publish, which sends the next message)
        self._sent_at: dict[int, float] = {}
        self._acked_at: dict[int, float] = {}
        self._sent = 0
        self._connected = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=clientid, clean_session=True)
        self.client.max_inflight_messages_set(inflight)
        self.client.on_connect = lambda *_: self._connected.set()
        self.client.on_publish = self._on_publish
        self.client.connect("127.0.0.1", port, keepalive=60)
        self.client.loop_start()
        if not self._connected.wait(15):
            raise CommandError(f"{clientid} did not connect to the broker on port {port}")

    def _send(self) -> None:
        with self._lock:
            if self._sent >= self.count:
                return
            self._sent += 1
        started = time.perf_counter()
        info = self.client.publish(self.topic, self.payload, qos=1)
        self._sent_at[info.mid] = started  # mids are unique: count stays below 65,535

    @property
    def acked(self) -> int:
        return len(self._acked_at)

    @property
    def latencies(self) -> list[float]:
        return [at - self._sent_at[mid] for mid, at in self._acked_at.items() if mid in self._sent_at]

    def start(self) -> None:
        for _ in range(min(self.inflight, self.count)):
            self._send()

    def _on_publish(self, client: object, userdata: object, mid: int, reason: object, props: object) -> None:
        self._acked_at[mid] = time.perf_counter()
        if len(self._acked_at) >= self.count:
            self.done.set()
        else:
            self._send()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@dataclass
class _Figures:
    mode: str
    publishers: int
    messages: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    broker_cpu_s: float = 0.0
    nodes_cpu_s: float | None = 0.0

    def add(self, other: _Figures) -> None:
        self.messages += other.messages
        self.seconds += other.seconds
        self.latencies += other.latencies
        self.broker_cpu_s += other.broker_cpu_s
        self.nodes_cpu_s = (
            None if self.nodes_cpu_s is None or other.nodes_cpu_s is None else (self.nodes_cpu_s + other.nodes_cpu_s)
        )

    def report(self) -> dict[str, Any]:
        ordered = sorted(self.latencies)

        def pct(p: float) -> float:
            return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000, 2) if ordered else 0.0

        per_k = 1000 / self.messages if self.messages else 0.0
        return {
            "mode": self.mode,
            "publishers": self.publishers,
            "messages": self.messages,
            "msgs_per_s": round(self.messages / self.seconds, 1) if self.seconds else 0.0,
            "p50_ms": pct(0.50),
            "p99_ms": pct(0.99),
            "broker_cpu_ms_per_1k": round(self.broker_cpu_s * per_k * 1000, 1),
            "nodes_cpu_ms_per_1k": None if self.nodes_cpu_s is None else round(self.nodes_cpu_s * per_k * 1000, 1),
        }


def _one_run(
    broker: _BrokerProcess,
    node_pids: list[int],
    mode: str,
    publishers: int,
    total: int,
    opts: argparse.Namespace,
    tag: str,
) -> _Figures:
    per = max(1, total // publishers)
    payload = b"x" * opts.size
    clients = [
        _Publisher(broker.port, f"bench-{tag}-{mode}-{publishers}-{i}", per, opts.inflight, payload)
        for i in range(publishers)
    ]
    try:
        broker_before, nodes_before = _cpu_s(broker.proc.pid), _cpu_total(node_pids)
        started = time.perf_counter()
        for client in clients:
            client.start()
        deadline = time.monotonic() + max(120.0, total * 0.05)
        for client in clients:
            if not client.done.wait(max(0.0, deadline - time.monotonic())):
                raise CommandError(f"{mode}: a publisher got {client.acked} of {per} PUBACKs; gave up")
        seconds = time.perf_counter() - started
        _quiesce(broker.proc.pid)  # the stores still running (the early PUBACK's) count for this run's CPU
        broker_after, nodes_after = _cpu_s(broker.proc.pid), _cpu_total(node_pids)
    finally:
        for client in clients:
            client.close()
    figures = _Figures(mode, publishers, per * publishers, seconds)
    for client in clients:
        figures.latencies += client.latencies
    figures.broker_cpu_s = (broker_after or 0.0) - (broker_before or 0.0)
    figures.nodes_cpu_s = None if nodes_before is None or nodes_after is None else nodes_after - nodes_before
    return figures


@contextlib.contextmanager
def _cluster(opts: argparse.Namespace) -> Iterator[tuple[list[str], list[int]]]:
    """The endpoints and the node pids (empty when unknown) of the cluster to run against."""
    with contextlib.ExitStack() as stack:
        cluster = cluster_command.for_benchmark(opts, stack, "mqds-bench-mqtt-")
        if cluster is not None:
            pids = [p.pid for p in cluster.nodes.values() if p.pid is not None]
            yield cluster.addresses, pids
        else:
            yield parse_endpoints(opts.endpoints), []


def run(opts: argparse.Namespace) -> int:
    try:
        import paho.mqtt.client  # noqa: F401
        from amqtt.broker import Broker  # noqa: F401
    except ImportError as err:
        raise CommandError(
            f"mqds bench --mqtt needs amqtt and paho-mqtt ({err}): pip install paho-mqtt amqtt"
        ) from None
    counts: list[int] = opts.mqtt_publishers
    if (
        opts.messages < max(counts)
        or opts.messages // min(counts) > 60_000
        or opts.rounds < 1
        or opts.inflight < 1
        or opts.size < 0
    ):
        raise CommandError(
            "--messages must be at least the largest publisher count (and at most 60,000 per publisher); "
            "--rounds and --inflight at least 1",
            EXIT_USAGE,
        )
    if opts.start_cluster and opts.data_dir:
        raise CommandError("give --start-cluster or --data-dir, not both", EXIT_USAGE)
    from mqds.tools.ports import free_port

    def say(text: str) -> None:
        if not opts.json:
            print(text, flush=True)

    totals: dict[tuple[int, str], _Figures] = {}
    with contextlib.ExitStack() as stack:
        endpoints, node_pids = stack.enter_context(_cluster(opts))
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mqds-bench-brokers-")))
        brokers: dict[str, _BrokerProcess] = {}
        for mode, extra in MODES.items():
            brokers[mode] = _BrokerProcess(workdir, endpoints, free_port(), extra)
            stack.callback(brokers[mode].stop)
        say(
            f"mqds bench --mqtt: QoS 1, {opts.messages:,} messages of {opts.size} B per run, {opts.inflight} in "
            f"flight per publisher, {opts.rounds} round(s) alternating the two brokers, against "
            f"{len(endpoints)} node(s)" + ("" if node_pids else " (node CPU unknown: not started by this command)")
        )
        tag = f"{os.getpid()}"
        for mode in MODES:  # warm up: connections to the nodes, leaders settled after a fresh start
            _one_run(brokers[mode], node_pids, mode, 1, 200, opts, f"{tag}-warmup")
        for publishers in counts:
            for round_no in range(opts.rounds):
                order = list(MODES) if round_no % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    figures = _one_run(
                        brokers[mode], node_pids, mode, publishers, opts.messages, opts, f"{tag}-{round_no}"
                    )
                    totals.setdefault((publishers, mode), _Figures(mode, publishers)).add(figures)
                    line = figures.report()
                    say(
                        f"  {publishers:>4} publishers  {LABELS[mode]:<19} round {round_no + 1}: "
                        f"{line['msgs_per_s']:>8,.0f} msg/s  p50 {line['p50_ms']:.1f} ms  p99 {line['p99_ms']:.1f} ms"
                    )
    results = [totals[key].report() for key in sorted(totals, key=lambda k: (k[0], list(MODES).index(k[1])))]
    if opts.json:
        print(json.dumps({"size": opts.size, "inflight": opts.inflight, "rounds": opts.rounds, "results": results}))
        return EXIT_OK
    say("")
    say(
        f"{'publishers':>10}  {'mode':<19} {'msg/s':>8} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'broker CPU ms/1k':>17} {'nodes CPU ms/1k':>16}"
    )
    by_key = {(r["publishers"], r["mode"]): r for r in results}
    for r in results:
        nodes = "-" if r["nodes_cpu_ms_per_1k"] is None else f"{r['nodes_cpu_ms_per_1k']:,.1f}"
        say(
            f"{r['publishers']:>10}  {LABELS[r['mode']]:<19} {r['msgs_per_s']:>8,.0f} {r['p50_ms']:>7.1f} "
            f"{r['p99_ms']:>7.1f} {r['broker_cpu_ms_per_1k']:>17,.1f} {nodes:>16}"
        )
        if r["mode"] == "early":
            base = by_key.get((r["publishers"], "after_store"))
            if base is not None and r["msgs_per_s"]:
                say(f"{'':>10}  {'after store / early':<19} {base['msgs_per_s'] / r['msgs_per_s']:>8.2f}x throughput")
    return EXIT_OK


def register_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``mqds bench --mqtt`` (with bench's --size, --start-cluster, --data-dir, --json)."""
    group = parser.add_argument_group("--mqtt: QoS 1 through mqds broker, PUBACK after store against early PUBACK")
    group.add_argument(
        "--mqtt",
        action="store_true",
        help="instead of the store load: start two 'mqds broker' processes (PUBACK after store, and "
        "--early-puback) on the cluster, alternate QoS 1 runs of paho-mqtt publishers between them, and print "
        "throughput, PUBACK latency p50/p99 and CPU per 1,000 messages of each side by side",
    )
    group.add_argument(
        "--mqtt-publishers",
        type=_counts,
        default=[1, 10, 100],
        metavar="N,N,...",
        help="concurrent publishers of each step (default 1,10,100)",
    )
    group.add_argument(
        "--messages",
        type=int,
        default=5000,
        metavar="N",
        help="messages per run, shared by the publishers (default 5000)",
    )
    group.add_argument("--rounds", type=int, default=2, metavar="N", help="runs of each mode per step (default 2)")
    group.add_argument(
        "--inflight",
        type=int,
        default=20,
        metavar="N",
        help="QoS 1 publishes awaiting PUBACK per publisher (default 20)",
    )
