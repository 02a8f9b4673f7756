"""Disk usage of a node, and admission control: writes that add data are refused before the disk fills.

A thread measures the node's disk every ``disk_check_interval_s`` (the
filesystem's free space every time; the data directory's sizes every time
with a quota, else every ``WALK_INTERVAL_S``): the bytes its files take on
disk (allocated blocks, as ``du`` counts them, so RocksDB's preallocated
files count what they reserve), the same per Raft
group (a vnode's RocksDB directory and its Raft directory; the metadata
group's directory), the shared Raft log's, and the filesystem's free and
total bytes.

Two limits, each off at 0:

- ``disk_quota_bytes``: the data directory may hold at most this much;
- ``disk_min_free_bytes``: its filesystem keeps at least this much free
  (256 MiB by default: RocksDB needs room to compact, the Raft log to go on
  replicating what other leaders commit).

A measurement is seconds old by the time a write is admitted, and a node
taking writes at full speed fills its disk faster than that: between two
measurements (``disk_check_interval_s``) every byte its Raft log takes (its
own groups' entries and those its followers append) counts
``GROWTH_FACTOR`` times on top of the last one, the disk it will take once
the same data is in RocksDB's log and, flushed, in a table file. So the
node refuses as soon as that estimate passes a limit, not at the next
measurement (which then corrects the estimate): a 3-node cluster under a
64 MiB quota, written at full speed, went to 157-163 MiB on disk before the
estimate, and stays within the bound ``docs/operations.md`` states now.

Once a measurement or the estimate passes one, the vnodes the node leads log nothing that
adds data (``STORAGE_FULL``, RESOURCE_EXHAUSTED; the client retries it with
backoff within the call's deadline) until usage falls below 95% of the quota
and free space rises above the floor plus 5%: a margin, so that a node near
a limit does not flip between the two states with every compaction. The
check is asked of every command proposed to a vnode's group
(``RaftGroup.admit``, given by ``node/hosting.py``), and ``cluster/growth.py``
says which commands add data: new messages, retained messages, the state of
a new client, a new subscription, read position or share-group member, a
restore's begin and records. What frees space, or keeps a broker serving the
clients it has, goes on: reads, deletes, dropping generations (retention
does it by itself), clearing a retained message, unsubscribing, forgetting
sessions and positions, expiry, acknowledgements, a known client's connect
and disconnect. A follower still applies everything its leader commits: a
replica that refused a committed entry would no longer be a replica. Each
leader admits by its own node's disk; the replicas of a vnode hold the same
data, so they fill alike, and the disk guard (``node/diskguard.py``) takes over on
a node whose disk does fill.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mqds.protocol.cluster_view import META_GROUP

log = logging.getLogger(__name__)

WALK_INTERVAL_S = 30.0
"""Without a quota, how often the data directory is walked for the sizes that status and metrics show."""
GROWTH_FACTOR = 3
"""Disk bytes a byte written to the Raft log takes in all: the entry, the RocksDB log's copy, a table file's."""
RESUME_FRACTION = 0.95
"""Writes are taken again below this share of the quota (and above the floor by 1 / this)."""

_SHARD_DIR = re.compile(r"^shard-(\d{4,})$")


def format_size(n: int) -> str:
    """A size for people: ``812 KiB``, ``1.5 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def allocated_bytes(path: str, linked: set[tuple[int, int]] | None = None) -> int:
    """Bytes the files under ``path`` take on disk (``st_blocks``), skipping what vanishes meanwhile.

    With ``linked``, a file of several hard links counts once: its (device, inode) is added to the set,
    and a file already in it counts 0.
    """
    return sum(_size(entry, linked) for entry in _entries(path))


def _size(entry: os.DirEntry[str], linked: set[tuple[int, int]] | None = None) -> int:
    """Bytes a file, or everything under a directory, takes on disk (0 for what vanished meanwhile)."""
    try:
        if entry.is_dir(follow_symlinks=False):
            return allocated_bytes(entry.path, linked)
        stat = entry.stat(follow_symlinks=False)
        if linked is not None and stat.st_nlink > 1:
            key = (stat.st_dev, stat.st_ino)
            if key in linked:
                return 0
            linked.add(key)
        return stat.st_blocks * 512
    except FileNotFoundError:  # a compaction or a log segment removed it
        return 0


@dataclass(frozen=True)
class Usage:
    """One measurement of a node's disk."""

    data_bytes: int
    """Everything under the data directory."""
    free_bytes: int
    """Free bytes of the data directory's filesystem (for unprivileged users)."""
    total_bytes: int
    """Size of that filesystem."""
    wal_bytes: int
    """The shared Raft log (``raft/wal``)."""
    group_bytes: dict[int, int] = field(default_factory=dict)
    """Per Raft group (a shard, or META_GROUP): its RocksDB and Raft directories."""
    rocksdb_log_bytes: int = 0
    """The replicas' RocksDB logs: what is not in table files yet is in them, and a flush writes it to one before
    the log goes (the disk it takes meanwhile)."""


