"""The fault filesystem's FUSE operations: a passthrough to a backing directory, keeping the undo of the unsynced.

:class:`FaultOperations` is an ``mfusepy.Operations``: every call goes to the
same path under the backing directory, under one lock, after three checks
(the caller still lives, no injected error, space left). Writes and truncates
first let the file's :class:`~mqds.chaos.faultfs.files.FileRecord` save the
durable bytes they change; creates, unlinks, renames and mkdirs first let the
:class:`~mqds.chaos.faultfs.namespace.Namespace` record the directory's
durable entries. fsync and fdatasync make a file durable, fsync of a
directory its entries (with ``metadata="journal"``, any sync makes every
directory's entries durable, as ext4's and XFS's journal do); neither syncs
the backing disk (the real machine does not lose power, and the runs go
faster for it). O_SYNC and O_DSYNC writes are synced as they return.

The operations that act on an open file use the file descriptor the open
call made (the file may have been renamed or unlinked since). An operation
from a process that no longer exists (a request of a node killed before a
power loss, read by the filesystem only afterwards) fails with EIO, so
nothing a dead node asked for lands on the restored state.

:meth:`FaultOperations.power_loss` and the fault commands are called from the
control socket's thread (:mod:`~mqds.chaos.faultfs.control`).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from typing import Any

import mfusepy

from mqds.chaos.faultfs.faults import Faults
from mqds.chaos.faultfs.files import FileRecord
from mqds.chaos.faultfs.handles import Handle, HandleTable
from mqds.chaos.faultfs.namespace import Namespace, clear_dir
from mqds.chaos.faultfs.powerloss import lose_power

log = logging.getLogger(__name__)

# Flags the backing file is never opened with: the filesystem keeps its own offsets (pwrite on an O_APPEND
# descriptor would ignore them), does its own truncation and syncing, and writes from unaligned buffers.
_STRIPPED = os.O_ACCMODE | os.O_CREAT | os.O_EXCL | os.O_TRUNC | os.O_APPEND | os.O_DIRECT | os.O_SYNC | os.O_DSYNC
# posix: a directory's entries are durable once that directory is synced. journal: any sync that succeeds makes
# every directory change made before it durable, as the metadata journal of ext4 or XFS does.
METADATA_MODES = ("posix", "journal")
_STAT_FIELDS = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_ino", "st_blocks", "st_rdev")


def _fail(code: int) -> mfusepy.FuseOSError:
    return mfusepy.FuseOSError(code)


class FaultOperations(mfusepy.Operations):
    """A passthrough filesystem over ``backing`` that can lose power (see the module docstring)."""

    use_ns = True

    def __init__(self, backing: str, state_dir: str, faults: Faults | None = None, metadata: str = "posix") -> None:
        if metadata not in METADATA_MODES:
            raise ValueError(f"metadata must be one of {', '.join(METADATA_MODES)}; got {metadata!r}")
        self.metadata = metadata
        self.backing = os.path.realpath(backing)
        self.state_dir = os.path.realpath(state_dir)
        if os.lstat(self.backing).st_dev != os.lstat(self.state_dir).st_dev:
            raise ValueError(f"the state directory {state_dir} must be on the backing directory's filesystem")
        self.undo_dir = os.path.join(self.state_dir, "undo")
        graveyard = os.path.join(self.state_dir, "graveyard")
        clear_dir(self.undo_dir)
        clear_dir(graveyard)
        self.mutex = threading.RLock()
        self.faults = faults or Faults()
        self.names = Namespace(self.backing, graveyard)
        self.files: dict[int, FileRecord] = {}
        self.handles = HandleTable()
        self.detached: set[int] = set()
        """Inodes out of the live tree that open files still hold: their growth uses no space."""
        self.used_bytes = self._measure()
        self.power_losses = 0

    # --- helpers -------------------------------------------------------------------------------------------------

    def _real(self, path: str | None) -> str:
        if path is None:
            raise _fail(errno.ENOENT)
        return self.backing + path if path != "/" else self.backing

    def _measure(self) -> int:
        total = 0
        for dirpath, _, filenames in os.walk(self.backing):
            for name in filenames:
                st = os.lstat(os.path.join(dirpath, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
        return total

    @staticmethod
    def _check_caller() -> None:
        """EIO for a request of a process that is gone (killed while the request waited)."""
        _, _, pid = mfusepy.fuse_get_context()
        if pid <= 0 or pid == os.getpid():
            return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise _fail(errno.EIO) from None
        except PermissionError:
            pass

    def _handle(self, fh: int | None) -> Handle:
        return self.handles.get(fh)

    def _busy(self) -> set[int]:
        return self.handles.busy()

    def _inject(self, op: str, path: str | None) -> None:
        code = self.faults.error(op, path)
        if code is not None:
            raise _fail(code)

    def _reserve(self, growth: int, ino: int) -> None:
        code = None if ino in self.detached else self.faults.space_error(self.used_bytes, growth)
        if code is not None:
            raise _fail(code)

    def _reserve_name(self) -> None:
        code = self.faults.create_error(self.used_bytes)
        if code is not None:
            raise _fail(code)

    def _grow(self, ino: int, delta: int) -> None:
        if ino not in self.detached:
            self.used_bytes += delta

    def _record(self, ino: int, live_size: int) -> FileRecord:
        record = self.files.get(ino)
        if record is None:
            record = FileRecord(ino, live_size, os.path.join(self.undo_dir, str(ino)))
            self.files[ino] = record
        return record

    def _forget(self, inos: list[int]) -> None:
        for ino in inos:
            record = self.files.pop(ino, None)
            if record is not None:
                record.close()

    def _parent(self, path: str) -> str:
        return self._real(os.path.dirname(path))

    def _truncate_fd(self, fd: int, ino: int, length: int) -> None:
        size = os.fstat(fd).st_size
        if length == size:
            return
        self._reserve(max(0, length - size), ino)
        self._record(ino, size).before_truncate(fd, size, length)
        os.ftruncate(fd, length)
        self._grow(ino, length - size)

    def _sync_file(self, h: Handle) -> None:
        self._inject_sync(h)
        record = self.files.get(h.ino)
        if record is not None and record.commit(os.fstat(h.fd).st_size):
            self._forget([h.ino])
        if self.metadata == "journal":
            self._commit_names(None)

    def _commit_names(self, ino: int | None) -> None:
        """Directory ``ino``'s entries (every directory's, with the journal's metadata: ``ino`` None) are durable."""
        if self.metadata == "journal" or ino is None:
            changed = bool(self.names.dirs)
            self.names.dirs.clear()
        else:
            changed = self.names.commit(ino)
        if changed:
            self._forget(self.names.collect(self._busy()))

    def _inject_sync(self, h: Handle) -> None:
        code = self.faults.error("fsync", h.path)
        if code is None:
            return
        record = self.files.get(h.ino)
        if record is not None and not h.is_dir:
            lost = record.fail()
            log.info("faultfs: fsync of %s failed (injected): %d unsynced bytes lost for good", h.path, lost)
        raise _fail(code)

    def _sleep_before_sync(self) -> None:
        delay = self.faults.sync_delay_s
        if delay > 0:
            with self.mutex:
                self.faults.counts["delayed_syncs"] += 1
            time.sleep(delay)

    # --- attributes and directories ---------------------------------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        with self.mutex:
            st = os.fstat(self._handle(fh).fd) if fh else os.lstat(self._real(path))
        attrs: dict[str, Any] = {key: getattr(st, key) for key in _STAT_FIELDS}
        attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return attrs

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self.backing)
        out = {key: getattr(sv, key) for key in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail")}
        out.update(f_files=sv.f_files, f_ffree=sv.f_ffree, f_favail=sv.f_favail, f_namemax=sv.f_namemax)
        limit = self.faults.space_limit_bytes
        if limit is not None:
            free = max(0, limit - self.used_bytes) // sv.f_frsize
            out.update(f_blocks=limit // sv.f_frsize, f_bfree=free, f_bavail=free)
        return out

    def opendir(self, path: str) -> int:
        with self.mutex:
            fd = os.open(self._real(path), os.O_RDONLY | os.O_DIRECTORY)
            return self.handles.add(fd, path, is_dir=True)

    def readdir(self, path: str, fh: int) -> list[tuple[str, dict[str, int], int]]:
        # With use_ino the kernel is given each entry's inode number, and skips an entry numbered 0.
        with self.mutex:
            h = self._handle(fh)
            here = os.fstat(h.fd)
            up = os.stat("..", dir_fd=h.fd)
            out = [(".", {"st_ino": here.st_ino, "st_mode": here.st_mode}, 0)]
            out.append(("..", {"st_ino": up.st_ino, "st_mode": up.st_mode}, 0))
            with os.scandir(h.fd) as entries:
                for entry in entries:
                    kind = stat.S_IFDIR if entry.is_dir(follow_symlinks=False) else stat.S_IFREG
                    if entry.is_symlink():
                        kind = stat.S_IFLNK
                    out.append((entry.name, {"st_ino": entry.inode(), "st_mode": kind}, 0))
            return out

    def releasedir(self, path: str, fh: int) -> int:
        return self.release(path, fh)

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        self._check_caller()
        self._sleep_before_sync()
        with self.mutex:
            h = self._handle(fh)
            self._inject_sync(h)
            self._commit_names(h.ino)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        self._check_caller()
        with self.mutex:
            self._reserve_name()
            self.names.touch(self._parent(path))
            real = self._real(path)
            os.mkdir(real, mode)
            self.names.new_dir(os.lstat(real).st_ino)
        return 0

    def rmdir(self, path: str) -> int:
        self._check_caller()
        with self.mutex:
            real = self._real(path)
            st = os.lstat(real)
            if not stat.S_ISDIR(st.st_mode):
                raise _fail(errno.ENOTDIR)
            if os.listdir(real):
                raise _fail(errno.ENOTEMPTY)
            self.names.touch(self._parent(path))
            self.names.discard(real, st)
        return 0

    # --- names of files ---------------------------------------------------------------------------------------

    def _remove_name(self, real: str, st: os.stat_result) -> None:
        """Unlink (or replace) ``real``: the space it used is free, its record goes with it unless it lives on."""
        gone = self.names.discard(real, st)
        if stat.S_ISREG(st.st_mode):
            self._grow(st.st_ino, -st.st_size)
        if st.st_ino in self._busy():
            self.detached.add(st.st_ino)
        elif gone and st.st_nlink <= 1:
            self._forget([st.st_ino])

    def unlink(self, path: str) -> int:
        self._check_caller()
        with self.mutex:
            real = self._real(path)
            st = os.lstat(real)
            if stat.S_ISDIR(st.st_mode):
                raise _fail(errno.EISDIR)
            self.names.touch(self._parent(path))
            self._remove_name(real, st)
        return 0

    def rename(self, old: str, new: str) -> int:
        self._check_caller()
        with self.mutex:
            src, dst = self._real(old), self._real(new)
            st = os.lstat(src)
            if src == dst:
                return 0
            if dst.startswith(src + "/"):
                raise _fail(errno.EINVAL)
            try:
                target: os.stat_result | None = os.lstat(dst)
            except FileNotFoundError:
                target = None
            if target is not None:
                if target.st_ino == st.st_ino:
                    return 0
                if stat.S_ISDIR(target.st_mode) and not stat.S_ISDIR(st.st_mode):
                    raise _fail(errno.EISDIR)
                if stat.S_ISDIR(st.st_mode) and not stat.S_ISDIR(target.st_mode):
                    raise _fail(errno.ENOTDIR)
                if stat.S_ISDIR(target.st_mode) and os.listdir(dst):
                    raise _fail(errno.ENOTEMPTY)
            self.names.touch(self._parent(old))
            self.names.touch(self._parent(new))
            if target is not None:
                self._remove_name(dst, target)
            os.rename(src, dst)
            self.handles.renamed(old, new)
        return 0

    def symlink(self, target: str, source: str) -> int:
        self._check_caller()
        with self.mutex:
            self._reserve_name()
            self.names.touch(self._parent(target))
            os.symlink(source, self._real(target))
        return 0

    def readlink(self, path: str) -> str:
        return os.readlink(self._real(path))

    def link(self, target: str, source: str) -> int:
        # RocksDB's checkpoints (mqds's snapshots) link table files. A link is a name like any other; the node's
        # data and undo stay one, and the space is counted per name, as du does.
        self._check_caller()
        with self.mutex:
            self._reserve_name()
            real = self._real(source)
            st = os.lstat(real)
            self.names.touch(self._parent(target))
            os.link(real, self._real(target), follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                self._grow(st.st_ino, st.st_size)
        return 0

    def chmod(self, path: str, mode: int) -> int:
        with self.mutex:
            os.chmod(self._real(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        with self.mutex:
            os.chown(self._real(path), uid, gid, follow_symlinks=False)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        with self.mutex:
            if times is None:
                os.utime(self._real(path), follow_symlinks=False)
            else:
                os.utime(self._real(path), ns=times, follow_symlinks=False)
        return 0

    # --- file contents ----------------------------------------------------------------------------------------

    def _open_backing(self, real: str, flags: int, mode: int = 0o644) -> int:
        extra = (flags & ~_STRIPPED) | (flags & os.O_CREAT)
        try:
            return os.open(real, os.O_RDWR | extra, mode)
        except PermissionError:
            # Not writable (or not readable) for us: as asked, then. Saving undo bytes needs to read.
            return os.open(real, (flags & os.O_ACCMODE) | extra, mode)

    def create(self, path: str, mode: int, flags: int) -> int:
        self._check_caller()
        with self.mutex:
            real = self._real(path)
            existed = os.path.lexists(real)
            if existed and flags & os.O_EXCL:
                raise _fail(errno.EEXIST)
            if not existed:
                self._reserve_name()
                self.names.touch(self._parent(path))
            fd = self._open_backing(real, flags | os.O_CREAT, mode)
            ino = os.fstat(fd).st_ino
            if not existed:
                self._record(ino, 0)
            elif flags & os.O_TRUNC:
                self._truncate_fd(fd, ino, 0)
            return self.handles.add(fd, path, is_dir=False, sync_writes=bool(flags & (os.O_SYNC | os.O_DSYNC)))

    def open(self, path: str, flags: int) -> int:
        with self.mutex:
            if flags & os.O_TRUNC:
                self._check_caller()
            fd = self._open_backing(self._real(path), flags)
            try:
                if flags & os.O_TRUNC:
                    self._inject("write", path)
                    self._truncate_fd(fd, os.fstat(fd).st_ino, 0)
            except BaseException:
                os.close(fd)
                raise
            return self.handles.add(fd, path, is_dir=False, sync_writes=bool(flags & (os.O_SYNC | os.O_DSYNC)))

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        with self.mutex:
            h = self._handle(fh)
            self._inject("read", h.path)
            return os.pread(h.fd, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self._check_caller()
        with self.mutex:
            h = self._handle(fh)
            self._inject("write", h.path)
            size = os.fstat(h.fd).st_size
            growth = max(0, offset + len(data) - size)
            self._reserve(growth, h.ino)
            self._record(h.ino, size).before_write(h.fd, offset, len(data))
            done = 0
            while done < len(data):
                done += os.pwrite(h.fd, data[done:], offset + done)
            self._grow(h.ino, growth)
            if h.sync_writes:
                self._sync_file(h)
            return len(data)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        self._check_caller()
        with self.mutex:
            if fh:
                h = self._handle(fh)
                self._inject("write", h.path)
                self._truncate_fd(h.fd, h.ino, length)
                return 0
            self._inject("write", path)
            fd = os.open(self._real(path), os.O_RDWR)
            try:
                self._truncate_fd(fd, os.fstat(fd).st_ino, length)
            finally:
                os.close(fd)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        self._check_caller()
        self._sleep_before_sync()
        with self.mutex:
            self._sync_file(self._handle(fh))
        return 0

    def fallocate(self, path: str, mode: int, offset: int, size: int, fh: int) -> int:
        # RocksDB preallocates with FALLOC_FL_KEEP_SIZE and goes on without it; glibc's posix_fallocate writes zeros.
        raise _fail(errno.EOPNOTSUPP)

    def release(self, path: str, fh: int) -> int:
        with self.mutex:
            h = self.handles.pop(fh)
            if h is None or h.dead:
                return 0
            nlink = os.fstat(h.fd).st_nlink
            os.close(h.fd)
            if h.ino in self._busy():
                return 0
            self.detached.discard(h.ino)
            if h.ino in self.names.buried:
                self._forget(self.names.collect(self._busy()))
            elif nlink == 0 and not h.is_dir:
                self._forget([h.ino])
        return 0

    def destroy(self, path: str) -> None:
        """Unmounted: the live tree is what stays; the undo and the graveyard go."""
        with self.mutex:
            self.handles.close_all()
            self._forget(list(self.files))
            clear_dir(self.undo_dir)
            clear_dir(self.names.graveyard)
            os.rmdir(self.undo_dir)
            os.rmdir(self.names.graveyard)

    # --- commands (from the control socket) -------------------------------------------------------------------

    def power_loss(self, torn: bool = False, torn_pattern: str = "*", seed: int = 0) -> dict[str, Any]:
        """Lose everything not synced (the caller killed the processes using the mount first).

        With ``torn``, the last unsynced writes of each file whose path matches
        ``torn_pattern`` leave a prefix behind (at least one byte, never all
        of it; its length drawn from ``seed``). See :mod:`~mqds.chaos.faultfs.powerloss`.
        """
        with self.mutex:
            self.detached.clear()
            report = lose_power(
                self.backing, self.names, self.files, self.handles, torn=torn, torn_pattern=torn_pattern, seed=seed
            )
            self.used_bytes = self._measure()
            self.power_losses += 1
            return report

    def status(self) -> dict[str, Any]:
        with self.mutex:
            return {
                "used_bytes": self.used_bytes,
                "files_with_unsynced_data": len(self.files),
                "bytes_written_since_sync": sum(r.written.total() for r in self.files.values()),
                "bytes_lost_to_failed_syncs": sum(r.lost.total() for r in self.files.values()),
                "dirs_with_unsynced_entries": len(self.names.dirs),
                "unsynced_entries": self.names.unsynced(),
                "graveyard": len(self.names.buried),
                "open_files": self.handles.open_count(),
                "power_losses": self.power_losses,
                "faults": self.faults.to_json(),
            }
