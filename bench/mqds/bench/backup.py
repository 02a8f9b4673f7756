"""``mqds bench --backup``: backup and restore MB/s against a plain copy of the nodes' data directories.

It stores ``--backup-messages`` messages of ``--size`` bytes into a local
cluster (``--start-cluster``, or the one of ``--data-dir``), then measures in
the same run:

- ``mqds backup`` of the whole cluster into a temporary directory (one fence
  per shard, every shard exported from a follower where one has reached it);
- ``mqds restore`` of that backup into a second local cluster of the same
  shape, started for the purpose;
- the baseline: ``shutil.copytree`` of every node's data directory (RocksDB
  of every replica and the Raft logs, copied while the nodes run: not a
  usable backup, the plain-copy speed of this machine's disk).

Each is reported as bytes, seconds and MB/s (bytes written by the backup,
read by the restore, copied by the copy).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
import time
from pathlib import Path

from mqds.cli.console import EXIT_OK, EXIT_USAGE, CommandError, ProgressLine, bar
from mqds.client import Client, ConnectionSettings, Message
from mqds.tools import cluster_command
from mqds.tools.local_cluster import LocalCluster

DEFAULT_MESSAGES = 200_000
STORE_BATCH = 1_000


def register_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``mqds bench --backup`` (with bench's --start-cluster, --data-dir, --size, --json)."""
    group = parser.add_argument_group("--backup: backup and restore speed")
    group.add_argument(
        "--backup",
        action="store_true",
        help="instead of the store load: store --backup-messages messages, back the cluster up, restore it into "
        "a second local cluster of the same shape, and copy the nodes' data directories (shutil.copytree) as the "
        "baseline; print each one's bytes, seconds and MB/s. Needs --start-cluster or --data-dir. --json keys "
        "backup_mb_per_s, restore_mb_per_s, copy_mb_per_s and their bytes and seconds",
    )
    group.add_argument(
        "--backup-messages",
        type=int,
        default=DEFAULT_MESSAGES,
        metavar="N",
        help=f"messages stored before the backup (default {DEFAULT_MESSAGES:,})",
    )


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _copy(sources: list[Path], into: Path) -> int:
    """Copy every directory of ``sources`` under ``into``; the bytes copied (files vanishing meanwhile skipped)."""
    for i, source in enumerate(sources):
        with contextlib.suppress(shutil.Error):  # RocksDB and the Raft log remove files as they go
            shutil.copytree(source, into / f"{i}-{source.name}")
    return _dir_bytes(into)


def _figures(size: int, seconds: float) -> dict[str, float]:
    return {"bytes": size, "seconds": round(seconds, 3), "mb_per_s": round(size / 1e6 / seconds, 1) if seconds else 0}


def run(opts: argparse.Namespace) -> int:
    if opts.backup_messages < 1 or opts.size < 0:
        raise CommandError("--backup-messages must be at least 1, --size 0 or more", EXIT_USAGE)
    if not (opts.start_cluster or opts.data_dir) or (opts.start_cluster and opts.data_dir):
        raise CommandError(
            "--backup copies the nodes' data directories: give --start-cluster or --data-dir", EXIT_USAGE
        )
    say = (lambda _text: None) if opts.json else (lambda text: print(text, flush=True))
    with contextlib.ExitStack() as stack:
        source = cluster_command.for_benchmark(opts, stack, "mqds-bench-backup-")
        assert source is not None
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mqds-bench-backup-out-")))
        settings = ConnectionSettings(timeout_s=600, cluster_secret=source.secret)
        payload = b"x" * opts.size
        line = None if opts.json else ProgressLine()
        with Client(source.addresses, settings=settings) as client:
            started = time.monotonic()
            for done in range(0, opts.backup_messages, STORE_BATCH):
                count = min(STORE_BATCH, opts.backup_messages - done)
                client.store_batch(
                    [
                        Message(topic=f"bench/backup/{(done + i) % 64}", payload=payload, sender=f"b{(done + i) % 997}")
                        for i in range(count)
                    ]
                )
                if line is not None:
                    line.show(f"storing {bar((done + count) / opts.backup_messages)} {done + count:,} messages")
            if line is not None:
                line.close()
            say(f"stored {opts.backup_messages:,} messages of {opts.size} bytes in {time.monotonic() - started:.1f} s")
            place = scratch / "backup"
            backup = client.backup(str(place))
        say(f"backup:  {backup.bytes_written / 1e6:,.1f} MB in {backup.seconds:.2f} s ({backup.mb_per_s:,.1f} MB/s)")
        copy_started = time.monotonic()
        copied = _copy([proc.data_dir for proc in source.nodes.values()], scratch / "copy")
        copy_s = time.monotonic() - copy_started
        say(
            f"copy:    {copied / 1e6:,.1f} MB in {copy_s:.2f} s ({copied / 1e6 / copy_s:,.1f} MB/s), "
            "every node's data directory"
        )
        target = LocalCluster(
            scratch / "target",
            len(source.nodes),
            n_shards=source.n_shards,
            replication_factor=source.replication_factor,
        )
        stack.callback(target.stop)
        target.start()
        with Client(target.addresses, settings=ConnectionSettings(timeout_s=600, cluster_secret=target.secret)) as t:
            restore = t.restore(str(place))
        say(f"restore: {restore.bytes / 1e6:,.1f} MB in {restore.seconds:.2f} s ({restore.mb_per_s:,.1f} MB/s)")
    report: dict[str, object] = {
        "messages": opts.backup_messages,
        "size": opts.size,
        "nodes": len(source.nodes),
        "shards": source.n_shards,
        "backup": _figures(backup.bytes_written, backup.seconds),
        "restore": _figures(restore.bytes, restore.seconds),
        "copy": _figures(copied, copy_s),
    }
    for name, figures in (("backup", backup.mb_per_s), ("restore", restore.mb_per_s), ("copy", copied / 1e6 / copy_s)):
        report[f"{name}_mb_per_s"] = round(figures, 1)
    if opts.json:
        print(json.dumps(report))
    return EXIT_OK