def measure(data_dir: str) -> Usage:
    """The disk usage of the node whose data directory is ``data_dir``: one walk of it, and the filesystem's."""
    groups: dict[int, int] = {}
    total = wal = rocksdb_logs = 0
    # A checkpoint being sent (a snapshot, a backup's export) in tmp/ is hard links to a replica's files:
    # they take the disk once, counted with the replica (tmp/ is walked last).
    linked: set[tuple[int, int]] = set()
    for entry in sorted(_entries(data_dir), key=lambda e: e.name == "tmp"):
        if entry.name not in ("shards", "raft") or not entry.is_dir(follow_symlinks=False):
            size = _size(entry, linked)
            total += size
            if entry.name == "meta":
                groups[META_GROUP] = size
            continue
        for child in _entries(entry.path):
            size = _size(child, linked)
            total += size
            match = _SHARD_DIR.match(child.name)
            if match:
                shard = int(match.group(1))
                groups[shard] = groups.get(shard, 0) + size
                if entry.name == "shards":
                    rocksdb_logs += sum(_size(e) for e in _entries(child.path) if e.name.endswith(".log"))
            elif entry.name == "raft" and child.name == "wal":
                wal = size
    disk = shutil.disk_usage(data_dir)
    return Usage(
        data_bytes=total,
        free_bytes=disk.free,
        total_bytes=disk.total,
        wal_bytes=wal,
        group_bytes=groups,
        rocksdb_log_bytes=rocksdb_logs,
    )


def _entries(path: str) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


