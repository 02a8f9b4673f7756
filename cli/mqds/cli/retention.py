"""``mqds retention show|set``: how long stored messages are kept, per topic filter (cluster configuration)."""

from __future__ import annotations

import argparse

from mqds.cli.console import EXIT_OK, EXIT_USAGE, CommandError, connection, table
from mqds.cli.secret import cluster_secret_options, with_cluster_secret
from mqds.client import Client
from mqds.protocol.retention import (
    RetentionError,
    format_limits,
    format_period,
    has_limits,
    parse_period,
    parse_rule_limits,
)
from mqds.v1 import cluster_pb2 as clpb


def _show(policy: clpb.RetentionPolicy | None) -> None:
    if policy is None:
        print("no retention policy is set: each node drops whole generations past its retention_period_s")
        return
    rows = [
        [i, r.topic_filter, format_period(r.period_s), format_limits(r) or "-"] for i, r in enumerate(policy.rules, 1)
    ]
    rows.append(["", "(every other topic)", format_period(policy.default_s), "-"])
    print(table(["#", "FILTER", "KEPT FOR", "LIMITS"], rows, right=(0,)))
    print(
        "\nthe first rule whose filter matches a message's topic decides how long it is kept and which limits count it"
    )
    if any(has_limits(r) for r in policy.rules):
        print(
            "limits count per shard: each shard keeps max_msgs and max_bytes divided by the number of shards, "
            "per_topic as set"
        )


def run(opts: argparse.Namespace) -> int:
    if opts.action == "set":
        try:
            rules = [parse_rule_limits(text) for text in opts.rules]
            default_s = parse_period(opts.default)
        except RetentionError as err:
            raise CommandError(str(err), EXIT_USAGE) from None
    with Client(opts.endpoints, settings=with_cluster_secret(connection(opts, 30.0), opts)) as client:
        if opts.action == "show":
            _show(client.retention())
            return EXIT_OK
        _show(client.set_retention(rules, default_s))
        print("set: each vnode's leader removes what it ended within retention_check_interval_s")
    return EXIT_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], connection: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "retention",
        parents=[connection],
        help="show or set how long stored messages are kept, per topic filter",
        description=(
            "The cluster's retention policy: rules FILTER=PERIOD in order (the first whose filter matches a "
            "message's topic decides how long it is kept) and a default for the rest. Set online; every vnode's "
            "leader then drops closed generations whose messages all expired and deletes older messages of "
            "streams that outlived their period. Without a policy, each node's retention_period_s applies."
        ),
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="{show,set}")
    actions.add_parser("show", parents=[connection], help="the policy in force", description="Show the policy.")
    setting = actions.add_parser(
        "set",
        parents=[connection, cluster_secret_options()],
        help="replace the policy (an admin call)",
        description="Replace the retention policy, e.g. mqds retention set 'telemetry/#=1d' 'audit/#=90d' "
        "'busy/#=7d,max_msgs=100000,max_bytes=64MiB,per_topic=10,discard=old' --default 30d. Periods: a number "
        "and a unit (s m h d w), such as 90s, 12h, 7d, 1d12h, or 'keep'. Limits after the period, each "
        ",NAME=VALUE: max_msgs (messages), max_bytes (a size: bytes or 64KiB, 64MiB, 1GB...), per_topic "
        "(messages of each topic), discard=old (the oldest go; the default) or discard=new (a store over "
        "max_msgs or max_bytes is refused with LIMIT_REACHED; not with per_topic). Limits count the messages "
        "the rule decides, per shard: each shard keeps max_msgs and max_bytes divided by the number of shards.",
    )
    setting.add_argument(
        "rules",
        nargs="*",
        metavar="FILTER=PERIOD[,LIMIT=VALUE...]",
        help="a rule, such as 'telemetry/#=1d' or 'busy/#=keep,per_topic=10' (in order: first wins)",
    )
    setting.add_argument(
        "--default", default="keep", metavar="PERIOD", help="how long other messages are kept (default: keep)"
    )
    parser.set_defaults(run=run)
