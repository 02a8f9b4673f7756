"""``mqds backup`` and ``mqds restore``: a consistent copy of a whole cluster, and a new cluster made from it."""

from __future__ import annotations

import argparse
import sys
import threading

from mqds.cli.console import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CommandError, ProgressLine, bar, connection, table
from mqds.cli.secret import cluster_secret_options, with_cluster_secret
from mqds.client import Client
from mqds.client.core.backup_files import BackupError, Place, VerifyReport, verify

PLACE_HELP = "a directory, or an fsspec URL (file://, s3://... with the matching fsspec package installed)"


class _Progress:
    """Bytes per shard as the shards' workers report them, shown on one line."""

    def __init__(self, verb: str, n_shards: int, quiet: bool) -> None:
        self.verb = verb
        self.n_shards = n_shards
        self.line = None if quiet else ProgressLine(every_s=5.0)
        self._lock = threading.Lock()
        self._bytes: dict[int, int] = {}
        self._done: set[int] = set()

    def __call__(self, shard: int, done_bytes: int, finished: bool) -> None:
        with self._lock:
            self._bytes[shard] = done_bytes
            if finished:
                self._done.add(shard)
            if self.line is not None:
                fraction = len(self._done) / self.n_shards if self.n_shards else 1.0
                total = sum(self._bytes.values())
                self.line.show(
                    f"{self.verb} {bar(fraction)} {len(self._done)}/{self.n_shards} shards, {total / 1e6:,.1f} MB"
                )

    def close(self) -> None:
        if self.line is not None:
            self.line.close()


def _verify(place: str) -> int:
    try:
        report: VerifyReport = verify(Place(place))
    except (OSError, ValueError) as err:
        raise CommandError(f"{place}: {err}", EXIT_FAILED) from None
    manifest = report.manifest
    if manifest is not None:
        rows = [
            [s.shard, s.fence_us, len(s.files), f"{sum(f.records for f in s.files):,}", s.node] for s in manifest.shards
        ]
        print(table(["SHARD", "FENCE (us)", "FILES", "RECORDS", "EXPORTED BY"], rows, right=(0, 1, 2, 3)))
    for problem in report.problems:
        print(f"  problem: {problem}", file=sys.stderr)
    if not report.ok:
        raise CommandError(f"{place} is not a usable backup: {len(report.problems)} problem(s), see above", EXIT_FAILED)
    assert manifest is not None
    print(
        f"\n{place}: whole: {manifest.n_shards} shards, {report.files} files, {report.records:,} records, "
        f"{report.bytes / 1e6:,.1f} MB, every checksum matches (run {manifest.run})"
    )
    return EXIT_OK


def run_backup(opts: argparse.Namespace) -> int:
    if opts.verify:
        if opts.to:
            raise CommandError("give either --to PLACE or --verify PLACE", EXIT_USAGE)
        return _verify(opts.verify)
    if not opts.to:
        raise CommandError("--to PLACE is required (or --verify PLACE)", EXIT_USAGE)
    settings = with_cluster_secret(connection(opts, 3600.0), opts)
    with Client(opts.endpoints, settings=settings) as client:
        progress = _Progress("backing up", client.cluster_map().n_shards, opts.quiet)
        try:
            report = client.backup(
                opts.to,
                parallel=opts.parallel,
                incremental=not opts.full,
                timeout_s=settings.timeout_s,
                progress=progress,
            )
        except BackupError as err:
            raise CommandError(str(err), EXIT_FAILED) from None
        finally:
            progress.close()
    rows = [[shard, report.fences[shard], report.nodes[shard]] for shard in sorted(report.fences)]
    print(table(["SHARD", "FENCE (us)", "EXPORTED BY"], rows, right=(0, 1)))
    print(
        f"\nbacked up {report.n_shards} shards into {opts.to}: {report.files_written} files, "
        f"{report.records:,} records, {report.bytes_written / 1e6:,.1f} MB in {report.seconds:.1f} s "
        f"({report.mb_per_s:,.1f} MB/s); skipped {report.files_skipped} files ({report.bytes_skipped / 1e6:,.1f} MB) "
        f"the place held already (closed generations, unchanged)"
    )
    return EXIT_OK


