"""``mqds consumers``: client sessions, subscriptions, read positions, share groups and push subscriptions, with lag.

What ``nats consumer info`` or ``kafka-consumer-groups --describe`` show for
their systems: who reads, from where, and how far behind its filter's head
(messages, counted up to a cap, and the age of the oldest unread one). An
admin call (it names every client): it presents the cluster secret or an
admin token. ``mqds status --consumers`` prints :func:`summary` after the
cluster's state.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from mqds.cli.console import EXIT_OK, EXIT_USAGE, CommandError, connection, format_time_us, table
from mqds.cli.secret import cluster_secret_options, with_cluster_secret
from mqds.client import Client
from mqds.client.core.consumers import KINDS, Consumers, Lag

SUMMARY_TOP = 5
"""The consumers furthest behind that ``mqds status --consumers`` names, per kind."""


def _seconds(value: float) -> str:
    if value <= 0:
        return "-"
    if value < 120:
        return f"{value:.1f}s"
    if value < 7200:
        return f"{value / 60:.1f}m"
    return f"{value / 3600:.1f}h"


def _lag(lag: Lag) -> list[str]:
    return [lag.text(), _seconds(lag.seconds)]


def _when(timestamp_us: int) -> str:
    return format_time_us(timestamp_us, "seconds") if timestamp_us else "-"


def _position_text(acked_us: dict[int, int], start_us: int) -> str:
    parts = [f"from {_when(start_us)}"] if start_us else []
    if acked_us:
        parts.append(
            f"acked in {len(acked_us)} shard{'s' if len(acked_us) != 1 else ''} up to {_when(max(acked_us.values()))}"
        )
    return "; ".join(parts) or "from the first message"


def render(found: Consumers) -> str:
    """The tables of what was listed (only the kinds asked for, empty ones said to be empty)."""
    out: list[str] = []
    rows: list[list[object]]
    if found.sessions is not None:
        out.append(f"SESSIONS ({len(found.sessions)})")
        rows = []
        for s in found.sessions:
            state = s.state
            status = "no state" if state is None else ("online" if state.online else "offline")
            node = state.node if state is not None else "-"
            subs = ", ".join(f"{f} (qos {q})" for f, q in s.subscriptions.items()) or "-"
            expires = _when(state.expires_at_us) if state is not None and state.expires_at_us else "-"
            rows.append([s.clientid, status, node or "-", expires, subs])
        out.append(table(["CLIENTID", "STATE", "NODE", "EXPIRES", "SUBSCRIPTIONS"], rows) if rows else "  none")
    if found.read_positions is not None:
        out.append(f"\nREAD POSITIONS ({len(found.read_positions)})")
        rows = [
            [p.clientid, p.topic_filter, *_lag(p.lag), _position_text(p.position.acked_us, p.position.start_us)]
            for p in found.read_positions
        ]
        out.append(
            table(["CLIENTID", "FILTER", "BEHIND", "OLDEST", "POSITION"], rows, right=(2,)) if rows else "  none"
        )
    if found.share_groups is not None:
        out.append(f"\nSHARE GROUPS ({len(found.share_groups)})")
        rows = [
            [g.group, g.topic_filter, len(g.members), ", ".join(g.members) or "-", *_lag(g.lag)]
            for g in found.share_groups
        ]
        out.append(
            table(["GROUP", "FILTER", "#", "MEMBERS", "BEHIND", "OLDEST"], rows, right=(2, 4)) if rows else "  none"
        )
    if found.push_subscriptions is not None:
        out.append(f"\nPUSH SUBSCRIPTIONS ({len(found.push_subscriptions)})")
        rows = [
            [p.node, p.call, p.peer, p.shard, p.topic_filter, p.subscriptions, _when(p.position_us), *_lag(p.lag)]
            for p in found.push_subscriptions
        ]
        headers = ["NODE", "CALL", "PEER", "SHARD", "FILTER", "SUBS", "AT", "BEHIND", "OLDEST"]
        out.append(table(headers, rows, right=(1, 3, 5, 7)) if rows else "  none")
        if found.unreachable:
            out.append(f"  (not answering, their push subscriptions are missing: {', '.join(found.unreachable)})")
    return "\n".join(out)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def summary(found: Consumers, top: int = SUMMARY_TOP) -> str:
    """A few lines for ``mqds status --consumers``: how many of each kind, and those furthest behind."""
    sessions = found.sessions or []
    online = sum(1 for s in sessions if s.state is not None and s.state.online)
    counts = [
        _count(len(sessions), "session") + f" ({online} online)",
        _count(len(found.read_positions or []), "read position"),
        _count(len(found.share_groups or []), "share group"),
        _count(len(found.push_subscriptions or []), "push subscription"),
    ]
    lines = ["consumers: " + ", ".join(counts)]
    rows: list[list[Any]] = []
    ranked: list[tuple[Lag, str, str]] = [  # a share group's own position is ranked as the group
        (p.lag, "read position", f"{p.clientid} {p.topic_filter}")
        for p in found.read_positions or []
        if not p.clientid.startswith("$share/")
    ]
    ranked += [(g.lag, "share group", f"$share/{g.group}/{g.topic_filter}") for g in found.share_groups or []]
    ranked += [(p.lag, "push", f"{p.topic_filter} shard {p.shard} on {p.node}") for p in found.push_subscriptions or []]
    ranked = [entry for entry in ranked if entry[0].messages]
    ranked.sort(key=lambda entry: (entry[0].messages, entry[0].seconds), reverse=True)
    for lag, kind, name in ranked[:top]:
        rows.append([kind, name, *_lag(lag)])
    if rows:
        lines.append("furthest behind:")
        lines.append(table(["KIND", "CONSUMER", "BEHIND", "OLDEST"], rows, right=(2,)))
    else:
        lines.append("no consumer is behind")
    if found.unreachable:
        lines.append(f"(not answering: {', '.join(found.unreachable)})")
    return "\n".join(lines)


def as_json(found: Consumers) -> str:
    """Every field of what was listed, one JSON object (kinds not asked for are null)."""
    return json.dumps(dataclasses.asdict(found), ensure_ascii=False, indent=2)


def gather(client: Client, opts: argparse.Namespace) -> Consumers:
    kinds = opts.kind
    if not kinds:  # a filter names the kinds it narrows
        if opts.group:
            kinds = ["read_positions", "share_groups"]
        elif opts.clientid or opts.prefix:
            kinds = ["sessions", "read_positions"]
        else:
            kinds = list(KINDS)
    return client.consumers(
        kinds,
        clientid=opts.clientid or "",
        clientid_prefix=opts.prefix or "",
        group=opts.group or "",
        lag=not opts.no_lag,
        lag_cap=opts.lag_cap,
        stale_ok=opts.stale_ok,
    )


def run(opts: argparse.Namespace) -> int:
    if opts.clientid and opts.prefix:
        raise CommandError("give --clientid or --prefix, not both", EXIT_USAGE)
    with Client(opts.endpoints, settings=with_cluster_secret(connection(opts, 30.0), opts)) as client:
        found = gather(client, opts)
    print(as_json(found) if opts.json else render(found))
    return EXIT_OK


def lag_cap_arg(text: str) -> int:
    """``--lag-cap``'s value: 1 to 100,000."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError("must be 1 to 100,000")
    return value


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], connection: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "consumers",
        parents=[connection, cluster_secret_options()],
        help="client sessions, subscriptions, read positions, share groups and push subscriptions, with their lag",
        description=(
            "List who reads the cluster and how far behind: client sessions (state, broker node, when an offline "
            "session expires, proxy subscriptions), read positions per (clientid, topic filter), share groups "
            "(live members, the position they share) and push subscriptions (each node's Follow calls), each "
            "with its lag: the matching messages after its position (QoS 1 and 2 for read positions and share "
            "groups, as offline delivery reads; counted up to --lag-cap per shard, 'at least' beyond) and the "
            "age of the oldest unread one (OLDEST). An admin call: it names every client, so it presents the "
            "cluster secret (or an admin --token)."
        ),
    )
    parser.add_argument(
        "--kind",
        action="append",
        choices=list(KINDS),
        help="list only this kind (repeat for several; default: all four, but with --group only read positions "
        "and share groups, with --clientid or --prefix only sessions and read positions)",
    )
    parser.add_argument("--clientid", help="only this client's session and read positions (an exact clientid)")
    parser.add_argument(
        "--prefix", metavar="TEXT", help="only the sessions and read positions of clientids starting with TEXT"
    )
    parser.add_argument(
        "--group", help="only this share group (and, among read positions, the group's: clientid $share/GROUP)"
    )
    parser.add_argument(
        "--lag-cap",
        type=lag_cap_arg,
        default=10_000,
        metavar="N",
        help="count at most N messages behind per consumer and shard, then say 'at least' (default 10,000; "
        "larger costs the nodes more reading)",
    )
    parser.add_argument("--no-lag", action="store_true", help="do not measure read positions' and groups' lag")
    parser.add_argument(
        "--stale-ok",
        action="store_true",
        help="let any replica answer from what it applied (works without leaders; may be a moment behind)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object with every field, for scripts")
    parser.set_defaults(run=run)
