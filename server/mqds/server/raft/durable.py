"""Writing files so that they survive a crash: syncing a directory, replacing a file whole.

Used by the Raft log (new segments), snapshots, and the cluster's own files;
:mod:`mqds.server.raft.journal` re-exports both, where other modules import them from.
"""

from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new file, both whole."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")
