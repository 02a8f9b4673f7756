"""``mqds-server``: run one mqds node in the foreground until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from mqds.server.config import ConfigError, load_config
from mqds.server.node import Node, StartupError


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config, args = load_config(argv)
    except ConfigError as err:
        print(f"mqds-server: bad configuration: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(config.to_toml())
        return 0
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {config.node_id} %(name)s: %(message)s",
    )
    try:
        node = Node(config)
    except StartupError as err:
        print(f"mqds-server: cannot start: {err}", file=sys.stderr)
        return 1

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logging.getLogger(__name__).info("received %s, shutting down", signal.Signals(signum).name)
        node.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    node.start()
    # Printed once the port is bound and the node serves: scripts wait for it.
    print(f"mqds-server {config.node_id} ready on {config.listen}", flush=True)
    node.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
