"""``mqds-server``: run one mqds node in the foreground until SIGTERM or SIGINT."""

from __future__ import annotations

import json
import logging
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from types import FrameType
from typing import TextIO

from mqds.server.config import ConfigError, NodeConfig, load_config
from mqds.server.node import runtime
from mqds.server.node.node import Node
from mqds.server.startup import StartupError


class JsonFormatter(logging.Formatter):
    """One JSON object a line (``time``, ``level``, ``logger``, ``message``, ``node``), for log collectors."""

    def __init__(self, node_id: str) -> None:
        super().__init__()
        self.node_id = node_id

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "node": self.node_id,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(config: NodeConfig, stream: TextIO | None = None) -> None:
    """Log to stderr (or ``stream``) at ``log_level``, as text lines or, with ``log_format=json``, JSON lines."""
    handler = logging.StreamHandler(stream)
    if config.log_format == "json":
        handler.setFormatter(JsonFormatter(config.node_id))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {config.node_id} %(name)s: %(message)s"))
    logging.basicConfig(level=config.log_level.upper(), handlers=[handler])


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config, args = load_config(argv)
    except ConfigError as err:
        print(f"mqds-server: bad configuration: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(config.to_toml())
        return 0
    configure_logging(config)
    runtime.tune_process()
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
    runtime.freeze_startup_objects()
    # Printed once the port is bound and the node serves: scripts wait for it.
    print(f"mqds-server {config.node_id} ready on {config.listen}", flush=True)
    node.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
