"""Storage-layer benchmark: the storage layer against raw rocksdict, in one run.

    python -m mqds.server.storage.bench            # or: make bench-storage

1. Store N messages (default 1,000,000 of 100 random bytes) in batches
   (default 1,000) through ``ShardStorage.store`` into one shard.
2. Write exactly the same keys and values, in the same order and the same
   batches, with raw rocksdict ``WriteBatch`` into a fresh database: the
   ratio of the two is the cost of the storage layer's own work (routing
   topics through the learned trie, building keys, encoding).
   For reference it also writes one key per message (data keys only).
3. Replay every stored message with ``ShardStorage.next`` and report
   messages/s, both as stored bytes (what the gRPC server sends on) and
   decoded into protobuf messages.
4. Read one device's messages through the index and report how many keys it
   read compared with the whole stream.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

from rocksdict import Rdict, WriteBatch

from mqds.server.storage import Engine, ShardStorage, decode_message
from mqds.server.storage.keys import DATA_TAG, generation_cf
from mqds.v1 import storage_pb2 as pb

START_US = 1_700_000_000_000_000


def progress(label: str, done: int, total: int) -> None:
    tty = sys.stderr.isatty()
    if done == total or done % max(1, total // (100 if tty else 10)) == 0:
        end = "\n" if done == total or not tty else "\r"
        print(f"  {label}: {done:,}/{total:,} ({100 * done // total}%)", end=end, file=sys.stderr, flush=True)


def quiesce(db: Rdict, timeout_s: float = 120) -> None:
    """Flush memtables and wait for RocksDB's background work, so one phase does not slow the next."""
    db.flush()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = db.property_int_value("rocksdb.num-running-compactions") or 0
        busy += db.property_int_value("rocksdb.num-running-flushes") or 0
        busy += db.property_int_value("rocksdb.compaction-pending") or 0
        if not busy:
            return
        time.sleep(0.05)


def make_batches(n: int, batch: int, size: int, devices: int) -> list[list[pb.Message]]:
    payloads = os.urandom(n * size)
    batches = []
    for start in range(0, n, batch):
        batches.append(
            [
                pb.Message(
                    topic=f"bench/dev-{i % devices}/data",
                    payload=payloads[i * size : (i + 1) * size],
                    sender=f"pub-{i % 8}",
                    qos=1,
                )
                for i in range(start, min(n, start + batch))
            ]
        )
    return batches


