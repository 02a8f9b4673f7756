"""Commands that other mqds packages add to the ``mqds`` command line: the ``mqds.commands`` entry points.

The command line (``mqds-cli``) holds the commands that talk to a cluster
(status, pub, replay, generations, delete, retention, backup, admin,
secret). The others come with the package that does their work, so that a
broker or a Spark executor installs only what it runs: ``mqds cluster``
with the development tools (``mqds-tools``), ``mqds bench`` with the
benchmarks (``mqds-bench``), ``mqds broker`` and ``mqds exhook`` with the
broker integrations (``mqds-broker``), ``mqds spark-job`` with the Spark
connector (``mqds-spark``). Each such package names a
``register(sub, connection)`` function in the ``mqds.commands`` entry-point
group, under its command's name.

A command is imported only when it runs, or for the list ``mqds --help``
prints: ``mqds status`` loads none of them. A known command whose package
is not installed says which package brings it (:func:`missing`).
"""

from __future__ import annotations

import argparse
from importlib.metadata import EntryPoint, entry_points

GROUP = "mqds.commands"

KNOWN = {
    "cluster": ("mqds-tools", "a local multi-process cluster for development: up, down, kill, start"),
    "bench": ("mqds-bench", "measure write throughput and latency of a running cluster"),
    "broker": ("mqds-broker", "run an amqtt MQTT broker that persists sessions and messages in mqds"),
    "exhook": (
        "mqds-broker",
        "serve EMQX's ExHook gRPC interface, keeping client state, subscriptions and messages in mqds",
    ),
    "spark-job": ("mqds-spark", "per-topic and per-sender statistics of a time window, with Spark, to Parquet"),
}
"""The commands of other packages: the package that brings each, and what it does (for ``mqds --help``)."""


def installed() -> dict[str, EntryPoint]:
    """The commands installed packages add, by name (nothing is imported)."""
    return {point.name: point for point in entry_points(group=GROUP)}


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    connection: argparse.ArgumentParser,
    wanted: str | None,
) -> None:
    """Add the other packages' commands to ``sub``: ``wanted`` (or every one, for None) with its own options,
    the rest as names with their one-line help, so the list of commands is whole either way."""
    found = installed()
    for name in sorted(found.keys() | KNOWN.keys()):
        point = found.get(name)
        if point is not None and wanted in (None, name):
            point.load()(sub, connection)
            continue
        package, what = KNOWN.get(name, (point.dist.name if point and point.dist else "another package", ""))
        note = "" if point is not None else f" (needs {package}, not installed)"
        sub.add_parser(name, help=f"{what}{note}" if what else f"a command of {package}{note}")


def missing(command: str | None) -> str | None:
    """What to say when ``command`` is one of another package's that is not installed (else None)."""
    if command is None or command not in KNOWN or command in installed():
        return None
    package, _ = KNOWN[command]
    return (
        f"'mqds {command}' comes with the {package} package, which is not installed here; install it "
        f"(pip install {package}, or 'make install' in a clone of mqds)"
    )
