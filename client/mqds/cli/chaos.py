"""``mqds chaos``: a fault-injection run against a local cluster it starts (``python -m mqds.chaos``).

The runner lives in the server distribution (it starts ``mqds-server``
processes), so it is imported only when the command runs; with the client
alone the command says what to install. Every option after ``chaos`` goes to
the runner unchanged: ``mqds chaos --help`` prints the runner's help.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from mqds.cli.console import CommandError

SUMMARY = "fault-injection run: a local cluster, a workload, kills/pauses/partitions, a checked history"


def run(argv: Sequence[str]) -> int:
    try:
        from mqds.chaos import runner
    except ImportError as err:
        raise CommandError(
            "mqds chaos starts mqds-server nodes and needs the server package, which is not installed "
            f"({err}); install it (pip install mqds-server, or 'make install' in a clone of mqds)"
        ) from None
    return runner.main(list(argv), prog="mqds chaos")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # Listed for `mqds --help`; `main` hands `mqds chaos ...` to the runner before parsing.
    sub.add_parser("chaos", help=SUMMARY, description=SUMMARY + "; see 'mqds chaos --help'", add_help=False)
