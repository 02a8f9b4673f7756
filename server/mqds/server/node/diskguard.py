"""What a node does when its disk fails under it: leave its Raft groups, wait for the disk, restart from disk.

A failed write or fsync of the Raft log fences the log for good (what it left
on disk is unknown, and a page whose fsync failed may be gone from the cache:
PostgreSQL's "fsyncgate"); a replica's RocksDB refuses every write after one
failed. Neither heals by retrying, and until this guard the node stayed
wedged: its groups' cycles failed over and over, and a leader among them kept
its vnodes, since its heartbeats need no log write and no follower
campaigned.

So on the first such failure (``failed``) the guard cuts the node off from
its peers (``isolate``: no Raft traffic either way, so the other replicas
elect leaders that can write, and clients' writes move to them) and then
probes the data directory once a second: a small file written, fsynced and
removed. Once a probe passes (space came back, the device answers) it
restarts the process in place (``restart``: ``os.execv`` of the same command
line, the same process id), and the node recovers from what is durable, as
after a crash. Meanwhile it stays up: its API answers (reads of what its
replicas applied; writes are refused as on any replica that is not leader).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable

from mqds.server.durable import fsync_dir

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
PROBE_BYTES = 64 * 1024
PROBE_NAME = "disk-probe"


def probe(directory: str) -> bool:
    """Whether ``directory`` takes a write now: a file of ``PROBE_BYTES`` written, fsynced, removed."""
    path = os.path.join(directory, PROBE_NAME)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(path)
        fsync_dir(directory)
    except OSError as err:
        log.debug("disk probe failed: %s", err)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return False
    return True


def reexec() -> None:
    """Replace this process with a new start of the same command line (same process id)."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)


class DiskGuard:
    """Watches for a failed disk: ``failed`` once, then isolation, probes, and a restart when the disk is back."""

    def __init__(
        self,
        probe_dir: str,
        isolate: Callable[[], None],
        restart: Callable[[], None] = reexec,
        interval_s: float = PROBE_INTERVAL_S,
    ) -> None:
        self.probe_dir = probe_dir
        self._isolate = isolate
        self._restart = restart
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.failure: str | None = None
        """Why the node left its groups (None while its disk works)."""

    def failed(self, err: BaseException) -> None:
        """The disk failed (the Raft log or a replica's storage could not write): leave, and wait for it."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = f"{type(err).__name__}: {err}"
        log.critical(
            "the disk failed (%s): this node leaves its Raft groups (no Raft traffic in or out) and restarts "
            "from what is durable once a write to %s succeeds again",
            self.failure,
            self.probe_dir,
        )
        # On a thread of its own: the caller may hold the log's lock, and isolating tells the groups.
        threading.Thread(target=self._wait_for_disk, name="disk-guard", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _wait_for_disk(self) -> None:
        self._isolate()
        probes = 0
        while not self._stop.wait(self.interval_s):
            probes += 1
            if probe(self.probe_dir):
                log.warning("the disk takes writes again (after %d probes): restarting from what is durable", probes)
                self._restart()
                return
            if probes % 30 == 0:
                log.warning("the disk still fails (%d probes); this node stays out of its Raft groups", probes)
