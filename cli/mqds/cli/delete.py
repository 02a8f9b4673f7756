"""``mqds delete``: delete stored messages (a sender's, or a filter's in a time range), shard by shard."""

from __future__ import annotations

import argparse
import sys

from mqds.cli.console import EXIT_OK, EXIT_USAGE, TIME_HELP, CommandError, connection, format_time_us, parse_time, table
from mqds.cli.secret import cluster_secret_options, with_cluster_secret
from mqds.client import Client
from mqds.protocol.deletes import check_delete
from mqds.protocol.errors import MqdsError
from mqds.v1 import storage_pb2 as pb


def _time(option: str, text: str | None) -> int:
    if not text:
        return 0
    try:
        return parse_time(text)
    except ValueError as err:
        raise CommandError(f"{option}: {err}", EXIT_USAGE) from None


def run(opts: argparse.Namespace) -> int:
    since_us, until_us = _time("--since", opts.since), _time("--until", opts.until)
    try:
        check_delete(opts.filter, opts.sender or "", since_us, until_us, opts.all)
    except MqdsError as err:
        raise CommandError(err.message, EXIT_USAGE) from None

    def progress(shard: int, answer: pb.DeleteMessagesResponse) -> None:
        more = " (going on)" if answer.HasField("cursor") else ""
        print(f"  shard {shard}: {answer.deleted_messages:,} deleted in {answer.steps} steps{more}", file=sys.stderr)

    what = f"messages matching {opts.filter!r}" + (f" from sender {opts.sender!r}" if opts.sender else "")
    span = f" stored {'from ' + format_time_us(since_us, 'seconds') if since_us else 'since the start'}"
    span += f" until {format_time_us(until_us, 'seconds')}" if until_us else " until now"
    print(f"deleting {what}{span}", file=sys.stderr)
    with Client(opts.endpoints, settings=with_cluster_secret(connection(opts, 30.0), opts)) as client:
        report = client.delete_messages(
            opts.filter,
            sender=opts.sender or "",
            since_us=since_us,
            until_us=until_us,
            confirm_all=opts.all,
            progress=progress if not opts.quiet else None,
        )
    rows = [[s.shard, f"{s.messages:,}", f"{s.index_keys:,}", f"{s.scanned_keys:,}", s.steps] for s in report.shards]
    print(table(["SHARD", "MESSAGES", "INDEX KEYS", "SCANNED", "STEPS"], rows, right=(0, 1, 2, 3, 4)))
    touched = len(report.by_shard)
    print(
        f"\ndeleted {report.messages:,} messages ({report.keys:,} keys) in {touched} of {len(report.shards)} "
        f"shard{'s' if len(report.shards) != 1 else ''}; every replica applied the same deletes"
    )
    return EXIT_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], connection: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "delete",
        parents=[connection, cluster_secret_options()],
        help="delete stored messages: a sender's, or a filter's in a time range",
        description=(
            "Delete stored messages that match FILTER, of one sender if --sender is given, stored in a time "
            "range (--since, --until; without --until, what each shard had stored when the delete reached it). "
            "Each shard's leader deletes in bounded steps that every replica applies, so readers, iterators "
            "and push subscribers see the messages gone at once; progress is printed per shard, then a "
            "summary. Needs the admin role (the cluster secret or an admin token). Deleting everything "
            "(FILTER '#', no sender, no time range) needs --all."
        ),
    )
    parser.add_argument("filter", metavar="FILTER", help="MQTT topic filter of the messages to delete ('#': all)")
    parser.add_argument(
        "--sender", metavar="CLIENTID", help="only this client's messages (e.g. to erase a client's data)"
    )
    parser.add_argument("--since", metavar="TIME", help=f"only messages stored at or after TIME: {TIME_HELP}")
    parser.add_argument("--until", metavar="TIME", help=f"only messages stored before TIME: {TIME_HELP}")
    parser.add_argument(
        "--all", action="store_true", help="confirm a delete of every stored message (FILTER '#', no other bound)"
    )
    parser.add_argument("--quiet", action="store_true", help="print only the summary, not each shard's progress")
    parser.set_defaults(run=run)
