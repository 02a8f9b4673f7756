"""Where ``mqds`` finds the cluster secret an admin call presents, and what it tells the user when a node says no.

In order: ``--cluster-secret-file FILE``, ``$MQDS_CLUSTER_SECRET``, and the
local cluster ``mqds cluster up`` made: its ``DIR/cluster.json`` records the
secret and the nodes' addresses. ``DIR`` is ``--data-dir``, else
``$MQDS_CLUSTER_DIR``, else ``data/cluster`` (the directory ``mqds cluster up``
and ``make cluster`` use by default), so after ``mqds cluster up`` the admin
commands work with no flag. A local cluster's secret goes only to its own
nodes: when ``--endpoints`` names another node it is not sent (and an explicit
``--data-dir`` that does not match is an error). An admin ``--token`` works
instead of the secret on nodes with a tokens file.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from mqds.cli.console import EXIT_USAGE, CommandError
from mqds.client.connection import ConnectionSettings, parse_endpoints
from mqds.protocol.errors import MqdsError, Reason

CLUSTER_SECRET_ENV = "MQDS_CLUSTER_SECRET"
CLUSTER_DIR_ENV = "MQDS_CLUSTER_DIR"
DEFAULT_CLUSTER_DIR = "data/cluster"
STATE_FILE = "cluster.json"
"""What ``mqds cluster up`` records in its directory (mqds.tools.local_cluster writes it)."""


def default_cluster_dir() -> str:
    """The directory ``mqds cluster`` and the admin commands use without ``--data-dir``."""
    return os.environ.get(CLUSTER_DIR_ENV) or DEFAULT_CLUSTER_DIR


def cluster_secret_options() -> argparse.ArgumentParser:
    """A parent parser with ``--cluster-secret-file`` and ``--data-dir``, for the commands that present the secret."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("admin proof (the cluster secret; or --token of an admin)")
    group.add_argument(
        "--cluster-secret-file",
        metavar="FILE",
        help=f"file holding the nodes' cluster secret, the proof admin calls need (default: ${CLUSTER_SECRET_ENV}, "
        "else the local cluster of --data-dir)",
    )
    group.add_argument(
        "--data-dir",
        dest="cluster_dir",
        metavar="DIR",
        help=f"a local cluster made by 'mqds cluster up': the secret recorded in DIR/{STATE_FILE} is presented "
        f"to its nodes (default: ${CLUSTER_DIR_ENV}, else {DEFAULT_CLUSTER_DIR} when it holds one)",
    )
    return parent


def _local_cluster_secret(opts: argparse.Namespace) -> tuple[str, str]:
    """The secret of the local cluster in --data-dir (or the default directory) and where it was read; ("", "")
    when there is none there, or the command's endpoints are not all its nodes."""
    explicit = getattr(opts, "cluster_dir", None)
    directory = explicit or default_cluster_dir()
    state_path = Path(directory) / STATE_FILE
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
        secret = str(state["secret"]).strip()
        addresses = {str(info["address"]) for info in state["nodes"].values()}
    except FileNotFoundError:
        if explicit:
            raise CommandError(
                f"--data-dir {explicit}: no cluster made by 'mqds cluster up' there (no {STATE_FILE})", EXIT_USAGE
            ) from None
        return "", ""
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        if explicit:
            raise CommandError(
                f"{state_path} is not a cluster state this version can read: {err!r}", EXIT_USAGE
            ) from None
        return "", ""
    endpoints = set(parse_endpoints(opts.endpoints))
    if not endpoints <= addresses:
        # Never hand a local cluster's secret to some other node.
        if explicit:
            raise CommandError(
                f"--data-dir {explicit} holds the cluster at {','.join(sorted(addresses))}; --endpoints "
                f"{opts.endpoints} names other nodes, and its secret is sent to its own nodes only",
                EXIT_USAGE,
            )
        return "", ""
    return secret, str(state_path)


def with_cluster_secret(settings: ConnectionSettings, opts: argparse.Namespace) -> ConnectionSettings:
    """``settings`` presenting the cluster secret, found as the module says; unchanged when there is none.

    Records where it came from in ``opts.secret_source`` for :func:`hint`.
    """
    path = getattr(opts, "cluster_secret_file", None)
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                secret = fh.read().strip()
        except OSError as err:
            raise CommandError(f"--cluster-secret-file {path}: cannot read it: {err.strerror}", EXIT_USAGE) from None
        if not secret:
            raise CommandError(f"--cluster-secret-file {path} is empty", EXIT_USAGE)
        source = f"--cluster-secret-file {path}"
    elif os.environ.get(CLUSTER_SECRET_ENV, "").strip():
        secret, source = os.environ[CLUSTER_SECRET_ENV].strip(), f"${CLUSTER_SECRET_ENV}"
    else:
        secret, source = _local_cluster_secret(opts)
    if not secret:
        return settings
    try:
        settings = settings.replace(cluster_secret=secret)
    except ValueError as err:
        raise CommandError(f"the cluster secret cannot be sent: {err}", EXIT_USAGE) from None
    opts.secret_source = source
    return settings


def hint(err: MqdsError, opts: argparse.Namespace) -> str:
    """What to do about a refusal for want of credentials: what this command sent, and what it should send.

    Empty for every other error.
    """
    if err.reason not in (Reason.UNAUTHENTICATED, Reason.PERMISSION_DENIED):
        return ""
    sent = []
    if getattr(opts, "token", None):
        sent.append("a token (--token or $MQDS_TOKEN)")
    if getattr(opts, "secret_source", None):
        sent.append(f"the cluster secret of {opts.secret_source}")
    sources = (
        f"--cluster-secret-file FILE, ${CLUSTER_SECRET_ENV}, or --data-dir DIR of a cluster made by 'mqds cluster "
        f"up' (default {default_cluster_dir()}, from the directory it was started in)"
    )
    if err.reason is Reason.PERMISSION_DENIED:
        return (
            f"\n  this command sent {' and '.join(sent) or 'no credentials'}, whose role may not make this call: "
            f"admin calls need an admin token or the cluster secret ({sources})"
        )
    if not sent:
        return (
            "\n  this command sent no token and no cluster secret: admin calls need the cluster secret "
            f"({sources}) or an admin token; on nodes with auth_tokens_file every call needs a token (--token or "
            "$MQDS_TOKEN)"
        )
    return (
        f"\n  this command sent {' and '.join(sent)}, which the node did not accept: check that it is one of the "
        f"nodes' tokens or their cluster_secret (admin calls take the secret from {sources})"
    )
