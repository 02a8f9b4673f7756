"""mqds: the command line of an mqds cluster.

Commands that talk to a cluster take --endpoints (or $MQDS_ENDPOINTS): any
node(s) of it, before or after the command name. 'mqds COMMAND --help'
explains each command.

Exit codes: 0 done; 1 failed (e.g. no node answered; the message says why);
2 a wrong command line; 3 'mqds status' of a degraded cluster; 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from mqds.cli import admin, backup, consumers, delete, generations, messages, plugins, retention, secret, status
from mqds.cli.console import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, CommandError
from mqds.protocol.errors import InvalidArgumentError, MqdsError
from mqds.protocol.malloc import tune_malloc

DEFAULT_ENDPOINTS = "127.0.0.1:7101"


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be above 0")
    return value


def _connection_options(top_level: bool) -> argparse.ArgumentParser:
    """--endpoints and --timeout; accepted before the command and after it (the later one wins)."""
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--endpoints",
        metavar="HOST:PORT,...",
        default=os.environ.get("MQDS_ENDPOINTS", DEFAULT_ENDPOINTS) if top_level else argparse.SUPPRESS,
        help=f"one or more nodes of the cluster, comma-separated (default: $MQDS_ENDPOINTS or {DEFAULT_ENDPOINTS})",
    )
    group.add_argument(
        "--timeout",
        type=_seconds,
        metavar="SECONDS",
        default=None if top_level else argparse.SUPPRESS,
        help="how long a call may take, retries included (default: 15 for status, 30 for pub, replay, "
        "generations and bench, 1800 for admin)",
    )
    hidden = None if top_level else argparse.SUPPRESS
    group.add_argument(
        "--tls",
        action="store_true",
        default=False if top_level else argparse.SUPPRESS,
        help="connect with TLS, checking the nodes' certificates against the system's roots (or --tls-ca)",
    )
    group.add_argument(
        "--tls-ca", metavar="FILE", default=hidden, help="PEM file of the CA that signed the nodes' certificates"
    )
    group.add_argument(
        "--tls-cert", metavar="FILE", default=hidden, help="PEM client certificate, for nodes that require mutual TLS"
    )
    group.add_argument("--tls-key", metavar="FILE", default=hidden, help="PEM private key of --tls-cert")
    group.add_argument(
        "--tls-server-name",
        metavar="NAME",
        default=hidden,
        help="the name the nodes' certificates must carry, when it is not the host of --endpoints",
    )
    group.add_argument(
        "--token",
        metavar="TOKEN",
        default=os.environ.get("MQDS_TOKEN") if top_level else argparse.SUPPRESS,
        help="bearer token sent with every call (default: $MQDS_TOKEN)",
    )
    return parser


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; of the other packages' commands (:mod:`mqds.cli.plugins`) only ``command``'s
    options are loaded (every one's when None)."""
    parser = argparse.ArgumentParser(
        prog="mqds",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[_connection_options(top_level=True)],
    )
    connection = _connection_options(top_level=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    status.register(sub, connection)
    messages.register(sub, connection)
    generations.register(sub, connection)
    delete.register(sub, connection)
    retention.register(sub, connection)
    consumers.register(sub, connection)
    backup.register(sub, connection)
    admin.register(sub, connection)
    plugins.register(sub, connection, command)
    return parser


class _Quiet(argparse.ArgumentParser):
    """A parser that raises what is wrong instead of printing it and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def _command(args: list[str]) -> str | None:
    """The command ``args`` name, past the connection options before it; None for none, or for help asked
    before it (what is wrong with the options the whole parser says)."""
    first = _Quiet(add_help=False, parents=[_connection_options(top_level=True)])
    first.add_argument("command", nargs="?")
    try:
        command = first.parse_known_args(args)[0].command
    except ValueError:
        return None
    if command is None or {"-h", "--help"} & set(args[: args.index(command)]):
        return None
    return str(command)


def main(argv: Sequence[str] | None = None) -> int:
    if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
        # kill -USR1 <pid> prints every thread's Python stack to stderr: what a command that hangs waits for.
        # (Not where stderr is no file, as when a test calls main() under output capture.)
        with contextlib.suppress(ValueError, OSError):
            faulthandler.register(signal.SIGUSR1, all_threads=True)
    if argv is None:
        # A process of its own (not a test calling main()): answers of megabytes come from malloc's
        # heaps, not pages faulted in and unmapped per answer (mqds.protocol.malloc).
        tune_malloc()
    args = list(sys.argv[1:] if argv is None else argv)
    command = _command(args)
    elsewhere = plugins.missing(command)
    if elsewhere is not None:
        print(f"mqds {command}: {elsewhere}", file=sys.stderr)
        return EXIT_USAGE
    opts = build_parser(command).parse_args(args)
    name = " ".join(["mqds", opts.command, *([opts.action] if getattr(opts, "action", None) else [])])
    try:
        return int(opts.run(opts))
    except CommandError as err:
        print(f"{name}: {err}", file=sys.stderr)
        return err.exit_code
    except InvalidArgumentError as err:
        print(f"{name}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except MqdsError as err:
        print(f"{name}: {err}{secret.hint(err, opts)}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as err:  # e.g. an endpoint that is not host:port
        print(f"{name}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (mqds replay ... | head): not an error. Point
        # stdout at /dev/null so the interpreter's final flush stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
