"""A power loss on a fault filesystem: everything not synced is lost, the last unsynced writes torn on request.

:func:`lose_power` (called by
:meth:`~mqds.chaos.faultfs.operations.FaultOperations.power_loss`, holding
its lock) closes every open file, makes the live directory tree the durable
one (:meth:`~mqds.chaos.faultfs.namespace.Namespace.restore`), cuts each
file with unsynced data back to what is durable
(:meth:`~mqds.chaos.faultfs.files.FileRecord.restore`) and, with ``torn``,
writes back a prefix of its last run of unsynced writes, as a disk that lost
power in the middle of writing it back would hold.
"""

from __future__ import annotations

import fnmatch
import os
import random
import stat
from typing import Any

from mqds.chaos.faultfs.files import FileRecord
from mqds.chaos.faultfs.handles import HandleTable
from mqds.chaos.faultfs.namespace import Namespace


def lose_power(
    root: str,
    names: Namespace,
    files: dict[int, FileRecord],
    handles: HandleTable,
    *,
    torn: bool,
    torn_pattern: str,
    seed: int,
) -> dict[str, Any]:
    """Lose what ``names`` and ``files`` say is not durable; what was lost (the records are all used up)."""
    rng = random.Random(seed)
    handles.close_all()
    placed, deleted, counts = names.restore()
    reverted, bytes_changed, torn_files = 0, 0, []
    for ino, record in sorted(files.items()):
        path = placed.get(ino)
        if ino in deleted or path is None or not stat.S_ISREG(os.lstat(path).st_mode):
            continue
        fd = os.open(path, os.O_RDWR)
        try:
            relative = os.path.relpath(path, root)
            tear = None
            if torn and fnmatch.fnmatchcase(relative, torn_pattern):
                tear = record.torn_bytes(fd, os.fstat(fd).st_size, rng.random())
            changed = record.restore(fd)
            if tear is not None:
                os.pwrite(fd, tear[1], tear[0])
                torn_files.append({"path": relative, "offset": tear[0], "kept_bytes": len(tear[1])})
        finally:
            os.close(fd)
        reverted += 1 if changed else 0
        bytes_changed += changed
    for record in files.values():
        record.close()
    files.clear()
    return {**counts, "files_reverted": reverted, "bytes_reverted": bytes_changed, "torn": torn_files}