def run_restore(opts: argparse.Namespace) -> int:
    if opts.abandon:
        return _abandon(opts)
    if getattr(opts, "from") is None:
        raise CommandError("restore needs --from PLACE (or --abandon)", EXIT_USAGE)
    settings = with_cluster_secret(connection(opts, 3600.0), opts)
    with Client(opts.endpoints, settings=settings) as client:
        progress = _Progress("restoring", client.cluster_map().n_shards, opts.quiet)
        try:
            report = client.restore(
                getattr(opts, "from"), parallel=opts.parallel, timeout_s=settings.timeout_s, progress=progress
            )
        except BackupError as err:
            raise CommandError(str(err), EXIT_FAILED) from None
        finally:
            progress.close()
    print(
        f"restored {report.n_shards} shards from {getattr(opts, 'from')}: {report.files} files, "
        f"{report.records:,} records, {report.bytes / 1e6:,.1f} MB, {report.generations} generations in "
        f"{report.seconds:.1f} s ({report.mb_per_s:,.1f} MB/s)"
        + ("; retention policy set" if report.retention_set else "")
    )
    return EXIT_OK


def _abandon(opts: argparse.Namespace) -> int:
    settings = with_cluster_secret(connection(opts, 60.0), opts)
    with Client(opts.endpoints, settings=settings) as client:
        ended = client.abandon_restore(timeout_s=settings.timeout_s)
    if ended:
        print(f"abandoned the restore of shards {', '.join(map(str, ended))}: they are empty and take writes again")
    else:
        print("no shard was being restored: nothing changed")
    return EXIT_OK


def _parallel(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= 64:
        raise argparse.ArgumentTypeError("must be 1 to 64")
    return value


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], connection: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "backup",
        parents=[connection, cluster_secret_options()],
        help="a consistent copy of the whole cluster into a directory or URL (or --verify one)",
        description=(
            "Back up every shard at one fence per shard, pinned when the backup starts: the messages stored "
            "up to it, the broker state (client state, subscriptions, retained messages, read positions) and "
            "the retention policy, with a manifest of SHA-256 checksums written last. Writes go on meanwhile; "
            "shards are exported a few at a time, from followers where one has reached the fence. Into a place "
            "that holds a backup already, closed generations it has (unchanged since) are not copied again. "
            "--verify checks a backup without restoring it. Needs the admin role."
        ),
    )
    parser.add_argument("--to", metavar="PLACE", help=f"where to write the backup: {PLACE_HELP}")
    parser.add_argument("--verify", metavar="PLACE", help="check the backup at PLACE (manifest, files, checksums)")
    parser.add_argument(
        "--full", action="store_true", help="copy every generation again, even those the place holds already"
    )
    parser.add_argument(
        "--parallel", type=_parallel, default=2, metavar="N", help="shards exported at a time (default 2)"
    )
    parser.add_argument("--quiet", action="store_true", help="print only the summary, not the progress line")
    parser.set_defaults(run=run_backup)

    parser = sub.add_parser(
        "restore",
        parents=[connection, cluster_secret_options()],
        help="make a new, empty cluster hold a backup",
        description=(
            "Restore the backup at PLACE into the cluster at --endpoints: it must be empty (no messages, no "
            "broker state) and have the backup's shard count; its size and placement may differ. The whole "
            "backup is checked first (a damaged or partial one is refused, naming the file), then every shard "
            "is written through its leader and the retention policy set. A restore that fails abandons every "
            "shard it began (empty and writable again) and says so; --abandon ends the restores a stopped "
            "restore left behind. Needs the admin role."
        ),
    )
    parser.add_argument("--from", metavar="PLACE", help=f"the backup: {PLACE_HELP}")
    parser.add_argument(
        "--abandon",
        action="store_true",
        help="instead of restoring: end every restore under way in the cluster (what it wrote is cleared, the "
        "shards take writes again); a shard not being restored is left as it is",
    )
    parser.add_argument(
        "--parallel", type=_parallel, default=2, metavar="N", help="shards written at a time (default 2)"
    )
    parser.add_argument("--quiet", action="store_true", help="print only the summary, not the progress line")
    parser.set_defaults(run=run_restore)
