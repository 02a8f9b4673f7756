"""Files and directories that survive a power loss: syncing a directory, making directories, replacing a file.

A new name in a directory (a file made or renamed, a directory made) is on
disk only once that directory is fsynced; a file's data only once the file
is. Every layer (the data directory, RocksDB's directories, the Raft log,
snapshots, the cluster's own files) makes its paths with these.
:mod:`mqds.server.raft.journal` re-exports ``fsync_dir`` and ``write_atomically``.
"""

from __future__ import annotations

import contextlib
import os


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make the names in directory ``path`` durable (what was created, renamed or removed in it)."""
    _fsync(path)


def make_dirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, each directory it makes (and ``path`` itself) made durable.

    Each new directory's parent is fsynced once the directory is made in it,
    and ``path``'s parent is fsynced even when ``path`` was there already: a
    power loss after an earlier start could otherwise still take its name.
    """
    path = os.path.abspath(path)
    missing = []
    probe = path
    while not os.path.isdir(probe):
        missing.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory)
        fsync_dir(os.path.dirname(directory))
    if not missing:
        fsync_dir(os.path.dirname(path))


def sync_file(path: str) -> None:
    """Make a file that someone else wrote (and renamed into place) durable: its data, then its name."""
    _fsync(path)
    fsync_dir(os.path.dirname(path) or ".")


def write_atomically(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new file, both whole."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")
