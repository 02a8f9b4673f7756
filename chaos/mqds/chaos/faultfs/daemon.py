"""The fault filesystem's process: mount, answer the control socket, serve FUSE until unmounted.

``python -m mqds.chaos.faultfs --backing DIR --mountpoint DIR --control SOCKET``
runs :func:`serve` (:class:`~mqds.chaos.faultfs.mount.FaultFs` starts it so).
It stays in the foreground until the mount is unmounted (``fusermount3 -u``)
or it gets SIGTERM or SIGINT, on which libfuse unmounts. The mount options
make the kernel ask the filesystem about every name and attribute (no entry,
attribute or negative caching: a power loss changes files behind the
kernel's back) and hand it unlinks of open files as they are (``hard_remove``).
Every write reaches the filesystem as it is made (FUSE's default write-through
mode), and each open drops the kernel's cached pages of the file.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import mfusepy

from mqds.chaos.faultfs.control import ControlServer
from mqds.chaos.faultfs.faults import ErrorRule
from mqds.chaos.faultfs.mount import is_mount_point
from mqds.chaos.faultfs.operations import FaultOperations

log = logging.getLogger(__name__)

MOUNT_OPTIONS: dict[str, Any] = {
    "attr_timeout": 0,
    "entry_timeout": 0,
    "negative_timeout": 0,
    "hard_remove": True,
    "use_ino": True,
    "fsname": "faultfs",
    "subtype": "faultfs",
}


def dispatch(ops: FaultOperations, request: dict[str, Any]) -> dict[str, Any]:
    """Carry out one command on ``ops``; its result (raises ValueError for a bad request)."""
    command = request.get("command")
    faults = ops.faults
    if command == "ping":
        return {"pid": os.getpid()}
    if command == "status":
        return {**ops.status(), "metadata": ops.metadata}
    if command == "power_loss":
        return ops.power_loss(
            torn=bool(request.get("torn", False)),
            torn_pattern=str(request.get("torn_pattern", "*")),
            seed=int(request.get("seed", 0)),
        )
    with ops.mutex:
        if command == "disk_full":
            if request.get("limit_bytes") is not None:
                limit = int(request["limit_bytes"])
            elif request.get("free_bytes") is not None:
                limit = ops.used_bytes + int(request["free_bytes"])
            else:
                raise ValueError("disk_full needs limit_bytes or free_bytes")
            faults.space_limit_bytes = max(0, limit)
            return {"limit_bytes": faults.space_limit_bytes, "used_bytes": ops.used_bytes}
        if command == "fail":
            rule = ErrorRule(
                str(request.get("pattern", "")),
                frozenset(request.get("ops", ("read", "write", "fsync"))),
                str(request.get("errno", "EIO")),
            )
            faults.rules = [*faults.rules, rule]
            return {"errors": [r.to_json() for r in faults.rules]}
        if command == "slow":
            delay = float(request.get("sync_delay_s", 0.0))
            if delay < 0:
                raise ValueError("sync_delay_s must not be negative")
            faults.sync_delay_s = delay
            return {"sync_delay_s": delay}
        if command == "heal":
            if request.get("space", True):
                faults.space_limit_bytes = None
            if request.get("errors", True):
                faults.rules = []
            if request.get("slow", True):
                faults.sync_delay_s = 0.0
            return faults.to_json()
    raise ValueError(f"unknown command {command!r}")


def serve(
    backing: str, mountpoint: str, control: str, state_dir: str, *, metadata: str = "posix", debug: bool = False
) -> None:
    """Mount ``backing`` at ``mountpoint`` and serve until unmounted."""
    os.makedirs(state_dir, exist_ok=True)
    ops = FaultOperations(backing, state_dir, metadata=metadata)
    server = ControlServer(control, lambda request: dispatch(ops, request)).start()
    log.info("faultfs: %s on %s (control %s, pid %d)", backing, mountpoint, control, os.getpid())
    try:
        mfusepy.FUSE(ops, mountpoint, foreground=True, debug=debug, **MOUNT_OPTIONS)
    except RuntimeError as err:
        # libfuse's loop ended on a signal (FaultFs.unmount sends SIGTERM when another mount namespace still holds
        # a copy of the mount): an end like any other once the mount is gone from here.
        if is_mount_point(mountpoint):
            raise
        log.info("faultfs: %s: libfuse ended with %s after the unmount", mountpoint, err)
    finally:
        server.stop()
    log.info("faultfs: %s unmounted", mountpoint)
