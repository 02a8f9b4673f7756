"""The main job, as a story in the terminal: ``make demo``.

Starts a local mqds node, lets simulated devices publish, replays what an
offline subscriber missed with a wildcard filter, kills the node with
SIGKILL mid-life, restarts it, and checks that every acknowledged message is
still there exactly once. Leaves no process behind.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import shutil
import sys
import tempfile
import time
from pathlib import Path

from mqds.client import Client, Message
from mqds.server.localproc import NodeProcess, free_port


class Bar:
    """A progress bar: redrawn in place on a terminal, every tenth of the way otherwise."""

    def __init__(self, label: str, total: int, width: int = 30) -> None:
        self.label, self.total, self.width = label, total, width
        self.tty = sys.stdout.isatty()
        self.shown = -1

    def update(self, done: int) -> None:
        tenth = 10 * done // self.total
        if not self.tty and done != self.total and tenth == self.shown:
            return
        self.shown = tenth
        filled = self.width * done // self.total
        end = "\n" if done == self.total or not self.tty else "\r"
        drawn = "#" * filled + "." * (self.width - filled)
        print(f"  {self.label:<28} [{drawn}] {done:>7,}/{self.total:,}", end=end, flush=True)


def when(us: int) -> str:
    return datetime.datetime.fromtimestamp(us / 1e6, datetime.UTC).strftime("%H:%M:%S.%f")[:-3]


def step(text: str) -> None:
    print(f"\n== {text}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mqds.server.demo", description=__doc__)
    parser.add_argument("--devices", type=int, default=8, help="simulated devices (default 8)")
    parser.add_argument("--readings", type=int, default=2_500, help="readings each device publishes (default 2,500)")
    parser.add_argument("--batch", type=int, default=250, help="messages per store_batch call (default 250)")
    parser.add_argument("--keep", action="store_true", help="keep the data directory and print where it is")
    opts = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="mqds-demo-"))
    node = NodeProcess(root / "n1", port=free_port())
    failures: list[str] = []
    try:
        step(f"starting a node on {node.address} (data in a temporary directory)")
        started = time.monotonic()
        node.start()
        print(f"  node n1 is serving after {time.monotonic() - started:.1f}s: 16 shards, one RocksDB each")

        total = opts.devices * opts.readings * 2
        step(f"{opts.devices} devices publish {total:,} readings (temp and humidity) with sync=True")
        acked: list[Message] = []
        progress = Bar("stored and acknowledged", total)
        with Client(node.address) as client:
            pending: list[Message] = []
            for reading in range(opts.readings):
                for device in range(opts.devices):
                    for kind in ("temp", "hum"):
                        pending.append(
                            Message(
                                topic=f"sensor/{device}/{kind}",
                                payload=f"{kind}={20 + (reading * 7 + device) % 15} #{reading}".encode(),
                                sender=f"device-{device}",
                                qos=1,
                            )
                        )
                if len(pending) >= opts.batch or reading == opts.readings - 1:
                    acked += client.store_batch(pending, sync=True)
                    pending = []
                    progress.update(len(acked))

            step("a subscriber that was offline replays 'sensor/+/temp'")
            streams = client.get_streams("sensor/+/temp")
            rank, stream = streams[0]
            print(f"  get_streams found {len(streams)} streams, e.g. {stream.pattern!r} in shard {rank.shard}")
            temps = list(client.replay("sensor/+/temp"))
            want = sum(1 for m in acked if m.topic.endswith("/temp"))
            print(f"  replayed {len(temps):,} temperature readings (expected {want:,})")
            if len(temps) != want:
                failures.append(f"replayed {len(temps)} temperature readings, expected {want}")
            one = list(client.replay("sensor/3/#"))
            print(f"  'sensor/3/#' alone: {len(one):,} readings, first {one[0].payload.decode()!r}")

        step("kill -9 the node, then start it again")
        node.kill()
        print("  node killed (SIGKILL: no shutdown code ran)")
        started = time.monotonic()
        node.start()
        print(f"  node back after {time.monotonic() - started:.1f}s")

        step("check: every acknowledged message is there, once, in order per device")
        with Client(node.address) as client:
            seen = list(client.replay("#"))
            stored = collections.Counter((m.topic, m.payload, m.timestamp_us) for m in acked)
            found = collections.Counter((m.topic, m.payload, m.timestamp_us) for m in seen)
            lost = stored - found
            duplicated = found - stored  # copies beyond the one stored, and anything never stored
            print(
                f"  acknowledged {len(acked):,}  replayed {len(seen):,}  lost {sum(lost.values())}  "
                f"duplicated {sum(duplicated.values())}"
            )
            if lost:
                failures.append(f"{sum(lost.values())} acknowledged messages lost")
            if duplicated:
                failures.append(f"{sum(duplicated.values())} messages duplicated or unexpected")
            per_device = collections.defaultdict(list)
            for m in seen:
                per_device[m.sender].append(m.timestamp_us or 0)
            if any(ts != sorted(ts) for ts in per_device.values()):
                failures.append("a device's messages came back out of order")

            step("generations: rotate shard 0 and list it")
            client.add_generation(0)
            for g in client.list_generations(0):
                since = "the start" if g.since_us == 0 else when(g.since_us)
                state = "current, takes writes" if g.until_us is None else f"closed at {when(g.until_us)}, read-only"
                print(f"  shard {g.shard} generation {g.generation}: from {since} ({state})")
    finally:
        node.stop()
        if opts.keep:
            print(f"\n  data kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    step("result")
    if failures:
        for failure in failures:
            print(f"  FAILED: {failure}")
        return 1
    print("  OK: nothing acknowledged was lost, nothing was duplicated, order kept per device; node stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
