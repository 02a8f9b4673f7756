"""``mqds cluster up|down|kill|start``: a local multi-process cluster for development and demos.

The processes are real ``mqds-server`` nodes on 127.0.0.1, started detached
so they outlive the command; ids, ports, pids and arguments are recorded in
``DIR/cluster.json``, logs go to ``DIR/<node>-<port>.log`` and data to
``DIR/<node>/``. The command comes with the development tools
(``mqds-tools``), which the ``mqds`` command line finds as a plugin
(the ``mqds.commands`` entry point); a node's image and a broker's or Spark
executor's install go without it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import tempfile
import time
from pathlib import Path

from mqds.cli.console import EXIT_OK, EXIT_USAGE, CommandError
from mqds.cli.secret import CLUSTER_DIR_ENV, DEFAULT_CLUSTER_DIR, STATE_FILE, default_cluster_dir
from mqds.server.config import ConfigError, NodeConfig, load_config
from mqds.tools.errors import LocalClusterError
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.ports import port_in_use

DEFAULT_BASE_PORT = 7101

CLUSTER_SETS = frozenset(
    {
        "node_id",
        "listen",
        "advertise",
        "metrics_listen",
        "data_dir",
        "peers",
        "n_shards",
        "replication_factor",
        "cluster_secret",
        "raft_listen",
    }
)
"""Node settings ``mqds cluster up`` sets itself (ids, addresses, directories, shape, secret): not for --set."""


def node_args(settings: list[str], config: str | None) -> list[str]:
    """Each node's extra command line for ``--set NAME=VALUE`` and ``--config FILE``, checked as a node checks it.

    Raises ``CommandError`` (usage) naming what is wrong: no ``=``, a name that is no node setting or one
    the command sets itself, a value the setting refuses, a file that is not a node settings file.
    """
    names = {f.name for f in dataclasses.fields(NodeConfig)}
    args: list[str] = []
    if config is not None:
        path = Path(config).absolute()  # the nodes run elsewhere, later (mqds cluster start)
        args += ["--config", str(path)]
    for text in settings:
        name, sep, value = text.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name:
            raise CommandError(f"--set {text!r}: write NAME=VALUE, such as --set retention_period_s=7d", EXIT_USAGE)
        if name not in names:
            raise CommandError(
                f"--set {text!r}: {name!r} is not a node setting (mqds-server --help lists them)", EXIT_USAGE
            )
        if name in CLUSTER_SETS:
            raise CommandError(
                f"--set {text!r}: mqds cluster up sets {name} itself (--nodes, --base-port, --shards, "
                "--replication-factor and the directory say what it is)",
                EXIT_USAGE,
            )
        args += ["--" + name.replace("_", "-"), value]
    try:
        load_config(args)
    except ConfigError as err:
        raise CommandError(f"node settings: {err}", EXIT_USAGE) from None
    return args


def for_benchmark(opts: argparse.Namespace, stack: contextlib.ExitStack, prefix: str) -> LocalCluster | None:
    """The cluster a benchmark controls: a new one (``--start-cluster``, stopped when ``stack`` closes),
    the one recorded in ``--data-dir``, or None (``--endpoints`` only)."""
    if opts.start_cluster:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
        cluster = LocalCluster(
            base, opts.nodes, n_shards=opts.shards, replication_factor=min(opts.replication_factor, opts.nodes)
        )
        stack.callback(cluster.stop)
        if not opts.json:
            print(f"starting {opts.nodes} local nodes ({opts.shards} vnodes) ...", flush=True)
        cluster.start()
        # The leader balancer moves leaders in the first seconds; measure after it
        # (or, if some vnode's preferred replica cannot lead yet, after 30 s).
        with contextlib.suppress(TimeoutError):
            cluster.wait_leaders_settled()
        return cluster
    if opts.data_dir:
        return load(opts.data_dir)
    return None


def load(data_dir: str) -> LocalCluster:
    """The local cluster recorded in ``data_dir`` by ``mqds cluster up``."""
    try:
        cluster = LocalCluster.load(data_dir)
    except LocalClusterError as err:
        raise CommandError(f"{err}; start one with 'mqds cluster up --data-dir {data_dir}'") from None
    return cluster


def _node(cluster: LocalCluster, node_id: str) -> None:
    if node_id not in cluster.nodes:
        raise CommandError(f"no node {node_id!r} in this cluster; its nodes are {', '.join(cluster.nodes)}", EXIT_USAGE)


def _describe(cluster: LocalCluster) -> None:
    for node_id, proc in cluster.nodes.items():
        state = f"pid {proc.pid}" if proc.running else "not running"
        print(f"  {node_id}  {proc.address}  {state}  log {proc.log_path}")
    endpoints = ",".join(cluster.addresses)
    print(f"endpoints: {endpoints}")
    print(f"  mqds --endpoints {endpoints} status")
    # The admin commands find the secret in the default directory; any other needs --data-dir.
    found = Path(default_cluster_dir()).absolute() == cluster.base_dir
    how = "as they are, from this directory" if found else f"with --data-dir {cluster.base_dir}"
    print(f"  admin commands (mqds retention set, mqds admin ...) present its secret from {STATE_FILE} {how}")
    print(f"  stop it with: mqds cluster down --data-dir {cluster.base_dir}")


def run_up(opts: argparse.Namespace) -> int:
    recorded = LocalCluster.recorded(opts.data_dir)
    for what, value in (("--nodes", opts.nodes), ("--shards", opts.shards), ("--replication-factor", opts.rf)):
        if value is not None and value < 1:
            raise CommandError(f"{what} must be at least 1", EXIT_USAGE)
    if opts.base_port is not None and not 1 <= opts.base_port <= 65535 - (opts.nodes or 3):
        raise CommandError("--base-port must leave room for every node's port below 65536", EXIT_USAGE)
    base_port = opts.base_port if opts.base_port is not None or recorded else DEFAULT_BASE_PORT
    if recorded:
        print(f"starting the cluster recorded in {opts.data_dir} (nodes still running are kept) ...", flush=True)
    else:
        nodes = opts.nodes or 3
        print(
            f"starting a {nodes}-node cluster in {opts.data_dir} on 127.0.0.1:{base_port}.."
            f"{base_port + nodes - 1} ({opts.shards or 16} vnodes, "
            f"{min(opts.rf or 3, nodes)} replicas each) ...",
            flush=True,
        )
    started = time.monotonic()
    args = node_args(opts.settings, opts.config)
    if args:
        print("each node with: " + " ".join(args), flush=True)
    try:
        cluster = LocalCluster.up(
            opts.data_dir,
            opts.nodes,
            base_port=base_port,
            n_shards=opts.shards,
            replication_factor=opts.rf,
            timeout_s=opts.wait,
            args=args,
        )
    except LocalClusterError as err:
        raise CommandError(str(err)) from None
    print(f"cluster up after {time.monotonic() - started:.1f} s: every vnode has a leader")
    _describe(cluster)
    return EXIT_OK


def run_down(opts: argparse.Namespace) -> int:
    cluster = load(opts.data_dir)
    running = [node_id for node_id, proc in cluster.nodes.items() if proc.running]
    if not running:
        print(f"no node of the cluster in {opts.data_dir} is running")
        return EXIT_OK
    print(f"stopping {', '.join(running)} (SIGTERM: in-flight calls finish) ...", flush=True)
    cluster.stop()
    cluster.save()
    still = cluster.live()
    if still:
        raise CommandError(f"{', '.join(still)} still running")
    print(f"stopped; the data stays in {cluster.base_dir} ('mqds cluster up --data-dir' starts it again)")
    return EXIT_OK


def run_kill(opts: argparse.Namespace) -> int:
    cluster = load(opts.data_dir)
    _node(cluster, opts.node)
    proc = cluster.nodes[opts.node]
    if not proc.running:
        raise CommandError(f"{opts.node} is not running")
    # Which vnodes lose their leader: asked before the kill.
    led = sorted(shard for shard, node_id in cluster.leaders().items() if node_id == opts.node)
    pid = proc.pid
    cluster.kill(opts.node)
    cluster.save()
    what = f"it led vnode{'s' if len(led) != 1 else ''} {', '.join(map(str, led))}" if led else "it led no vnode"
    print(f"killed {opts.node} (kill -9 of pid {pid}); {what}; the other replicas elect new leaders")
    print(f"  start it again with: mqds cluster start {opts.node} --data-dir {cluster.base_dir}")
    return EXIT_OK


def run_start(opts: argparse.Namespace) -> int:
    cluster = load(opts.data_dir)
    _node(cluster, opts.node)
    proc = cluster.nodes[opts.node]
    if proc.running:
        print(f"{opts.node} is already running (pid {proc.pid}) on {proc.address}")
        return EXIT_OK
    if port_in_use(proc.port):
        raise CommandError(f"port {proc.port} of {opts.node} is in use by another program")
    started = time.monotonic()
    # Recorded before waiting: if this command is killed while it waits, the
    # node it started still runs, and 'mqds cluster down' must know its pid.
    proc.launch()
    cluster.save()
    try:
        proc.wait(opts.wait)
    except (RuntimeError, TimeoutError) as err:
        cluster.save()
        raise CommandError(f"{opts.node} did not become ready: {err}") from None
    cluster.save()
    print(f"{opts.node} started (pid {proc.pid}) on {proc.address}; ready after {time.monotonic() - started:.1f} s")
    return EXIT_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], connection: argparse.ArgumentParser) -> None:
    """Add ``mqds cluster`` (the ``mqds.commands`` entry point; it talks to no cluster: no ``connection``)."""
    data_dir = argparse.ArgumentParser(add_help=False)
    data_dir.add_argument(
        "--data-dir",
        metavar="DIR",
        default=default_cluster_dir(),
        help=f"the cluster's directory: data, logs and {STATE_FILE}, where the admin commands find its secret "
        f"(default: ${CLUSTER_DIR_ENV}, else {DEFAULT_CLUSTER_DIR}; the admin commands look there too)",
    )
    wait = argparse.ArgumentParser(add_help=False)
    wait.add_argument(
        "--wait",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="give up (and stop what was started) if not ready after this long (default 120)",
    )
    parser = sub.add_parser(
        "cluster",
        help="a local multi-process cluster for development: up, down, kill, start",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="{up,down,kill,start}")
    up = actions.add_parser(
        "up",
        parents=[data_dir, wait],
        help="start a local cluster (or restart the one recorded in DIR)",
        description=(
            "Start NODES mqds-server processes n1, n2, ... on 127.0.0.1:BASE_PORT, BASE_PORT+1, ... that form "
            "one cluster, detached from this command; return once every vnode has a leader and print the "
            "addresses. On a DIR that already holds a cluster, start its stopped nodes with the same ids, ports "
            "and arguments (the options may then be left out)."
        ),
    )
    up.add_argument("--nodes", type=int, metavar="N", help="number of nodes of a new cluster (default 3)")
    up.add_argument(
        "--base-port",
        type=int,
        metavar="PORT",
        help=f"port of n1; n2 gets the next one, and so on (default {DEFAULT_BASE_PORT})",
    )
    up.add_argument("--shards", type=int, metavar="N", help="shards (vnodes) of a new cluster (default 16)")
    up.add_argument(
        "--replication-factor",
        dest="rf",
        type=int,
        metavar="N",
        help="replicas per vnode of a new cluster (default 3, at most the number of nodes)",
    )
    up.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=(
            "a node setting for every node of a new cluster, as mqds-server takes it (repeat for more), e.g. "
            "--set retention_period_s=7d --set disk_quota_bytes=64MiB; checked before any node starts; "
            "mqds-server --help lists the settings. Not the ones this command sets (ids, addresses, shards)"
        ),
    )
    up.add_argument(
        "--config",
        metavar="FILE",
        help="a node settings file (TOML, as mqds-server --config takes) for every node of a new cluster; "
        "--set values win over it",
    )
    up.set_defaults(run=run_up)
    down = actions.add_parser(
        "down",
        parents=[data_dir],
        help="stop every node (the data stays)",
        description="Stop every node of the cluster in DIR with SIGTERM (SIGKILL after 15 s); the data stays.",
    )
    down.set_defaults(run=run_down)
    kill = actions.add_parser(
        "kill",
        parents=[data_dir],
        help="kill -9 one node",
        description="Kill one node with SIGKILL (no shutdown code runs): the way to see a failover.",
    )
    kill.add_argument("node", metavar="NODE_ID", help="the node, e.g. n2")
    kill.set_defaults(run=run_kill)
    start = actions.add_parser(
        "start",
        parents=[data_dir, wait],
        help="start one stopped or killed node again",
        description="Start one node again with the same id, port, data and arguments; return once it is ready.",
    )
    start.add_argument("node", metavar="NODE_ID", help="the node, e.g. n2")
    start.set_defaults(run=run_start)
