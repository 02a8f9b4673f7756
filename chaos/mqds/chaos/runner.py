"""``python -m mqds.chaos``: start a cluster, run the workload under faults, heal, drain, check, report.

The nodes run with small Raft logs and segments and a short Raft compaction
interval (``--raft-compaction-interval-s``, 3 s), so logs compact all the
time and an idle spell of a few seconds is enough for the ``idle-restart``
nemeses: they pause the workload's writers (:class:`~mqds.chaos.workload.WorkloadPause`) for
twice the interval plus 2 s, restart one node or all of them, and the runner
resumes the workload once the cluster is ready again. Hostile clients
(``--hostile``, on by default; :mod:`mqds.chaos.hostile`) send odd and
malicious requests over raw gRPC beside the workload for the whole run; the
checker fails the run on an INTERNAL or UNKNOWN answer to any of them, and
the report counts their answers per request kind and status.

This module is the driver; the parts of a run live beside it:
:mod:`mqds.chaos.options` (the command line and :class:`Options`),
:mod:`mqds.chaos.phases` (:class:`ChaosRun`: start the cluster, the workload,
warm up, the fault schedule, heal, drain, tear down) and
:mod:`mqds.chaos.verify` (final read, replica digests, the check, the
:class:`Report` and its printing).

:func:`main` is the entry point (``main(argv) -> exit code``): 0 when the
checker found nothing wrong, 1 on any violation, 2 for bad options, 3 when the
run itself could not be carried out (the cluster did not start, the network
could not be set up). :func:`run` does the work and returns the report, for
tests.
"""

from __future__ import annotations

import logging
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from mqds.chaos.network import NetworkError, make_network
from mqds.chaos.options import PROG, Options, build_parser, parse_options
from mqds.chaos.phases import READY_TIMEOUT_S, ChaosRun, HarnessError
from mqds.chaos.verify import CONVERGE_TIMEOUT_S, FINAL_READ_TIMEOUT_S, Report, print_report, verify

__all__ = [
    "CONVERGE_TIMEOUT_S",
    "EXIT_HARNESS",
    "EXIT_PASSED",
    "EXIT_USAGE",
    "EXIT_VIOLATION",
    "FINAL_READ_TIMEOUT_S",
    "PROG",
    "READY_TIMEOUT_S",
    "ChaosRun",
    "HarnessError",
    "Options",
    "Report",
    "build_parser",
    "main",
    "parse_options",
    "run",
]

EXIT_PASSED, EXIT_VIOLATION, EXIT_USAGE, EXIT_HARNESS = 0, 1, 2, 3


def run(opts: Options, out: TextIO = sys.stderr) -> Report:
    """Carry out one run; raises HarnessError when it cannot be carried out."""
    chaos = ChaosRun(opts, out)
    work = opts.work_dir or Path(tempfile.mkdtemp(prefix="mqds-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        network = make_network(opts.network)
    except NetworkError as err:
        raise HarnessError(str(err)) from None
    failed = True
    try:
        env = chaos.start_cluster(work, network)
        chaos.start_workload()
        began = chaos.warm_up()
        chaos.faults(env)
        chaos.current = "healing"
        chaos.heal_everything(env)
        chaos.drain()
        report = verify(chaos, began, network.kind, work)
        failed = not report.passed
        return report
    finally:
        chaos.teardown(work, network, failed)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """``python -m mqds.chaos [options]``: the exit code (0 passed, 1 violation, 2 usage, 3 harness failure).

    ``prog`` names the command in the usage text (another program that runs
    this under a name of its own passes it). ``--help`` prints the help and
    exits with SystemExit(0), as every argparse command does; bad options
    print why and return 2.
    """
    try:
        opts, ns = parse_options(argv, prog)
    except SystemExit as exit_:
        if exit_.code in (0, None):
            raise
        return EXIT_USAGE
    if threading.current_thread() is threading.main_thread():
        # A SIGTERM unwinds like Ctrl-C, so the nodes are killed and the namespaces removed.
        signal.signal(signal.SIGTERM, _interrupt)
    logging.basicConfig(
        level=logging.DEBUG if ns.verbose else logging.WARNING, format="%(asctime)s %(name)s: %(message)s"
    )
    try:
        report = run(opts)
    except HarnessError as err:
        print(f"mqds chaos: the run could not be carried out: {err}", file=sys.stderr)
        return EXIT_HARNESS
    except KeyboardInterrupt:
        print("mqds chaos: interrupted", file=sys.stderr)
        return EXIT_HARNESS
    except Exception:
        traceback.print_exc()
        return EXIT_HARNESS
    print_report(report, opts)
    return EXIT_PASSED if report.passed else EXIT_VIOLATION


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
