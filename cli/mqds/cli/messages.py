"""``mqds pub`` stores messages; ``mqds replay`` reads them back, and with ``--follow`` keeps reading (pushed)."""

from __future__ import annotations

import argparse
import base64
import collections
import json
import sys
from collections.abc import Iterable
from collections.abc import Iterator as AbcIterator
from concurrent import futures

from mqds.cli.console import EXIT_OK, EXIT_USAGE, TIME_HELP, CommandError, connection, format_time_us, parse_time
from mqds.client import Client, Message, Stream
from mqds.protocol.topics import validate_filter, validate_topic

DEFAULT_SENDER = "mqds-cli"

# -- pub -------------------------------------------------------------------------


def _property(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def _payloads(opts: argparse.Namespace) -> Iterable[str]:
    """The messages to publish: the -m values, or the lines of stdin; each ``count`` times."""
    if opts.message:
        texts: Iterable[str] = opts.message
    else:
        if sys.stdin.isatty():
            print("reading messages from the terminal, one per line; Ctrl-D ends", file=sys.stderr)
        texts = (line.rstrip("\r\n") for line in sys.stdin)
    n = 0
    for text in texts:
        for _ in range(opts.count):
            yield text.replace("{n}", str(n))
            n += 1


_PUB_IN_FLIGHT = 16
"""Batches ``mqds pub`` keeps in flight."""


def run_pub(opts: argparse.Namespace) -> int:
    try:
        validate_topic(opts.topic)
    except ValueError as err:
        raise CommandError(f"topic {opts.topic!r}: {err}", EXIT_USAGE) from None
    if opts.count < 1 or opts.batch < 1:
        raise CommandError("--count and --batch must be at least 1", EXIT_USAGE)
    published = 0
    shards: set[int] = set()
    with Client(opts.endpoints, settings=connection(opts, 30.0)) as client:
        leaders = {v.shard: v.leader for v in client.cluster_map().vnodes}
        batch: list[Message] = []
        last: Message | None = None
        # Batches are pipelined (store_async): up to _PUB_IN_FLIGHT in flight,
        # reported in the order they were read.
        pending: collections.deque[futures.Future[list[Message]]] = collections.deque()

        def report(stored: list[Message]) -> None:
            nonlocal published
            for m in stored:
                published += 1
                shard = m.shard or 0
                shards.add(shard)
                if not opts.quiet:
                    leader = f" (leader {leaders[shard]})" if leaders.get(shard) else ""
                    print(f"stored {m.topic}  vnode {shard}{leader}  at {format_time_us(m.timestamp_us or 0)}")

        def flush(final: bool = False) -> None:
            if batch:
                pending.append(client.store_async(list(batch)))
                batch.clear()
            while pending and (final or len(pending) > _PUB_IN_FLIGHT or pending[0].done()):
                report(pending.popleft().result())

        for text in _payloads(opts):
            batch.append(
                Message(
                    topic=opts.topic,
                    payload=text.encode(),
                    sender=opts.sender,
                    qos=opts.qos,
                    retain=opts.retain,
                    properties=opts.property,
                )
            )
            last = batch[-1]
            if len(batch) >= opts.batch:
                flush()
        flush(final=True)
        # --retain: the last message becomes the topic's retained message (an empty one deletes it),
        # as a broker does with an MQTT publish that has the retain flag.
        kept = client.retain(last) if opts.retain and last is not None else None
    if not published:
        raise CommandError("nothing to publish: give -m MESSAGE or pipe lines into stdin", EXIT_USAGE)
    where = f"vnode {next(iter(shards))}" if len(shards) == 1 else f"{len(shards)} vnodes"
    print(f"published {published:,} message{'s' if published != 1 else ''} as {opts.sender!r} to {where}")
    if opts.retain and last is not None:
        done = (
            f"retained the last one on {opts.topic}" if kept is not None else f"deleted {opts.topic}'s retained message"
        )
        print(done)
    return EXIT_OK


# -- replay ----------------------------------------------------------------------


class Tail:
    """Every message matching a filter from a start time, as stored when it starts (``mqds replay`` without
    ``--follow``): ``Client.replay_batches``, except that a generation dropped while it is read is reported and
    skipped instead of ending the replay.
    """

    def __init__(self, client: Client, topic_filter: str, start_us: int, batch: int, stale_ok: bool) -> None:
        self.client = client
        self.topic_filter = topic_filter
        self.start_us = start_us
        self.batch = batch
        self.stale_ok = stale_ok

    def poll(self) -> AbcIterator[Message]:
        """Every message stored before the call, rank by rank."""
        batches = self.client.replay_batches(
            self.topic_filter, self.start_us, self.batch, stale_ok=self.stale_ok, on_dropped=_report_dropped
        )
        for batch in batches:
            yield from batch


def _report_dropped(stream: Stream) -> None:
    print(f"mqds replay: generation {stream.generation} of shard {stream.shard} was dropped meanwhile", file=sys.stderr)


def _payload_text(payload: bytes) -> str | None:
    """The payload as one line of text when it is printable UTF-8, else None."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if any(not ch.isprintable() and ch not in "\t\n\r" for ch in text):
        return None
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def format_text(m: Message) -> str:
    text = _payload_text(m.payload)
    if text is None:
        more = "..." if len(m.payload) > 32 else ""
        text = f"<{len(m.payload)} bytes: {m.payload[:32].hex()}{more}>"
    flags = f"sender {m.sender or '-'}, qos {m.qos}, vnode {m.shard}" + (", retain" if m.retain else "")
    props = "".join(f", {k}={v}" for k, v in m.properties)
    return f"{format_time_us(m.timestamp_us or 0)}  {m.topic}  {text}  ({flags}{props})"


def format_json(m: Message) -> str:
    out: dict[str, object] = {
        "time": format_time_us(m.timestamp_us or 0),
        "timestamp_us": m.timestamp_us,
        "topic": m.topic,
        "sender": m.sender,
        "qos": m.qos,
        "retain": m.retain,
        "shard": m.shard,
        "properties": [[k, v] for k, v in m.properties],
    }
    try:
        out["payload"] = m.payload.decode("utf-8")
    except UnicodeDecodeError:
        out["payload_base64"] = base64.b64encode(m.payload).decode("ascii")
    return json.dumps(out, ensure_ascii=False)


def run_replay(opts: argparse.Namespace) -> int:
    try:
        validate_filter(opts.filter)
    except ValueError as err:
        raise CommandError(f"filter {opts.filter!r}: {err}", EXIT_USAGE) from None
    try:
        start_us = parse_time(opts.since) if opts.since else 0
    except ValueError as err:
        raise CommandError(f"--since: {err}", EXIT_USAGE) from None
    if (opts.limit is not None and opts.limit < 1) or opts.batch < 1:
        raise CommandError("--limit and --batch must be at least 1", EXIT_USAGE)
    show = format_json if opts.format == "json" else format_text
    with Client(opts.endpoints, settings=connection(opts, 30.0)) as client:
        if opts.follow:
            messages = _followed(client, opts.filter, start_us, opts.batch, opts.stale_ok)
        else:
            messages = Tail(client, opts.filter, start_us, opts.batch, opts.stale_ok).poll()
        shown = 0
        try:
            for m in messages:
                shown += 1  # before printing: a Ctrl-C right after a line must not leave it uncounted
                print(show(m), flush=opts.follow)
                if opts.limit is not None and shown >= opts.limit:
                    break
        except KeyboardInterrupt:
            if not opts.follow:
                raise
            # Ctrl-C is how --follow ends.
    # On stderr, so that stdout holds only messages (for pipes and --format json).
    print(f"replayed {shown:,} message{'s' if shown != 1 else ''}", file=sys.stderr)
    return EXIT_OK


def _followed(client: Client, topic_filter: str, start_us: int, window: int, any_replica: bool) -> AbcIterator[Message]:
    """What is stored from ``start_us`` on, then what comes, pushed by the nodes (``Client.follow``)."""
    with client.follow(topic_filter, start_time_us=start_us, window=window, any_replica=any_replica) as sub:
        for batch in sub:
            yield from batch.messages


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], connection: argparse.ArgumentParser) -> None:
    pub = sub.add_parser(
        "pub",
        parents=[connection],
        help="store messages on a topic",
        description=(
            "Store messages on TOPIC and print where each went (its vnode, that vnode's leader, the timestamp "
            "the vnode gave it). Messages come from -m (repeatable) or, without -m, one per line from stdin. "
            "Every message is acknowledged only once it is on a majority of its vnode's replicas."
        ),
    )
    pub.add_argument("topic", metavar="TOPIC", help="the topic, e.g. sensor/42/temp (no wildcards)")
    pub.add_argument(
        "-m",
        "--message",
        action="append",
        metavar="TEXT",
        help="a message payload (repeat for several); without -m, each line of stdin is one message",
    )
    pub.add_argument(
        "--sender",
        default=DEFAULT_SENDER,
        metavar="CLIENTID",
        help=f"the publisher's MQTT clientid; it decides the shard (default {DEFAULT_SENDER})",
    )
    pub.add_argument("--qos", type=int, choices=(0, 1, 2), default=1, help="MQTT QoS recorded with it (default 1)")
    pub.add_argument(
        "--retain",
        action="store_true",
        help="set the MQTT retain flag and make the last message the topic's retained message (-m '' deletes it)",
    )
    pub.add_argument(
        "--property",
        type=_property,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an MQTT 5 user property (repeatable)",
    )
    pub.add_argument(
        "--count",
        type=int,
        default=1,
        metavar="N",
        help="publish each message N times (default 1); '{n}' in a message becomes its number, from 0",
    )
    pub.add_argument(
        "--batch",
        type=int,
        default=500,
        metavar="N",
        help="messages per store batch (default 500); up to 16 batches are in flight at once, "
        "pipelined on one stream per node",
    )
    pub.add_argument("-q", "--quiet", action="store_true", help="print only the summary, not a line per message")
    pub.set_defaults(run=run_pub)

    replay = sub.add_parser(
        "replay",
        parents=[connection],
        help="read stored messages matching a topic filter",
        description=(
            "Print every stored message matching FILTER (MQTT wildcards: + one level, # the rest), shard by "
            "shard, each publisher's messages in the order they were stored: what was stored when it starts, "
            "so it ends while writers go on (a generation that retention drops meanwhile is reported on stderr "
            "and skipped). With --follow, keep printing "
            "messages as they are stored until Ctrl-C: a push subscription, which rides out a node's failure "
            "with nothing lost or repeated."
        ),
    )
    replay.add_argument("filter", metavar="FILTER", help="topic filter, e.g. 'sensor/+/temp' or 'sensor/#' (quote it)")
    replay.add_argument("--since", metavar="TIME", help=f"only messages stored at or after TIME: {TIME_HELP}")
    replay.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="after the stored messages, keep printing new ones as the nodes push them, until Ctrl-C (messages "
        "come vnode by vnode as they are stored: each publisher's in order, not all in one global order)",
    )
    replay.add_argument("--limit", type=int, metavar="N", help="stop after N messages")
    replay.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="text: one readable line per message; json: one JSON object per line (default text)",
    )
    replay.add_argument(
        "--batch",
        type=int,
        default=1000,
        metavar="N",
        help="messages per read call; with --follow, messages each vnode may send ahead (default 1000)",
    )
    replay.add_argument(
        "--stale-ok",
        action="store_true",
        help="let any replica answer (may lag its leader slightly); useful while a vnode has no leader",
    )
    replay.set_defaults(run=run_replay)
