"""The node's disk guard: a failed disk makes the node leave its groups, probe, and restart once the disk is back."""

from __future__ import annotations

import threading
from pathlib import Path

from mqds.server.node import diskguard
from mqds.server.node.diskguard import DiskGuard


def test_a_probe_passes_on_a_writable_directory_and_fails_where_nothing_can_be_written(tmp_path: Path) -> None:
    assert diskguard.probe(str(tmp_path))
    assert not (tmp_path / diskguard.PROBE_NAME).exists()  # it cleans up after itself
    assert not diskguard.probe(str(tmp_path / "missing"))


def test_a_failed_disk_isolates_the_node_once_and_restarts_it_only_when_a_write_succeeds(tmp_path: Path) -> None:
    probe_dir = tmp_path / "tmp"  # missing: every probe fails, as on a full disk
    isolated: list[bool] = []
    restarted = threading.Event()
    guard = DiskGuard(str(probe_dir), isolate=lambda: isolated.append(True), restart=restarted.set, interval_s=0.05)
    try:
        guard.failed(OSError(28, "No space left on device"))
        guard.failed(OSError(5, "Input/output error"))  # the same failure seen elsewhere: nothing more
        assert not restarted.wait(0.5)  # probes go on failing: the node stays out, and up
        assert isolated == [True]
        assert guard.failure == "OSError: [Errno 28] No space left on device"
        probe_dir.mkdir()  # space came back
        assert restarted.wait(5)
    finally:
        guard.stop()


def test_a_stopped_guard_never_restarts(tmp_path: Path) -> None:
    restarted = threading.Event()
    guard = DiskGuard(str(tmp_path / "missing"), isolate=lambda: None, restart=restarted.set, interval_s=0.05)
    guard.failed(OSError(28, "No space left on device"))
    guard.stop()
    (tmp_path / "missing").mkdir()
    assert not restarted.wait(0.3)
