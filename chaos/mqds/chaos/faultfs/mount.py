"""Mounting a fault filesystem from another process: :class:`FaultFs` starts it, sends it commands, unmounts it.

The filesystem runs as a process of its own (``python -m mqds.chaos.faultfs``),
so the processes that use the mount can be killed and the filesystem told to
lose power while it stays up; :class:`FaultFs` is a
:class:`~mqds.chaos.faultfs.control.ControlClient` of it. Nothing here
imports mfusepy: :func:`unavailable_reason` says why a mount cannot work
before one is tried.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from mqds.chaos.faultfs.control import ControlClient, FaultFsError

MOUNT_TIMEOUT_S = 20.0
UNMOUNT_TIMEOUT_S = 20.0
# How long the process may take to end once unmounted here, before it is told to (see FaultFs.unmount).
EXIT_GRACE_S = 2.0


def default_state_dir(backing: str | Path) -> str:
    """Where the undo and the graveyard go by default: beside the backing directory, on its filesystem."""
    return str(backing).rstrip("/") + ".faultfs"


def unavailable_reason() -> str | None:
    """Why a fault filesystem cannot be mounted here (None: it can be tried)."""
    if not sys.platform.startswith("linux"):
        return "the fault filesystem needs Linux FUSE"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as err:
        return f"/dev/fuse cannot be opened ({err.strerror}): no FUSE in this kernel or container"
    if importlib.util.find_spec("mfusepy") is None:
        return "the Python package mfusepy is not installed (make install installs the dev extras)"
    if not (ctypes.util.find_library("fuse3") or ctypes.util.find_library("fuse")):
        return "libfuse is not installed (apt-get install fuse3 libfuse3-3; make install does it as root)"
    if _unmount_command(lazy=False) is None:
        return "neither fusermount3 nor, as root, umount is there to unmount with (apt-get install fuse3)"
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        return "not root, and no fusermount3 to mount as a user with"
    return None


def is_mount_point(path: str | Path) -> bool:
    """Whether ``path`` is in this process's mount table (``os.path.ismount`` cannot stat a dead FUSE mount)."""
    target = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as table:
            for line in table:
                fields = line.split()
                # The mount point is the fifth field, with spaces and the like written as octal escapes.
                if len(fields) > 4 and fields[4].encode().decode("unicode_escape") == target:
                    return True
    except OSError:
        return os.path.ismount(path)
    return False


def _unmount_command(lazy: bool) -> list[str] | None:
    for tool in ("fusermount3", "fusermount"):
        path = shutil.which(tool)
        if path:
            return [path, "-u", *(["-z"] if lazy else [])]
    umount = shutil.which("umount")
    if umount and os.geteuid() == 0:
        return [umount, *(["-l"] if lazy else [])]
    return None


class FaultFs(ControlClient):
    """A fault filesystem showing ``backing`` at ``mountpoint``, run as a process of its own.

    ``with FaultFs(backing, mountpoint) as fs:`` mounts it and unmounts it at
    the end. ``metadata`` is ``"posix"`` (a directory's entries are durable
    once it is synced) or ``"journal"`` (any sync makes every directory change
    before it durable, as ext4's and XFS's journal do). The commands (``fs.power_loss()``, ``fs.disk_full(...)``,
    ``fs.fail(...)``, ``fs.slow(...)``, ``fs.heal()``, ``fs.status()``) are
    those of :class:`~mqds.chaos.faultfs.control.ControlClient`.
    """

    def __init__(
        self,
        backing: str | Path,
        mountpoint: str | Path,
        *,
        state_dir: str | Path | None = None,
        log_path: str | Path | None = None,
        metadata: str = "posix",
    ) -> None:
        self.metadata = metadata
        self.backing = Path(backing).absolute()
        self.mountpoint = Path(mountpoint).absolute()
        self.state_dir = Path(state_dir or default_state_dir(self.backing)).absolute()
        self.log_path = Path(log_path or f"{self.backing}.faultfs.log").absolute()
        # A Unix socket's path is short (108 bytes): a directory of its own under the temporary directory.
        self._control_dir: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        super().__init__("")

    def __enter__(self) -> FaultFs:
        return self.mount()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.unmount()

    def mounted(self) -> bool:
        """Whether the mount point is in the mount table (a filesystem that died is, and answers nothing)."""
        return is_mount_point(self.mountpoint)

    def output(self) -> str:
        """The end of the filesystem's log."""
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def mount(self, timeout_s: float = MOUNT_TIMEOUT_S) -> FaultFs:
        """Start the filesystem and wait until the mount answers."""
        if self.proc is not None and self.proc.poll() is None:
            raise FaultFsError(f"{self.mountpoint} is mounted by this FaultFs already")
        if self.mounted():
            raise FaultFsError(f"{self.mountpoint} is a mount point already")
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self._control_dir = tempfile.mkdtemp(prefix="faultfs-")
        self.path = os.path.join(self._control_dir, "control.sock")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "mqds.chaos.faultfs", "--backing", str(self.backing)]
        command += ["--mountpoint", str(self.mountpoint), "--control", self.path, "--state-dir", str(self.state_dir)]
        command += ["--metadata", self.metadata]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._forget_control()
                raise FaultFsError(
                    f"the fault filesystem for {self.mountpoint} exited with {self.proc.returncode}:\n{self.output()}"
                )
            if self.mounted() and os.path.exists(self.path):
                try:
                    self.ping()
                    return self
                except FaultFsError:
                    pass
            time.sleep(0.05)
        self.unmount()
        raise FaultFsError(
            f"the fault filesystem for {self.mountpoint} did not mount in {timeout_s:g}s:\n{self.output()}"
        )

    def unmount(self, timeout_s: float = UNMOUNT_TIMEOUT_S) -> None:
        """Unmount (retrying while it is busy, lazily at the end) and wait for the process to exit."""
        if self.proc is None:
            return
        deadline = time.monotonic() + timeout_s
        last = ""
        command = _unmount_command(lazy=False)
        while self.mounted() and self.proc.poll() is None and time.monotonic() < deadline and command:
            done = subprocess.run([*command, str(self.mountpoint)], capture_output=True, text=True, check=False)
            if done.returncode == 0:
                break
            last = done.stderr.strip()
            time.sleep(0.1)
        lazy = _unmount_command(lazy=True)
        if self.mounted() and lazy:
            # Busy past the deadline, or the filesystem died: detach it, or the mount point stays broken.
            subprocess.run([*lazy, str(self.mountpoint)], capture_output=True, check=False)
        try:
            self.proc.wait(timeout=EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            # Gone from this mount namespace, but still in another one: a process started meanwhile under
            # `ip netns exec` (a chaos node, another test's) got a copy of the mount table, and where mounts are
            # private (containers) no unmount reaches it, so libfuse waits for it. SIGTERM ends its loop (the
            # copies are left dead, and no process uses them).
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self._forget_control()
        if self.mounted():
            raise FaultFsError(f"{self.mountpoint} is still mounted: {last}")
        # What the filesystem kept of the durable state (it clears it when it ends well): the live state stays.
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def _forget_control(self) -> None:
        if self._control_dir is not None:
            shutil.rmtree(self._control_dir, ignore_errors=True)
            self._control_dir = None
