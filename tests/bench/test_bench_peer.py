"""The peer in the same sitting (``mqds bench --small-writes --peer-anchors DIR``) without a cluster or a NATS server.

A fake ``jetstream_bench.py`` prints the JSON lines the real one prints (a
discarded run among them, its human table after them) and is run as a real
subprocess through :func:`mqds.bench.peer.run_peer`, the command's own path;
its figures are then set beside mqds's and the ratios checked.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from mqds.bench.peer import PeerFailed, PeerMissing, PeerRun, PeerSummary, locate, parse_lines, run_peer
from mqds.bench.small import SINGLE_PROCESS_IN_FLIGHT, comparison, peer_table
from mqds.cli import main

FAKE_PEER = textwrap.dedent(
    """
    import argparse, json, os, sys

    ap = argparse.ArgumentParser()
    for name in ("--runs", "--sync", "--window", "--size", "--nats-server", "--base-dir", "--out", "--n"):
        ap.add_argument(name)
    ap.add_argument("--fail", action="store_true")
    args = ap.parse_args()
    with open(os.path.join(os.path.dirname(__file__), "argv.json"), "w") as fh:
        json.dump({"argv": sys.argv[1:], "anchors": os.environ.get("ANCHORS")}, fh)
    if args.fail:
        print("# run 1 sync=always: starting", file=sys.stderr)
        sys.exit("nats-server 2.9.10 does not accept 'sync_interval: always': unknown field")
    meta = dict(system="nats-jetstream", server_version="2.15.1", replicas=3, storage="file",
                size=int(args.size), runs=1, client="nats-py 2.16.0", python="3.11.2")

    def emit(**record):
        print(json.dumps(dict(meta, **record), sort_keys=True), flush=True)

    def run(attempt, sync_n, sync_s, p50, pipe_n, pipe_s, cores):
        base = dict(kind="run", attempt=attempt, run=1, sync=args.sync, stream_leader="n2",
                    client_connected_to="n2", meta_leader="n1", other_cores_before=0.04, quiet_wait_s=2.0)
        emit(**base, phase="publish_sync", n=sync_n, seconds=sync_s, msgs_per_s=round(sync_n / sync_s, 1),
             p50_ms=p50, p99_ms=p50 * 2.5, max_ms=p50 * 9, truncated=False, cpu_cores_bench=cores[0],
             cpu_cores_other=0.02, cpu_cores_kernel=0.3, cpu_cores_steal=0.0, disk_flushes=15000)
        emit(**base, phase="publish_pipelined", n=pipe_n, window=int(args.window), pipeline_api="raw",
             seconds=pipe_s, msgs_per_s=round(pipe_n / pipe_s, 1), errors=0, unacked=0, truncated=False,
             cpu_cores_bench=cores[1], cpu_cores_other=0.03 if attempt > 1 else 0.9,
             cpu_cores_kernel=0.4, cpu_cores_steal=0.0, disk_flushes=3000)
        emit(**base, phase="replay", n=sync_n + pipe_n, expected=sync_n + pipe_n, batch=1000, replay_ack="none",
             seconds=0.5, msgs_per_s=2 * (sync_n + pipe_n), bytes=100 * (sync_n + pipe_n), truncated=False,
             cpu_cores_bench=1.0, cpu_cores_other=0.0, cpu_cores_kernel=0.1, cpu_cores_steal=0.0,
             disk_flushes=0)

    emit(kind="capability", sync_interval_always_supported=True, probe="configuration file is valid")
    print("# run 1 sync=always: meta leader n1 after 1.2s (pids [11, 12, 13])", file=sys.stderr, flush=True)
    run(1, 5000, 20.0, 3.9, 100000, 10.0, (0.5, 1.9))  # disturbed by a neighbour: discarded
    emit(kind="discarded", run=1, attempt=1, cpu_cores_other=0.9, reason="other processes used the CPU")
    print("# run 1 discarded: other processes used 0.90 cores; redoing", file=sys.stderr, flush=True)
    run(2, 5000, 10.0, 1.95, 100000, 4.0, (0.6, 1.8))
    for phase, figures in (("publish_sync", dict(msgs_per_s=500.0, p50_ms=1.95, p99_ms=4.875)),
                           ("publish_pipelined", dict(msgs_per_s=25000.0)),
                           ("replay", dict(msgs_per_s=210000.0))):
        rate = figures["msgs_per_s"]
        emit(kind="median", sync=args.sync, phase=phase, runs=1, msgs_per_s_all=[rate],
             cpu_cores_other_max=0.03, **figures)
    print()
    print("NATS JetStream 2.15.1 - 3 replicas, file storage, 100 B messages, medians of 1 runs")
    print("always   publish_pipelined       25000        -        -      0.03  [25000.0]")
    """
)


@pytest.fixture
def anchors(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """An anchors directory with the fake script and $ANCHORS as setup.sh leaves it (a venv's Python, two servers)."""
    scripts = tmp_path / "anchors"
    scripts.mkdir()
    (scripts / "jetstream_bench.py").write_text(FAKE_PEER)
    (scripts / "setup.sh").write_text("#!/bin/sh\n")
    home = tmp_path / "installed"
    (home / "venv" / "bin").mkdir(parents=True)
    (home / "venv" / "bin" / "python").symlink_to(sys.executable)
    (home / "bin").mkdir()
    for version in ("2.9.10", "2.15.1", "2.10.3"):
        server = home / "bin" / f"nats-server-{version}"
        server.write_text("#!/bin/sh\n")
        server.chmod(0o755)
    return scripts, {"ANCHORS": str(home)}


def test_the_peer_runs_as_a_subprocess_and_its_json_lines_give_its_figures(
    anchors: tuple[Path, dict[str, str]],
) -> None:
    scripts, environ = anchors
    setup = locate(scripts, environ=environ, extra_args="--n 20000")
    home = Path(environ["ANCHORS"])
    assert setup.python == str(home / "venv" / "bin" / "python")
    assert setup.nats_server == str(home / "bin" / "nats-server-2.15.1")  # the newest, not 2.9.10 or 2.10.3
    progress: list[str] = []
    run = run_peer(setup, window=SINGLE_PROCESS_IN_FLIGHT, size=100, echo=progress.append)

    assert run.server_version == "2.15.1" and run.sync == "always"
    assert run.pipelined_msgs_per_s == 25_000.0 and run.sync_p50_ms == 1.95 and run.sync_p99_ms == 4.875
    # CPU from the kept run only: 1.8 cores x 4 s over 100,000 messages, 0.6 x 10 s over 5,000.
    assert run.pipelined_cpu_ms_per_1k == 72.0 and run.sync_cpu_ms_per_1k == 1200.0
    assert run.discarded == 1
    assert any("meta leader n1" in line for line in progress) and any("discarded" in line for line in progress)
    called = json.loads((scripts / "argv.json").read_text())
    argv = called["argv"]
    assert argv[argv.index("--sync") + 1] == "always" and argv[argv.index("--window") + 1] == "1000"
    assert argv[argv.index("--size") + 1] == "100" and argv[argv.index("--nats-server") + 1] == setup.nats_server
    assert argv[-2:] == ["--n", "20000"]  # --peer-args come last, so they win
    assert called["anchors"] == str(home)


def test_ratios_set_mqds_beside_the_peer() -> None:
    peer = PeerSummary(
        runs=[
            PeerRun("2.15.1", "always", 20_000.0, 2.0, pipelined_cpu_ms_per_1k=70.0, sync_cpu_ms_per_1k=1000.0),
            PeerRun("2.15.1", "always", 26_000.0, 1.5, pipelined_cpu_ms_per_1k=60.0, sync_cpu_ms_per_1k=900.0),
        ]
    )
    figures = comparison(REPORTS, peer)
    assert figures["peer_publish_pipelined_msgs_s"] == 23_000.0 and figures["peer_publish_sync_p50_ms"] == 1.75
    assert figures["pipelined_1x1000_msgs_s"] == 11_500.0 and figures["pipelined_8x64_msgs_s"] == 18_400.0
    assert figures["ratio_pipelined_1x1000"] == 0.5 and figures["ratio_pipelined_8x64"] == 0.8
    assert figures["single_p50_ms"] == 3.5 and figures["ratio_single_p50"] == 2.0
    assert figures["ratio_exhook_ceiling"] == 0.25
    assert figures["cpu_ms_per_1000"]["pipelined_1x1000"] == {"total": 90.0, "client": 40.0, "nodes": 50.0}
    shapes = {"single", "pipelined_8x64", "pipelined_1x1000", "exhook", "exhook_ceiling"}
    assert set(figures["cpu_ms_per_1000"]) == shapes
    assert figures["peer_cpu_ms_per_1000"] == {"publish_pipelined": 65.0, "publish_sync": 950.0}
    assert figures["peer_runs"] == 2 and figures["peer_error"] is None
    json.dumps(figures)  # what --json prints
    text = peer_table(figures, peer)
    assert "NATS JetStream 2.15.1" in text and "median of 2 run(s)" in text
    row = next(line for line in text.splitlines() if "1 process x 1,000 in flight" in line)
    assert "11,500 msg/s" in row and "23,000 msg/s" in row and "0.50x" in row and "MISS" in row
    assert "90.0 (client 40.0, nodes 50.0)" in row
    row = next(line for line in text.splitlines() if "--publishers x --in-flight" in line)
    assert "0.80x" in row and "PASS" in row


def test_without_the_peer_mqds_figures_are_still_given_and_the_reason_said(tmp_path: Path) -> None:
    with pytest.raises(PeerMissing, match="--peer-anchors"):
        locate(tmp_path, environ={"ANCHORS": str(tmp_path / "nothing")})
    (tmp_path / "jetstream_bench.py").write_text("")
    with pytest.raises(PeerMissing) as missing:
        locate(tmp_path, environ={"ANCHORS": str(tmp_path / "nothing")})
    assert "setup.sh" in str(missing.value) and "--peer-python" in str(missing.value)
    assert "not installed" in str(missing.value)
    peer = PeerSummary(error=str(missing.value))
    figures = comparison(REPORTS, peer)
    assert figures["pipelined_1x1000_msgs_s"] == 11_500.0 and figures["single_p50_ms"] == 3.5
    assert figures["peer_publish_pipelined_msgs_s"] is None and figures["ratio_pipelined_8x64"] is None
    assert figures["ratio_exhook_ceiling"] == 0.25  # the ceiling is mqds's own
    text = peer_table(figures, peer)
    assert "not measured" in text and "setup.sh" in text


def test_a_failing_peer_says_why(anchors: tuple[Path, dict[str, str]]) -> None:
    scripts, environ = anchors
    setup = locate(scripts, python=sys.executable, environ=environ, extra_args="--fail")
    with pytest.raises(PeerFailed, match=r"exited with 1: .*does not accept 'sync_interval: always'"):
        run_peer(setup, window=1000, size=100)
    with pytest.raises(PeerFailed, match="no median"):
        parse_lines(['{"kind": "capability"}', "not json", "{broken"])


def test_help_explains_the_peer_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for option in ("--peer-anchors DIR", "--peer-python PATH", "--peer-nats-server PATH", "--peer-args ARGS"):
        assert option in out
    for words in ("jetstream_bench.py", "setup.sh", "$ANCHORS", "ratio_pipelined_1x1000", "publish_sync p50"):
        assert words in out, words
    assert os.sep + "tmp" not in out  # no machine's path: the temporary directory is named as such


def _scenario(shape: str, msgs_per_s: float, p50_ms: float, cpu: tuple[float, float, float]) -> dict[str, object]:
    return {
        "shape": shape,
        "acked_msgs_per_s": msgs_per_s,
        "p50_ms": p50_ms,
        "cpu_ms_per_1k": cpu[0],
        "load_cpu_ms_per_1k": cpu[1],
        "node_cpu_ms_per_1k": cpu[2],
    }


REPORTS: list[dict[str, object]] = [
    _scenario("single", 280.0, 3.5, (1900.0, 200.0, 1700.0)),
    _scenario("pipelined_8x64", 18_400.0, 20.0, (95.0, 45.0, 50.0)),
    _scenario("pipelined_1x1000", 11_500.0, 60.0, (90.0, 40.0, 50.0)),
    {
        **_scenario("exhook", 360.0, 70.0, (2200.0, 300.0, 1350.0)),
        "ceiling": _scenario("", 1440.0, 19.0, (550.0, 300.0, 16.0)),
    },
    _scenario("batched", 73_400.0, 50.0, (13.0, 1.0, 12.0)),
]