def timed(fn: Callable[[], int]) -> tuple[int, float]:
    start = time.perf_counter()
    count = fn()
    return count, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mqds.server.storage.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--messages", type=int, default=1_000_000, help="messages to store (default 1,000,000)")
    parser.add_argument("--batch", type=int, default=1_000, help="messages per write batch (default 1,000)")
    parser.add_argument("--size", type=int, default=100, help="payload bytes per message (default 100)")
    parser.add_argument(
        "--devices",
        type=int,
        default=1_000,
        help="distinct topics bench/dev-<i>/data (default 1,000; the trie folds them into one stream)",
    )
    parser.add_argument("--dir", help="directory for the databases (default: a temporary one, removed after)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with the figures at the end")
    parser.add_argument(
        "--replay-only",
        action="store_true",
        help="store, then measure only the replay as stored bytes (steps 1 and 3): the baseline 'mqds bench' "
        "prints its client replay against",
    )
    opts = parser.parse_args(argv)

    root = opts.dir or tempfile.mkdtemp(prefix="mqds-bench-")
    os.makedirs(root, exist_ok=True)
    figures: dict[str, float] = {}
    try:
        print(
            f"preparing {opts.messages:,} messages of {opts.size} bytes in batches of {opts.batch:,}", file=sys.stderr
        )
        batches = make_batches(opts.messages, opts.batch, opts.size, opts.devices)
        engine = Engine()
        storage = ShardStorage(os.path.join(root, "layer"), 0, engine)
        storage.initialize(START_US)

        def store_all() -> int:
            now = START_US
            for i, batch in enumerate(batches, 1):
                storage.store(batch, now)
                now += 1000
                progress("storage layer", i, len(batches))
            return opts.messages

        n, layer_s = timed(store_all)
        figures["layer_msgs_per_s"] = n / layer_s
        storage.flush()
        if opts.replay_only:
            figures["replay_msgs_per_s"] = replay_rate(storage, opts.messages)
            storage.close()
            print(f"replay (stored bytes):      {figures['replay_msgs_per_s']:>12,.0f} msg/s")
            if opts.json:
                print(json.dumps(figures))
            return 0

        # The same keys and values, in the order and batches the layer wrote them.
        per_ts: dict[int, list[tuple[bytes, bytes]]] = {}
        current_cf = generation_cf(storage.current_generation)
        for cf, key, value in storage.dump():
            if cf != current_cf:
                continue
            ts = int.from_bytes(key[5:13] if key[:1] == DATA_TAG else key[-8:], "big")
            per_ts.setdefault(ts, []).append((key, value))
        stamps = sorted(per_ts)
        raw_batches: list[list[tuple[bytes, bytes]]] = []
        data_batches: list[list[tuple[bytes, bytes]]] = []
        for start in range(0, len(stamps), opts.batch):
            kvs = [kv for ts in stamps[start : start + opts.batch] for kv in sorted(per_ts[ts], key=_data_first)]
            raw_batches.append(kvs)
            data_batches.append([kv for kv in kvs if kv[0][:1] == DATA_TAG])
        del per_ts
        total_keys = sum(len(b) for b in raw_batches)

        def raw_write(label: str, path: str, work: list[list[tuple[bytes, bytes]]]) -> float:
            db = Rdict(path, engine.db_options(), column_families=None)
            cf = db.create_column_family(generation_cf(1), engine.cf_options())
            handle = db.get_column_family_handle(generation_cf(1))
            start = time.perf_counter()
            for i, kvs in enumerate(work, 1):
                wb = WriteBatch(raw_mode=True)
                put = wb.put
                for key, value in kvs:
                    put(key, value, handle)
                db.write(wb, engine.async_write)
                progress(label, i, len(work))
            elapsed = time.perf_counter() - start
            cf.flush()
            quiesce(db)
            del handle, cf
            db.close()
            return elapsed

        raw_s = raw_write("raw rocksdict", os.path.join(root, "raw"), raw_batches)
        figures["raw_msgs_per_s"] = opts.messages / raw_s
        data_s = raw_write("raw, data keys only", os.path.join(root, "raw1"), data_batches)
        figures["raw_data_only_msgs_per_s"] = opts.messages / data_s
        del raw_batches, data_batches

        figures["replay_msgs_per_s"] = replay_rate(storage, opts.messages)
        figures["replay_decoded_msgs_per_s"] = replay_rate(storage, opts.messages, decode=True)

        # Selective read through the index: one device of many.
        device = opts.devices - 1
        storage.keys_read = 0
        selected = 0
        for ref in storage.get_streams(["bench", f"dev-{device}", "#"], 0):
            state = storage.make_iterator(ref.generation, ref.stream, f"bench/dev-{device}/#", 0)
            while True:
                result = storage.next(state, 1000)
                selected += len(result.rows)
                state = result.state
                if not result.rows:
                    break
        figures["selective_messages"] = selected
        figures["selective_keys_read"] = storage.keys_read
        storage.close()

        ratio = figures["layer_msgs_per_s"] / figures["raw_msgs_per_s"]
        figures["layer_vs_raw_ratio"] = ratio
        print()
        print(f"storage layer store:        {figures['layer_msgs_per_s']:>12,.0f} msg/s")
        print(
            f"raw rocksdict, same keys:   {figures['raw_msgs_per_s']:>12,.0f} msg/s   "
            f"({total_keys:,} keys: data + index)"
        )
        print(f"ratio layer / raw:          {ratio:>12.0%}   (target >= 50%)")
        print(
            f"raw rocksdict, 1 key/msg:   {figures['raw_data_only_msgs_per_s']:>12,.0f} msg/s   "
            f"(layer is {figures['layer_msgs_per_s'] / figures['raw_data_only_msgs_per_s']:.0%} of it)"
        )
        print(f"replay (stored bytes):      {figures['replay_msgs_per_s']:>12,.0f} msg/s   (target >= 300,000)")
        print(f"replay (decoded protobuf):  {figures['replay_decoded_msgs_per_s']:>12,.0f} msg/s")
        print(
            f"index read bench/dev-{device}/#: {selected:,} messages, {storage.keys_read:,} keys read "
            f"of {total_keys:,} ({storage.keys_read / total_keys:.3%})"
        )
        if opts.json:
            print(json.dumps(figures))
    finally:
        if not opts.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def replay_rate(storage: ShardStorage, expected: int, decode: bool = False) -> float:
    """Messages/s replaying every stored message with ``ShardStorage.next`` (as stored bytes, or decoded)."""

    def replay() -> int:
        count = 0
        for ref in storage.get_streams(["bench", "#"], 0):
            state = storage.make_iterator(ref.generation, ref.stream, "bench/#", 0)
            while True:
                result = storage.next(state, 1000)
                if decode:
                    for ts, value in result.entries:
                        decode_message(value, ts, 0)
                count += len(result.rows)
                state = result.state
                if not result.rows:
                    break
            progress("replay (decoded)" if decode else "replay", count, expected)
        return count

    replayed, took_s = timed(replay)
    assert replayed == expected, f"replayed {replayed} of {expected}"
    return replayed / took_s


def _data_first(kv: tuple[bytes, bytes]) -> int:
    return 0 if kv[0][:1] == DATA_TAG else 1


if __name__ == "__main__":
    sys.exit(main())
