"""``python -m mqds.chaos.faultfs``: run the fault filesystem in the foreground (:mod:`mqds.chaos.faultfs.daemon`)."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mqds.chaos.faultfs",
        description="Mount a passthrough FUSE filesystem that can lose what was not fsynced, fill up, fail and slow "
        "down on command (see chaos/README.md). Runs in the foreground until unmounted.",
    )
    parser.add_argument("--backing", required=True, help="the directory whose files the mount shows")
    parser.add_argument("--mountpoint", required=True, help="an empty directory to mount on")
    parser.add_argument("--control", required=True, help="the Unix socket to answer commands on")
    parser.add_argument(
        "--state-dir",
        help="where the undo of unsynced writes and the unlinked files still durably named are kept (default: "
        "BACKING.faultfs beside it; it must be on the backing directory's filesystem)",
    )
    parser.add_argument(
        "--metadata",
        choices=("posix", "journal"),
        default="posix",
        help="posix (the default): a directory's entries are durable once it is synced; journal: any sync makes "
        "every directory change before it durable, as ext4's and XFS's journal do",
    )
    parser.add_argument("--debug", action="store_true", help="libfuse's debug output, every request")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from mqds.chaos.faultfs.daemon import serve  # imports mfusepy, which needs libfuse
    from mqds.chaos.faultfs.mount import default_state_dir

    state_dir = args.state_dir or default_state_dir(args.backing)
    serve(args.backing, args.mountpoint, args.control, state_dir, metadata=args.metadata, debug=args.debug)
    return 0


if __name__ == "__main__":
    sys.exit(main())