class DiskUsage:
    """Measures the node's disk now and then, and says whether writes that add data are refused and why."""

    def __init__(
        self,
        node_id: str,
        data_dir: str,
        quota_bytes: int,
        min_free_bytes: int,
        interval_s: float = 2.0,
        *,
        logged: Callable[[], int] | None = None,
        refusing: Callable[[], None] | None = None,
    ) -> None:
        """``logged``: the bytes the node's Raft log took since it started (the estimate between measurements);
        ``refusing``: called when the node begins to refuse, and at each measurement while it does."""
        self.node_id = node_id
        self.data_dir = data_dir
        self.quota_bytes = quota_bytes
        self.min_free_bytes = min_free_bytes
        self.interval_s = interval_s
        self.usage: Usage | None = None
        """The last measurement (None before the first)."""
        self.refusal: str | None = None
        """Why writes that add data are refused now (None: they are taken)."""
        self.refusals = 0
        """Times the node went from taking writes that add data to refusing them."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._walked = 0.0
        self._replicas: set[str] = set()
        self._logged = logged
        self._refusing = refusing
        self._logged_at_walk = 0
        """What the Raft log had taken when the data directory's size in ``usage`` was measured."""
        self._logged_at_free = 0
        """What the Raft log had taken when the free space in ``usage`` was measured."""
        self._switch = threading.Lock()

    def check(self) -> Usage:
        """Measure now and decide (``decide``).

        The free space is asked every time (one ``statvfs``). The data
        directory is walked every time only with a quota (the decision
        needs it); without one, every ``WALK_INTERVAL_S`` (what status and
        metrics show) or when the replicas in ``shards/`` changed, since a
        walk stats every file, and on a busy or slow filesystem that is not
        free.
        """
        now = time.monotonic()
        last = self.usage
        # Read before measuring: what the log takes meanwhile counts in the measurement and the estimate
        # both (a little early to refuse), never in neither.
        logged = self._logged() if self._logged is not None else 0
        replicas = {entry.name for entry in _entries(os.path.join(self.data_dir, "shards"))}
        if last is None or self.quota_bytes or now - self._walked >= WALK_INTERVAL_S or replicas != self._replicas:
            # A replica opened or closed since the last walk (one listing of shards/ tells): walk again, so a
            # new vnode's size shows at once.
            usage = measure(self.data_dir)
            self._walked = now
            self._replicas = replicas
            self._logged_at_walk = logged
        else:
            disk = shutil.disk_usage(self.data_dir)
            usage = dataclasses.replace(last, free_bytes=disk.free, total_bytes=disk.total)
        self._logged_at_free = logged
        if self.decide(usage) is not None and self._refusing is not None:
            self._refusing()
        return usage

    def admits(self) -> str | None:
        """Why writes that add data are refused now (None: they are taken), asked of every proposed command.

        The last decision, unless the node takes writes and the last
        measurement plus ``GROWTH_FACTOR`` times what the Raft log took since
        passes a limit: then it begins to refuse now.
        """
        refusal, usage = self.refusal, self.usage
        if refusal is not None or usage is None or self._logged is None:
            return refusal
        logged = self._logged()
        data = usage.data_bytes + GROWTH_FACTOR * (logged - self._logged_at_walk)
        free = usage.free_bytes - GROWTH_FACTOR * (logged - self._logged_at_free)
        why = self._over(data, free, usage.rocksdb_log_bytes, resume=False)
        if why is None:
            return None
        with self._switch:
            if self.refusal is not None:
                return self.refusal
            self._begin_refusing(f"{why}, by the last measurement and what its Raft log took since")
        if self._refusing is not None:
            self._refusing()
        return self.refusal

    def decide(self, usage: Usage) -> str | None:
        """Refuse writes that add data past a limit, take them again back inside with a margin; why they are refused."""
        with self._switch:
            self.usage = usage
            refusing = self.refusal is not None
            why = self._over(usage.data_bytes, usage.free_bytes, usage.rocksdb_log_bytes, resume=refusing)
            if why is not None and not refusing:
                self._begin_refusing(why)
            else:
                if why is None and refusing:
                    log.warning("taking writes that add data again: %s", self._describe(usage))
                self.refusal = why
            return why

    def _begin_refusing(self, why: str) -> None:
        self.refusals += 1
        log.warning("refusing writes that add data: %s", why)
        self.refusal = why

    def _over(self, data_bytes: int, free_bytes: int, pending: int, resume: bool) -> str | None:
        """Why a data directory of ``data_bytes`` on a disk with ``free_bytes`` free, ``pending`` bytes of RocksDB
        logs to flush, is past a limit (None: it is not); ``resume`` asks for the margin below the limits."""
        quota, floor = self.quota_bytes, self.min_free_bytes
        quota_line = quota * RESUME_FRACTION if resume else quota
        floor_line = floor / RESUME_FRACTION if resume else floor
        # A flush writes what a RocksDB log holds to a table file before the log goes: it counts as taken.
        over_quota = bool(quota) and data_bytes + pending >= quota_line
        if not over_quota and not (floor and free_bytes - pending < floor_line):
            return None  # asked of every proposed command: nothing formatted
        flushing = f" (and {format_size(pending)} of RocksDB logs to flush)" if pending else ""
        if over_quota:
            return (
                f"node {self.node_id}'s data directory holds {format_size(data_bytes)}{flushing}, "
                f"{'not yet below 95% of ' if resume and data_bytes + pending < quota else ''}its quota of "
                f"{format_size(quota)} (disk_quota_bytes)"
            )
        return (
            f"node {self.node_id}'s disk has {format_size(free_bytes)} free{flushing}, "
            f"{'not yet 5% above' if resume and free_bytes - pending >= floor else 'below'} its floor of "
            f"{format_size(floor)} (disk_min_free_bytes)"
        )

    def _describe(self, usage: Usage) -> str:
        return (
            f"node {self.node_id}'s data directory holds {format_size(usage.data_bytes)}, "
            f"{format_size(usage.free_bytes)} free on its disk"
        )

    def metrics(self) -> Iterator[Metric]:
        """Prometheus metrics of the last measurement and of the admission control (read at scrape time)."""
        usage = self.usage
        if usage is not None:
            yield GaugeMetricFamily(
                "mqds_disk_data_dir_bytes", "Bytes the data directory takes on disk", value=usage.data_bytes
            )
            yield GaugeMetricFamily(
                "mqds_disk_free_bytes", "Free bytes of the data directory's filesystem", value=usage.free_bytes
            )
            yield GaugeMetricFamily(
                "mqds_disk_total_bytes", "Size of the data directory's filesystem", value=usage.total_bytes
            )
            replicas = GaugeMetricFamily(
                "mqds_disk_replica_bytes",
                "Bytes a replica takes on disk (its RocksDB and Raft directories), by shard",
                labels=["shard"],
            )
            for group, size in sorted(usage.group_bytes.items()):
                replicas.add_metric(["meta" if group == META_GROUP else str(group)], size)
            yield replicas
        yield GaugeMetricFamily(
            "mqds_disk_quota_bytes", "disk_quota_bytes: the data directory's limit (0 = none)", value=self.quota_bytes
        )
        yield GaugeMetricFamily(
            "mqds_disk_min_free_bytes",
            "disk_min_free_bytes: the free space kept on the disk (0 = none)",
            value=self.min_free_bytes,
        )
        yield GaugeMetricFamily(
            "mqds_disk_writes_refused",
            "1 while the node refuses new messages (STORAGE_FULL) for its disk's usage",
            value=0.0 if self.refusal is None else 1.0,
        )
        yield CounterMetricFamily(
            "mqds_disk_write_refusals",
            "Times the node began refusing new messages for its disk's usage",
            value=self.refusals,
        )

    def start(self) -> None:
        """Measure once now (so a node restarted on a full disk refuses from its first call), then in a thread."""
        self._safe_check()
        self._thread = threading.Thread(target=self._run, name="disk-usage", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._safe_check()

    def _safe_check(self) -> None:
        started = time.monotonic()
        try:
            self.check()
        except OSError as err:  # the disk guard deals with a failing disk; keep the last decision
            log.warning("measuring the disk usage of %s failed: %s", self.data_dir, err)
            return
        took = time.monotonic() - started
        if took > self.interval_s:
            log.warning("measuring the disk usage took %.1f s, longer than disk_check_interval_s", took)
