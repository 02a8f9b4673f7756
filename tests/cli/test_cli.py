"""The mqds command line end to end: a cluster started with `mqds cluster up`, real processes, real gRPC.

One cluster serves the whole module (tests run in file order: the last ones
kill, restart and stop nodes). Each test writes to topics of its own.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from mqds.tools.local_cluster import LocalCluster
from mqds.tools.ports import free_port, free_port_block
from mqds.tools.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MQDS = str(Path(sys.executable).with_name("mqds"))
N_SHARDS = 4


@dataclass
class Run:
    code: int
    out: str
    err: str


def mqds(*args: str, stdin: str | None = None, timeout_s: float = 120) -> Run:
    with subprocess.Popen(
        [MQDS, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            out, err = proc.communicate(stdin, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # A command that hangs: its threads' stacks (the CLI dumps them on SIGUSR1), then kill it.
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"mqds {' '.join(args)} still running after {timeout_s} s:\n{out}\n{err}") from None
    assert "Traceback" not in err, err
    return Run(proc.returncode, out, err)


@dataclass
class CliCluster:
    data_dir: Path
    endpoints: str

    def run(self, *args: str, stdin: str | None = None, timeout_s: float = 120) -> Run:
        return mqds("--endpoints", self.endpoints, *args, stdin=stdin, timeout_s=timeout_s)

    def harness(self) -> LocalCluster:
        return LocalCluster.load(self.data_dir)


@pytest.fixture(scope="module")
def cli_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliCluster]:
    data_dir = tmp_path_factory.mktemp("cli") / "cluster"
    base = free_port_block(3)
    try:
        up = mqds("cluster", "up", "--data-dir", str(data_dir), "--base-port", str(base), "--shards", str(N_SHARDS))
        assert up.code == 0, up.out + up.err
        # `up` returned: every vnode must have a leader already, without waiting.
        harness = LocalCluster.load(data_dir)
        assert sorted(harness.leaders()) == list(range(N_SHARDS)), up.out
        assert all(harness.status(n).ready for n in harness.nodes)
        endpoints = ",".join(f"127.0.0.1:{base + i}" for i in range(3))
        assert f"endpoints: {endpoints}" in up.out
        assert "every vnode has a leader" in up.out
        yield CliCluster(data_dir, endpoints)
    finally:
        if LocalCluster.recorded(data_dir):
            mqds("cluster", "down", "--data-dir", str(data_dir))
            LocalCluster.load(data_dir).kill_all()


def stored_lines(out: str) -> list[tuple[str, int, str, str]]:
    """(topic, vnode, leader, time) of each 'stored ...' line mqds pub prints."""
    return [
        (m[1], int(m[2]), m[3], m[4])
        for m in re.finditer(r"^stored (\S+)  vnode (\d+) \(leader (n\d)\)  at (\S+Z)$", out, re.MULTILINE)
    ]


def test_pub_then_replay(cli_cluster: CliCluster) -> None:
    pub = cli_cluster.run("pub", "cli/pub/temp", "-m", "21.5", "-m", "22.0", "--sender", "dev-a", "--qos", "2")
    assert pub.code == 0, pub.err
    lines = stored_lines(pub.out)
    assert [(t, v) for t, v, _, _ in lines] == [("cli/pub/temp", lines[0][1])] * 2
    assert "published 2 messages as 'dev-a' to vnode" in pub.out
    piped = cli_cluster.run(
        "pub", "cli/pub/hum", "--sender", "dev-b", "--retain", "--property", "unit=pct", stdin="40\n41\n42\n"
    )
    assert piped.code == 0, piped.err
    assert len(stored_lines(piped.out)) == 3
    many = cli_cluster.run("pub", "cli/count/x", "-m", "n={n}", "--count", "250", "--batch", "100", "-q")
    assert many.code == 0 and "published 250 messages" in many.out and "stored" not in many.out

    replay = cli_cluster.run("replay", "cli/pub/+")
    assert replay.code == 0, replay.err
    shown = replay.out.splitlines()
    assert len(shown) == 5 and "replayed 5 messages" in replay.err
    temps = [line for line in shown if "cli/pub/temp" in line]
    assert ["21.5" in temps[0], "22.0" in temps[1]] == [True, True]
    assert "(sender dev-a, qos 2, vnode" in temps[0]
    assert any("(sender dev-b, qos 1, vnode" in line and "retain, unit=pct" in line for line in shown)

    as_json = cli_cluster.run("replay", "cli/pub/hum", "--format", "json")
    records = [json.loads(line) for line in as_json.out.splitlines()]
    assert [r["payload"] for r in records] == ["40", "41", "42"]
    assert records[0]["sender"] == "dev-b" and records[0]["retain"] is True
    assert records[0]["properties"] == [["unit", "pct"]]
    assert records[0]["timestamp_us"] < records[1]["timestamp_us"] < records[2]["timestamp_us"]

    limited = cli_cluster.run("replay", "cli/count/x", "--limit", "7")
    assert [line.split("  ")[2] for line in limited.out.splitlines()] == [f"n={i}" for i in range(7)]
    everything = cli_cluster.run("replay", "cli/count/x")
    assert len(everything.out.splitlines()) == 250


def test_replay_since(cli_cluster: CliCluster) -> None:
    first = cli_cluster.run("pub", "cli/since/x", "-m", "before", "--sender", "dev-s")
    second = cli_cluster.run("pub", "cli/since/x", "-m", "after", "--sender", "dev-s")
    (_, _, _, when), *_ = stored_lines(second.out)
    assert first.code == second.code == 0
    since_iso = cli_cluster.run("replay", "cli/since/#", "--since", when)
    assert [line.split("  ")[2] for line in since_iso.out.splitlines()] == ["after"]
    relative = cli_cluster.run("replay", "cli/since/#", "--since", "10m")
    assert [line.split("  ")[2] for line in relative.out.splitlines()] == ["before", "after"]
    future = cli_cluster.run("replay", "cli/since/#", "--since", "2999-01-01T00:00:00Z")
    assert future.code == 0 and future.out == "" and "replayed 0 messages" in future.err
    bad = cli_cluster.run("replay", "cli/since/#", "--since", "ten minutes")
    assert bad.code == 2 and "is not a time" in bad.err


def test_replay_follow_prints_new_messages_until_ctrl_c(cli_cluster: CliCluster) -> None:
    assert cli_cluster.run("pub", "cli/follow/x", "-m", "old").code == 0
    # Ctrl-C must reach it even when the test runner ignores SIGINT (an ignored
    # signal stays ignored across exec). A small Python wrapper restores the
    # default and execs mqds: preexec_fn would do the same but can deadlock the
    # child of a process that has threads, as this one does.
    restore_sigint_then_exec = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            restore_sigint_then_exec,
            MQDS,
            "--endpoints",
            cli_cluster.endpoints,
            "replay",
            "cli/follow/#",
            "--follow",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    errors: list[str] = []
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or []], daemon=True).start()
    stderr_reader = threading.Thread(target=lambda: errors.extend(proc.stderr or []), daemon=True)
    stderr_reader.start()

    def next_line() -> str:
        try:
            return lines.get(timeout=30)
        except queue.Empty:
            proc.kill()
            pytest.fail(f"mqds replay --follow printed nothing for 30 s; its stderr: {''.join(errors)!r}")

    try:
        assert "  old  " in next_line()
        assert cli_cluster.run("pub", "cli/follow/x", "-m", "new").code == 0
        assert "  new  " in next_line()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    stderr_reader.join(timeout=10)
    err = "".join(errors)
    assert proc.returncode == 0, err
    assert "replayed 2 messages" in err and "Traceback" not in err


def test_status_is_readable_at_a_glance(cli_cluster: CliCluster) -> None:
    status = cli_cluster.run("status")
    assert status.code == 0, status.err
    out = status.out
    assert re.search(rf"3 nodes \(3 up\), {N_SHARDS} vnodes \({N_SHARDS} with a leader\), 3 replicas each", out)
    assert re.search(r"^NODE\s+ADDRESS\s+STATE\s+READY\s+LEADS\s+REPLICAS\s+DATA\s+FREE\s+WRITES$", out, re.MULTILINE)
    # Each node: its data directory's size on disk, its disk's free space and size, new messages taken.
    nodes = re.findall(
        r"^n\d\s+\S+\s+up\s+yes\s+\d+\s+\d+\s+([\d.]+ \w+)\s+([\d.]+ \w+) / ([\d.]+ \w+)\s+yes$", out, re.MULTILINE
    )
    assert len(nodes) == 3, out
    assert re.search(r"^VNODE\s+LEADER\s+TERM\s+APPLIED\s+GENS\s+DISK\s+REPLICAS$", out, re.MULTILINE)
    rows = re.findall(
        r"^\s+(\d+)\s+(n\d)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+ (?:B|KiB|MiB|GiB))\s+(.+)$", out, re.MULTILINE
    )
    assert [int(r[0]) for r in rows] == list(range(N_SHARDS))
    for _, leader, _, applied, gens, _, replicas in rows:
        assert f"{leader}*" in replicas.split() and int(applied) > 0 and int(gens) >= 1
        assert all(re.fullmatch(r"n\d(\*|:\d+)", part) for part in replicas.split()), replicas
    assert "OK: every node is up and every vnode has a leader" in out


def test_generations_list_add_drop(cli_cluster: CliCluster) -> None:
    listing = cli_cluster.run("generations", "list")
    assert listing.code == 0, listing.err
    counted = re.search(r"^(\d+) generations in 4 shards", listing.out, re.MULTILINE)
    assert counted, listing.out
    before = int(counted.group(1))
    # add and drop are admin calls: they present the cluster secret (`mqds cluster up` recorded it).
    secret_file = cli_cluster.data_dir.parent / "cluster-secret"
    secret_file.write_text(cli_cluster.harness().secret)
    proof = ("--cluster-secret-file", str(secret_file))
    added = cli_cluster.run("generations", "add", "--shard", "2", *proof)
    assert added.code == 0 and "started 1 new generation" in added.out
    rows = re.findall(
        r"^\s+2\s+(\d+)\s+\S+\s+(.+?)\s{2,}\S+$",
        cli_cluster.run("generations", "list", "--shard", "2").out,
        re.MULTILINE,
    )
    assert len(rows) >= 2 and "(current, takes writes)" in rows[-1][1]
    closed = int(rows[-2][0])
    assert f"{before + 1} generations in 4 shards" in cli_cluster.run("generations", "list").out

    dropped = cli_cluster.run("generations", "drop", "2", str(closed), *proof)
    assert dropped.code == 0 and f"dropped shard 2 generation {closed}" in dropped.out
    current = rows[-1][0]
    refused = cli_cluster.run("generations", "drop", "2", current, *proof)
    assert refused.code == 1 and "CURRENT_GENERATION" in refused.err
    unknown = cli_cluster.run("generations", "drop", "99", "1", *proof)
    assert unknown.code == 1 and "UNKNOWN_SHARD" in unknown.err
    assert f"{before} generations in 4 shards" in cli_cluster.run("generations", "list").out


def test_bench_prints_figures(cli_cluster: CliCluster) -> None:
    text = cli_cluster.run("bench", "--duration", "2", "--publishers", "2", "--batch", "100")
    assert text.code == 0, text.err
    acked = re.search(r"^acknowledged\s+([\d,]+) msg/s  \(([\d,]+) messages", text.out, re.MULTILINE)
    latency = re.search(r"^latency\s+p50 ([\d.]+) ms   p99 ([\d.]+) ms   p999 ([\d.]+) ms", text.out, re.MULTILINE)
    replay = re.search(r"^replay\s+([\d,]+) msg/s  \(([\d,]+) messages", text.out, re.MULTILINE)
    assert acked and latency and replay, text.out
    assert int(acked.group(1).replace(",", "")) > 0
    assert 0 < float(latency.group(1)) <= float(latency.group(2)) <= float(latency.group(3))
    assert int(replay.group(2).replace(",", "")) >= int(acked.group(2).replace(",", ""))
    # Beside it, the same replay as objects and the storage layer's own, measured in the same run.
    assert re.search(r"^  as objects\s+[\d,]+ msg/s", text.out, re.MULTILINE), text.out
    assert re.search(r"^  storage\s+[\d,]+ msg/s .*client replay is \d+% of it", text.out, re.MULTILINE), text.out
    assert "acknowledged" in text.err and "/2 s" in text.err  # the progress line
    assert re.search(r"^leaders\s+\d+ new term\(s\) on \d+ of \d+ vnodes", text.out, re.MULTILINE), text.out

    as_json = cli_cluster.run(
        "bench", "--duration", "2", "--publishers", "1", "--batch", "50", "--json", "--skip-replay"
    )
    assert as_json.code == 0, as_json.err
    report = json.loads(as_json.out)
    assert report["acked_msgs_per_s"] > 0 and 0 < report["p50_ms"] <= report["p99_ms"]
    assert "replay_msgs_per_s" not in report


def test_bench_keeps_store_calls_in_flight(cli_cluster: CliCluster) -> None:
    run = cli_cluster.run(
        "bench", "--duration", "2", "--publishers", "2", "--batch", "1", "--in-flight", "8", "--json", "--skip-replay"
    )
    assert run.code == 0, run.err
    report = json.loads(run.out)
    assert report["in_flight"] == 8 and report["batch"] == 1
    assert report["acked_msgs"] > 0 and report["failed_batches"] == 0
    assert 0 < report["p50_ms"] <= report["p99_ms"]


def test_bench_small_writes_runs_every_scenario(cli_cluster: CliCluster) -> None:
    run = cli_cluster.run(
        *("bench", "--data-dir", str(cli_cluster.data_dir), "--small-writes", "--duration", "1", "--rounds", "1"),
        *("--publishers", "2", "--in-flight", "8", "--batch", "100", "--json"),
        timeout_s=180,
    )
    assert run.code == 0, run.err
    report = json.loads(run.out)
    assert report["acked_msgs_per_s"] > 0 and 0 < report["p50_ms"] <= report["p99_ms"]
    assert report["nodes_cpu_counted"] is True
    names = [scenario["name"] for scenario in report["scenarios"]]
    assert names == [
        "one writer, 1 msg/call",
        "1-msg calls, 8 in flight",
        "1-msg calls, 1 process x 1000 in flight",
        "ExHook, 64 concurrent OnMessagePublish",
        "batched, 100 msgs/call",
    ]
    keys = {"name", "acked_msgs_per_s", "p50_ms", "p99_ms", "cpu_ms_per_1k", "target", "met"}
    for scenario in report["scenarios"]:
        assert keys <= scenario.keys(), scenario
        assert scenario["acked_msgs"] > 0 and scenario["acked_msgs_per_s"] > 0, scenario
        assert scenario["cpu_ms_per_1k"] > 0
        # The single process's 1,000 in flight has no target of its own: its target is a ratio to the peer.
        assert isinstance(scenario["met"], bool) or scenario.get("shape") == "pipelined_1x1000"
    pipelined = report["scenarios"][1]
    assert pipelined["acked_msgs_per_s"] == report["acked_msgs_per_s"]
    assert pipelined["target"]["min"] == 50_000
    assert pipelined["baseline"]["acked_msgs"] > 0 and pipelined["baseline"]["cpu_ms_per_1k"] > 0
    assert "round 1/1" in run.err  # the progress line
    # Without --peer-anchors the figures to set beside the peer's are there, the peer's are not.
    assert report["pipelined_1x1000_msgs_s"] > 0 and report["pipelined_8x64_msgs_s"] == report["acked_msgs_per_s"]
    assert report["single_p50_ms"] > 0 and report["ratio_pipelined_1x1000"] is None
    assert report["cpu_ms_per_1000"]["pipelined_1x1000"]["nodes"] > 0


def test_bench_fans_out_to_push_subscribers(cli_cluster: CliCluster) -> None:
    run = cli_cluster.run(
        *("bench", "--data-dir", str(cli_cluster.data_dir), "--subscribers", "1,4", "--rate", "400"),
        *("--duration", "1", "--publishers", "1", "--batch", "40", "--subscriber-processes", "1", "--json"),
        timeout_s=180,
    )
    assert run.code == 0, run.err
    report = json.loads(run.out)
    assert [r["subscribers"] for r in report["runs"]] == [1, 4]
    for r in report["runs"]:  # every message stored during the run reached every subscriber
        assert r["delivered"] == r["expected_deliveries"] > 0 and r["failures"] == 0, r
        assert 0 < r["stored_delivery_p50_ms"] <= r["stored_delivery_p99_ms"]
        assert r["server_cpu_ms_per_1000_delivered"] > 0
        # Each sampled delivery is matched to its store call's acknowledgement, which comes after the timestamp.
        assert r["ack_matched_share"] == 1.0, r
        assert r["delivery_p50_ms"] <= r["delivery_p99_ms"] < r["stored_delivery_p99_ms"], r
    keys = ("delivered_msgs_per_s", "delivery_p50_ms", "delivery_p99_ms", "server_cpu_ms_per_1000_delivered")
    assert all(report[k] == report["runs"][1][k] for k in keys)


def test_bench_reconnect_storm_against_the_baseline(cli_cluster: CliCluster) -> None:
    tiny = ("--sessions", "40", "--backlog", "5", "--filters", "4", "--size", "20")
    # All at once: the sessions' fetches go out together (spread out, a fast call may carry one each).
    run = cli_cluster.run(
        "bench", "--data-dir", str(cli_cluster.data_dir), "--reconnect-storm", *tiny, "--window", "0", timeout_s=180
    )
    assert run.code == 0, run.err
    out = run.out
    assert "40 persistent sessions, a backlog of 5 messages (20 B) each, on 4 filters (10 sessions each)" in out
    storm = re.search(
        r"^storm\s+([\d.]+) s until every backlog was delivered  \(200 messages, ([\d,]+) msg/s; "
        r"the fetches coalesced into ([\d,]+) fetch_offline_many calls?\)",
        out,
        re.MULTILINE,
    )
    baseline = re.search(
        r"^baseline\s+([\d.]+) s  \(200 messages, [\d,]+ msg/s; one fetch_offline per session", out, re.MULTILINE
    )
    assert storm and baseline, out
    assert float(storm.group(1)) > 0 and 0 < int(storm.group(3).replace(",", "")) < 10  # fetches went out together
    assert len(re.findall(r"^  nodes' CPU\s+[\d.]+ ms per 1,000 delivered$", out, re.MULTILINE)) == 2, out
    assert re.search(r"^shared/baseline: [\d.]+ of the time, [\d.]+ of the nodes' CPU per message$", out, re.MULTILINE)
    assert "read positions started" in run.err and "40/40 sessions" in run.err  # the progress lines

    as_json = cli_cluster.run(
        *("bench", "--data-dir", str(cli_cluster.data_dir), "--reconnect-storm", *tiny, "--window", "0.5", "--json"),
        timeout_s=180,
    )
    assert as_json.code == 0, as_json.err
    report = json.loads(as_json.out)
    assert report["delivered"] == 200 and report["storm_s"] > 0 and report["storm_baseline_s"] > 0
    assert report["storm_msgs_per_s"] > 0
    assert report["server_cpu_ms_per_1000_delivered"] > 0 and report["baseline_server_cpu_ms_per_1000_delivered"] > 0


def test_bench_kills_a_leader_and_reports_the_failover(cli_cluster: CliCluster) -> None:
    run = cli_cluster.run(
        "bench",
        "--data-dir",
        str(cli_cluster.data_dir),
        "--kill-leader",
        "--duration",
        "6",
        "--publishers",
        "2",
        "--batch",
        "100",
        "--json",
        "--skip-replay",
        timeout_s=180,
    )
    assert run.code == 0, run.err
    report = json.loads(run.out)
    # Writes to the vnode stopped when its leader died and resumed after an election.
    assert 0 < report["failover_s"] < 6, report
    assert report["failed_batches"] > 0
    assert report["new_terms"] >= 1, report  # the election the kill caused is counted
    harness = cli_cluster.harness()
    assert all(proc.running for proc in harness.nodes.values()), "the killed node was restarted"
    usage = mqds("--endpoints", cli_cluster.endpoints, "bench", "--kill-leader")
    assert usage.code == 2 and "needs a cluster this command controls" in usage.err


def test_unreachable_endpoint_is_a_clear_error() -> None:
    nobody = f"127.0.0.1:{free_port()}"
    commands = [["status"], ["pub", "a/b", "-m", "x"], ["replay", "#"], ["generations", "list"], ["bench"]]
    commands.append(["admin", "rebalance"])
    # A client retries an unreachable cluster until its timeout (a broker may start first): the commands
    # wait side by side.
    with ThreadPoolExecutor(len(commands)) as pool:
        runs = list(pool.map(lambda args: mqds("--endpoints", nobody, "--timeout", "2", *args, timeout_s=60), commands))
    for args, run in zip(commands, runs, strict=True):
        assert run.code == 1, (args, run.out, run.err)
        assert f"no mqds node answered at {nobody}" in run.err, (args, run.err)


def test_cluster_command_mistakes(cli_cluster: CliCluster, tmp_path: Path) -> None:
    empty = mqds("cluster", "down", "--data-dir", str(tmp_path / "none"))
    assert empty.code == 1 and "no local cluster recorded" in empty.err
    other = mqds("cluster", "up", "--data-dir", str(cli_cluster.data_dir), "--nodes", "5")
    assert other.code == 1 and "holds a cluster with nodes 3, not 5" in other.err
    unknown = mqds("cluster", "kill", "n9", "--data-dir", str(cli_cluster.data_dir))
    assert unknown.code == 2 and "no node 'n9'" in unknown.err
    busy_base = free_port_block(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", busy_base + 1))
        taken.listen()
        busy = mqds(
            "cluster", "up", "--data-dir", str(tmp_path / "busy"), "--nodes", "2", "--base-port", str(busy_base)
        )
    assert busy.code == 1 and f"port {busy_base + 1} (node n2) is in use" in busy.err


def test_cluster_kill_and_start(cli_cluster: CliCluster) -> None:
    harness = cli_cluster.harness()
    pid = harness.nodes["n2"].pid
    killed = mqds("cluster", "kill", "n2", "--data-dir", str(cli_cluster.data_dir))
    assert killed.code == 0 and f"killed n2 (kill -9 of pid {pid})" in killed.out
    assert not cli_cluster.harness().nodes["n2"].running
    again = mqds("cluster", "kill", "n2", "--data-dir", str(cli_cluster.data_dir))
    assert again.code == 1 and "n2 is not running" in again.err

    # Two of three replicas are left: writes go on once each vnode has a leader.
    degraded = cli_cluster.run("status")
    assert degraded.code == 3 and "DEGRADED: node n2 not answering" in degraded.out
    assert "n2:down" in degraded.out and "n2" in degraded.out.split("DOWN")[0]
    pub = cli_cluster.run("pub", "cli/kill/x", "-m", "while n2 is down")
    assert pub.code == 0, pub.err

    started = mqds("cluster", "start", "n2", "--data-dir", str(cli_cluster.data_dir))
    assert started.code == 0 and re.search(r"n2 started \(pid \d+\) on 127\.0\.0\.1:\d+; ready", started.out)
    assert cli_cluster.harness().nodes["n2"].running
    wait_until("a healthy status", lambda: cli_cluster.run("status").code == 0, timeout_s=60, interval_s=0.5)
    assert "while n2 is down" in cli_cluster.run("replay", "cli/kill/#").out


def _server_pids(data_dir: Path) -> list[int]:
    """The mqds-server processes whose command line names ``data_dir``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(data_dir).encode() in argv and any(a.endswith(b"mqds-server") for a in argv):
            found.append(int(entry.name))
    return found


