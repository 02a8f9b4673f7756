"""A fault-injecting FUSE filesystem for the chaos runs: power loss, a full disk, I/O errors, slow syncs.

A passthrough filesystem (libfuse's high-level API through mfusepy) shows a
backing directory at a mount point, runs as a process of its own, and takes
commands on a Unix socket. What it shows is the *live* state, what a process
reads back: every write goes to the backing file at once. What it tracks
is the *durable* state, what a disk would hold after losing power, kept as
the undo of everything not synced since:

- a file's data (:mod:`~mqds.chaos.faultfs.files`): the size its last fsync
  or fdatasync made durable, and the durable bytes that later overwrites and
  truncates changed, saved once before they change. Appends, the common case,
  need nothing saved: a power loss cuts the file back to its durable size. A
  failed fsync loses what it should have written for good, even when a later
  fsync succeeds (as Linux does);
- directory entries (:mod:`~mqds.chaos.faultfs.namespace`): a directory's
  entries as of its last fsync, recorded at its first change since. Nodes
  unlinked or renamed over while a durable entry still names them wait in a
  graveyard (on the backing filesystem, so they keep their inode and open
  descriptors) until the directory is synced.

A power loss (:meth:`~mqds.chaos.faultfs.operations.FaultOperations.power_loss`)
makes the live state the durable one: directories lose the entries they did
not sync and get back those they lost, files are cut back and their saved
bytes put back, and optionally a prefix of each file's last unsynced write
survives (a torn write). The other faults are in
:mod:`~mqds.chaos.faultfs.faults`; the commands in
:mod:`~mqds.chaos.faultfs.control`.

Modules: :mod:`~mqds.chaos.faultfs.extents` (byte range sets),
:mod:`~mqds.chaos.faultfs.files`, :mod:`~mqds.chaos.faultfs.namespace`,
:mod:`~mqds.chaos.faultfs.faults`, :mod:`~mqds.chaos.faultfs.handles`,
:mod:`~mqds.chaos.faultfs.powerloss`, :mod:`~mqds.chaos.faultfs.operations`
(the FUSE operations), :mod:`~mqds.chaos.faultfs.daemon` (the filesystem's
process), :mod:`~mqds.chaos.faultfs.control` (the control socket and its
client), :mod:`~mqds.chaos.faultfs.mount` (:class:`FaultFs`: mount,
commands, unmount). Only ``operations`` and ``daemon`` import mfusepy; this
package's exports do not, so a machine without libfuse can import them and
ask :func:`unavailable_reason`.
"""

from mqds.chaos.faultfs.control import ControlClient, FaultFsError
from mqds.chaos.faultfs.mount import FaultFs, default_state_dir, is_mount_point, unavailable_reason

__all__ = ["ControlClient", "FaultFs", "FaultFsError", "default_state_dir", "is_mount_point", "unavailable_reason"]
