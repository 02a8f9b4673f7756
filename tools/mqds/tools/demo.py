"""The main job, as a story in the terminal: ``make demo``.

Starts a local 3-node cluster (what ``mqds cluster up`` does) in a temporary
directory. Simulated devices publish readings, each numbered in its payload;
a subscriber reads the devices' hello messages and goes offline. Mid-stream
the leader of one device's vnode is killed with ``kill -9``: the output shows
how long that vnode's writes waited and which node leads it now. The
subscriber comes back and replays everything it missed with a wildcard
filter; what was acknowledged is compared with what is replayed, by (device,
sequence number): nothing may be lost, duplicated or out of order. The
killed node starts again and every replica is checked to hold the same data.
Last, the pipeline job (``mqds spark-job``, Spark in local mode) reads the
run's messages and writes per-topic and per-sender statistics to Parquet;
its count must match the replays. The cluster is stopped at the end, also
on Ctrl-C or an error; the exit code is 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from mqds.cli.console import ProgressLine, bar, format_time_us
from mqds.client import Client, Message
from mqds.client.errors import MqdsError
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster


def step(text: str) -> None:
    print(f"\n== {text}", flush=True)


def say(text: str) -> None:
    print(f"   {text}", flush=True)


@dataclass
class Device:
    """A simulated device: publishes numbered readings and records what was acknowledged, and when."""

    name: str
    shard: int
    acked: list[int] = field(default_factory=list)
    # (sent, acknowledged, readings) of every successful call; times from time.monotonic()
    calls: list[tuple[float, float, int]] = field(default_factory=list)
    retried_calls: int = 0
    error: str | None = None


class Fleet:
    """Devices publishing concurrently through one client, each paced to ``rate`` readings per second."""

    def __init__(self, client: Client, devices: list[Device], readings: int, batch: int, rate: float) -> None:
        self.client = client
        self.devices = devices
        self.readings = readings
        self.batch = batch
        self.rate = rate
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(d,), daemon=True) for d in devices]

    def _message(self, device: Device, seq: int) -> Message:
        kind = "temp" if seq % 2 == 0 else "hum"
        value = 20 + (seq * 7 + device.shard) % 15 if kind == "temp" else 40 + (seq * 3) % 30
        payload = json.dumps({"device": device.name, "seq": seq, kind: value}).encode()
        return Message(topic=f"sensor/{device.name}/{kind}", payload=payload, sender=device.name, qos=1)

    def _run(self, device: Device) -> None:
        started = time.monotonic()
        seq = 0
        while seq < self.readings and not self.stop.is_set():
            due = started + seq / self.rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            batch = [self._message(device, s) for s in range(seq, min(seq + self.batch, self.readings))]
            sequence: int | None = None
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    self.client.store_batch(batch, timeout_s=15, sequence=sequence)
                except MqdsError as err:
                    if not err.retriable:
                        device.error = str(err)
                        return
                    # Retry with the call's sequence: a part that did commit is not stored twice.
                    device.retried_calls += 1
                    hint = getattr(err, "sequence", None) or err.metadata.get("sequence")
                    sequence = int(hint) if hint else sequence
                    time.sleep(0.2)
                    continue
                device.calls.append((sent, time.monotonic(), len(batch)))
                device.acked.extend(range(seq, seq + len(batch)))
                break
            seq += len(batch)

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def running(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def join(self, timeout_s: float) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=timeout_s)

    def acked(self) -> int:
        return sum(len(d.acked) for d in self.devices)


@dataclass
class ReplayCheck:
    """Acknowledged readings against replayed ones, by (device, sequence number)."""

    acked: int
    replayed: int
    lost: list[tuple[str, int]]
    duplicated: int
    unexpected: int  # replayed, but never acknowledged (or not a reading at all)
    out_of_order: list[str]  # devices whose readings came back out of publish order

    def summary(self) -> str:
        return (
            f"acknowledged {self.acked:,}  replayed {self.replayed:,}  lost {len(self.lost)}  "
            f"duplicated {self.duplicated}  never acknowledged {self.unexpected}  "
            f"devices out of order {len(self.out_of_order)}"
        )

    def problems(self) -> list[str]:
        found = []
        if self.lost:
            found.append(f"{len(self.lost)} acknowledged readings lost, e.g. {self.lost[:3]}")
        if self.duplicated:
            found.append(f"{self.duplicated} readings replayed more than once")
        if self.unexpected:
            found.append(f"{self.unexpected} messages replayed that were never acknowledged")
        if self.out_of_order:
            found.append(f"readings of {', '.join(self.out_of_order)} replayed out of order")
        return found


def compare_readings(acked: list[tuple[str, int]], replayed_payloads: list[bytes]) -> ReplayCheck:
    """Check replayed payloads (JSON with ``device`` and ``seq``) against the acknowledged (device, seq) pairs."""
    keys: list[tuple[str, int] | None] = []
    for payload in replayed_payloads:
        try:
            reading = json.loads(payload)
            keys.append((str(reading["device"]), int(reading["seq"])))
        except (ValueError, KeyError, TypeError):
            keys.append(None)
    readings = [k for k in keys if k is not None]
    acked_set = set(acked)
    replayed_set = set(readings)
    by_device: dict[str, list[int]] = collections.defaultdict(list)
    for name, seq in readings:
        by_device[name].append(seq)
    return ReplayCheck(
        acked=len(acked_set),
        replayed=len(keys),
        lost=sorted(acked_set - replayed_set),
        duplicated=len(readings) - len(replayed_set),
        unexpected=len(replayed_set - acked_set) + keys.count(None),
        out_of_order=sorted(name for name, seqs in by_device.items() if seqs != sorted(seqs)),
    )


class Election:
    """Watches, in a thread, for the new leader of a vnode whose leader was killed a moment ago."""

    def __init__(self, cluster: LocalCluster, shard: int, victim: str) -> None:
        self.shard = shard
        self.killed_at = time.monotonic()
        self.leader: str | None = None
        self.after_s = 0.0
        self.error: str | None = None
        self.reported = False
        self.done = threading.Event()

        def watch() -> None:
            try:
                self.leader = cluster.wait_for_leader(shard, timeout_s=30, exclude=[victim])
                self.after_s = time.monotonic() - self.killed_at
            except TimeoutError as err:
                self.error = str(err)
            finally:
                self.done.set()

        threading.Thread(target=watch, daemon=True).start()

    def report(self, failures: list[str]) -> None:
        """Say who leads the vnode now, once it is known (and only once)."""
        if self.reported or not self.done.is_set():
            return
        self.reported = True
        if self.leader is not None:
            say(f"vnode {self.shard}: {self.leader} was elected leader {self.after_s:.2f} s after the kill")
        else:
            failures.append(f"vnode {self.shard} got no new leader: {self.error}")


def _leaders_line(cluster: LocalCluster) -> str:
    counts = collections.Counter(cluster.leaders().values())
    return ", ".join(f"{node} leads {counts.get(node, 0)}" for node in cluster.nodes if cluster.nodes[node].running)


def start_cluster(base_dir: Path) -> LocalCluster:
    step("1. a local 3-node cluster (mqds cluster up): each vnode is a Raft group with a replica on every node")
    started = time.monotonic()
    cluster = LocalCluster.up(base_dir, 3, n_shards=16, replication_factor=3)
    for node_id, proc in cluster.nodes.items():
        say(f"{node_id}  {proc.address}  pid {proc.pid}")
    say(
        f"every one of the {cluster.n_shards} vnodes has a leader after {time.monotonic() - started:.1f} s "
        f"({_leaders_line(cluster)})"
    )
    return cluster


def story(cluster: LocalCluster, opts: argparse.Namespace, failures: list[str]) -> None:

    story_started_us = int(time.time() * 1_000_000)
    client = cluster.client(timeout_s=30)
    names = [f"device-{i}" for i in range(opts.devices)]
    devices = [Device(name, shard_of(name, cluster.n_shards)) for name in names]

    step("2. the devices say hello; the subscriber 'dashboard' reads it, then goes offline")
    client.store_batch([Message(f"sensor/{d.name}/status", b"online", d.name, qos=1) for d in devices])
    seen = list(client.replay("sensor/#"))
    resume_us = max(m.timestamp_us or 0 for m in seen) + 1
    say(f"dashboard read {len(seen)} hello messages with 'sensor/#' and remembers where it stopped")
    say(f"dashboard goes offline; it will resume from {format_time_us(resume_us)}")

    total = opts.devices * opts.readings
    step(
        f"3. {opts.devices} devices publish {opts.readings:,} readings each ({total:,} in all), "
        f"{opts.batch} per call, each acknowledged once a majority of its vnode's replicas fsynced it"
    )
    say("devices and their vnodes: " + ", ".join(f"{d.name}->{d.shard}" for d in devices))
    victim_device = devices[0]
    shard = victim_device.shard
    fleet = Fleet(client, devices, opts.readings, opts.batch, opts.rate)
    line = ProgressLine(sys.stdout, every_s=1.0)
    publish_started = time.monotonic()
    election: Election | None = None
    victim = ""
    fleet.start()
    try:
        while fleet.running():
            acked = fleet.acked()
            rate = acked / max(time.monotonic() - publish_started, 0.001)
            line.show(f"   {bar(acked / total)} {acked:>9,}/{total:,} acknowledged  {rate:>7,.0f} msg/s")
            if election is None and acked >= opts.kill_at * total:
                victim = cluster.leader(shard) or cluster.wait_for_leader(shard, timeout_s=10)
                led = sorted(s for s, n in cluster.leaders().items() if n == victim)
                line.close()
                say(
                    f"kill -9 {victim} (pid {cluster.nodes[victim].pid}; mqds cluster kill {victim}), the leader of "
                    f"vnode {shard} where {victim_device.name} writes (it led vnodes {', '.join(map(str, led))})"
                )
                cluster.kill(victim)
                election = Election(cluster, shard, victim)
            if election is not None and election.done.is_set() and not election.reported:
                line.close()
                election.report(failures)
            time.sleep(0.1)
    finally:
        fleet.join(timeout_s=30)
    acked = fleet.acked()
    took_s = time.monotonic() - publish_started
    line.show(f"   {bar(acked / total)} {acked:>9,}/{total:,} acknowledged in {took_s:.1f} s", final=True)
    for d in devices:
        if d.error:
            failures.append(f"{d.name} stopped: {d.error}")
    if election is None:
        failures.append("publishing ended before the leader was killed (raise --readings or lower --kill-at)")
        return
    election.done.wait(35)
    election.report(failures)
    killed_at = election.killed_at

    step(f"4. the failover, seen by the devices writing to vnode {shard}")
    on_shard = [d for d in devices if d.shard == shard]
    waits = [end - max(sent, killed_at) for d in on_shard for sent, end, _ in d.calls if end > killed_at]
    retried = sum(d.retried_calls for d in on_shard)
    stalled_s = max(waits, default=0.0)
    if waits:
        say(
            f"writes to vnode {shard} waited at most {stalled_s:.2f} s after the kill, then went on with "
            f"{election.leader or 'a new leader'} leading: the client followed the new leader by itself "
            f"({retried} calls failed and were retried with the same sequence number)"
        )
    else:
        say(f"no write to vnode {shard} was sent after the kill")
    meanwhile = sum(
        n for d in devices if d.shard != shard for _, end, n in d.calls if killed_at <= end <= killed_at + stalled_s
    )
    say(f"meanwhile the other vnodes acknowledged {meanwhile:,} readings")
    say(f"leaders now: {_leaders_line(cluster)}")

    step("5. the dashboard comes back and replays everything it missed: 'sensor/#' from where it stopped")
    replay_started = time.monotonic()
    missed = list(client.replay("sensor/#", start_time_us=resume_us))
    say(f"replayed {len(missed):,} messages in {time.monotonic() - replay_started:.2f} s")

    step("6. check: what was acknowledged against what was replayed, by (device, sequence number)")
    check = compare_readings([(d.name, seq) for d in devices for seq in d.acked], [m.payload for m in missed])
    say(check.summary())
    failures.extend(check.problems())
    if check.acked != total:
        failures.append(f"only {check.acked} of {total} readings were acknowledged")

    step(f"7. {victim} starts again (mqds cluster start {victim}) and catches up")
    restarted = time.monotonic()
    cluster.start_node(victim, timeout_s=60)
    cluster.save()
    say(f"{victim} is ready after {time.monotonic() - restarted:.1f} s")
    try:
        cluster.assert_replicas_identical(timeout_s=60)
        say(f"every replica of every vnode holds the same data (content digests match); {_leaders_line(cluster)}")
    except AssertionError as err:
        failures.append(str(err))
    client.close()

    step("8. the data pipeline: mqds spark-job reads the run's messages with Spark, statistics go to Parquet")
    spark_job(cluster, story_started_us, len(seen) + len(missed), failures)


def spark_job(cluster: LocalCluster, since_us: int, expected: int, failures: list[str]) -> None:
    """Run the pipeline job over the story's messages (a Spark of its own, local[2]) and show its report.

    The job counts the messages of the window in a snapshot it pins; nothing
    is written meanwhile, so it must count what the replays found.
    """
    if importlib.util.find_spec("pyspark") is None:
        say("skipped: pyspark is not installed (pip install mqds-spark, or make install)")
        return
    out = cluster.base_dir.parent / "stats"
    since = format_time_us(since_us)
    say(f"$ mqds spark-job --since {since} --until now --topic-filter 'sensor/#' --out {out.name} --top 5")
    command = [sys.executable, "-m", "mqds.spark.command", "--endpoints", ",".join(cluster.addresses), "--since", since]
    command += ["--until", "now", "--topic-filter", "sensor/#", "--out", str(out), "--top", "5", "--master", "local[2]"]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    started = time.monotonic()
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    for line in run.stdout.splitlines():
        say(f"  {line}" if line else "")
    if run.returncode != 0:
        failures.append(f"the Spark job failed (exit {run.returncode}): {run.stderr.strip()[-1500:]}")
        return
    found = re.search(r"^read ([\d,]+) messages", run.stdout, re.MULTILINE)
    counted = int(found.group(1).replace(",", "")) if found else None
    if counted != expected:
        failures.append(f"the Spark job counted {counted} messages, replay found {expected:,}")
        return
    took = time.monotonic() - started
    say(f"the job counted the {expected:,} messages replay found (hellos and readings), in {took:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mqds.tools.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=8, help="simulated devices (default 8)")
    parser.add_argument("--readings", type=int, default=2_500, help="readings each device publishes (default 2,500)")
    parser.add_argument("--batch", type=int, default=25, help="readings per store call (default 25)")
    parser.add_argument("--rate", type=float, default=500.0, help="readings per second per device (default 500)")
    parser.add_argument(
        "--kill-at", type=float, default=0.35, help="kill the leader once this fraction is acknowledged (default 0.35)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the data directory and print where it is")
    opts = parser.parse_args(argv)
    if opts.devices < 1 or opts.readings < 1 or opts.batch < 1 or opts.rate <= 0 or not 0 < opts.kill_at < 1:
        parser.error("--devices, --readings and --batch must be at least 1, --rate above 0, --kill-at in (0, 1)")

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    root = Path(tempfile.mkdtemp(prefix="mqds-demo-"))
    print("mqds demo: a replicated store for MQTT messages survives losing a leader mid-stream")
    cluster: LocalCluster | None = None
    failures: list[str] = []
    interrupted = False
    try:
        cluster = start_cluster(root / "cluster")
        story(cluster, opts, failures)
    except KeyboardInterrupt:
        interrupted = True
        print("\n   interrupted", flush=True)
    except (MqdsError, RuntimeError, TimeoutError) as err:
        failures.append(f"{type(err).__name__}: {err}")
    finally:
        step("9. stop the cluster (mqds cluster down)")
        if cluster is not None:
            try:
                cluster.stop()
            except KeyboardInterrupt:
                cluster.kill_all()
            left = cluster.live()
            if left:
                failures.append(f"nodes still running: {', '.join(left)}")
        if opts.keep:
            say(f"stopped; data and logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
            say("stopped; temporary directory removed")

    step("result")
    if interrupted:
        say("interrupted: no verdict")
        return 130
    if failures:
        for failure in failures:
            say(f"FAILED: {failure}")
        return 1
    say("OK: every acknowledged reading was replayed exactly once, in order per device, across a leader's death")
    return 0


if __name__ == "__main__":
    sys.exit(main())