def test_cluster_start_killed_while_it_waits_leaves_no_node_it_does_not_know(cli_cluster: CliCluster) -> None:
    """The node a killed 'mqds cluster start' had started ran on, unknown to 'mqds cluster down'."""
    data_dir = cli_cluster.data_dir
    node_dir = cli_cluster.harness().nodes["n3"].data_dir
    assert mqds("cluster", "kill", "n3", "--data-dir", str(data_dir)).code == 0
    waiting = subprocess.Popen([MQDS, "cluster", "start", "n3", "--data-dir", str(data_dir)])
    try:
        pid = wait_until("n3 launched", lambda: (_server_pids(node_dir) or [None])[0], timeout_s=30, interval_s=0.02)
        # Killed while the node starts up (it takes seconds to be ready),
        # after the command had time to record it.
        time.sleep(0.2)
    finally:
        waiting.kill()
        waiting.wait(10)
    again = mqds("cluster", "start", "n3", "--data-dir", str(data_dir))
    assert again.code == 0 and f"n3 is already running (pid {pid})" in again.out, again.out + again.err
    assert cli_cluster.harness().nodes["n3"].running
    wait_until("a healthy status", lambda: cli_cluster.run("status").code == 0, timeout_s=60, interval_s=0.5)


def test_cluster_down_then_up_restarts_the_same_cluster(cli_cluster: CliCluster) -> None:
    before = cli_cluster.run("status").out.splitlines()[0].split(":")[0]  # "cluster <id>"
    pids = [p.pid for p in cli_cluster.harness().nodes.values()]
    down = mqds("cluster", "down", "--data-dir", str(cli_cluster.data_dir))
    assert down.code == 0 and "stopped; the data stays" in down.out
    assert cli_cluster.harness().live() == []
    assert cli_cluster.run("status").code == 1

    up = mqds("cluster", "up", "--data-dir", str(cli_cluster.data_dir))
    assert up.code == 0, up.err
    assert "starting the cluster recorded in" in up.out
    harness = cli_cluster.harness()
    assert sorted(harness.leaders()) == list(range(N_SHARDS))
    assert all(p.pid not in pids for p in harness.nodes.values())
    status = cli_cluster.run("status")
    assert status.code == 0 and status.out.startswith(before)
    # The data survived the restart (written after the generations test dropped one).
    assert "while n2 is down" in cli_cluster.run("replay", "cli/kill/#").out
    down_again = mqds("cluster", "down", "--data-dir", str(cli_cluster.data_dir))
    assert down_again.code == 0
    assert mqds("cluster", "down", "--data-dir", str(cli_cluster.data_dir)).out.startswith("no node of the cluster")


def test_a_command_that_waits_prints_its_threads_stacks_on_sigusr1() -> None:
    """What an operator (or a test whose command hangs) uses to see what a command waits for."""
    with subprocess.Popen(
        [MQDS, "--endpoints", f"127.0.0.1:{_closed_port()}", "--timeout", "30", "status"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        time.sleep(2)  # retrying an endpoint that refuses connections
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        assert proc.poll() is None  # it goes on
        proc.kill()
        _, err = proc.communicate()
    assert "most recent call first" in err and "Thread 0x" in err, err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
