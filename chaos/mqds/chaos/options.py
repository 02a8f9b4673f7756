"""The run's options: the command line (its ``--help`` texts), its checks, and :class:`Options`.

:func:`parse_options` turns a command line into :class:`Options` (argparse
exits with status 2 on a bad one, after saying why); tests build
:class:`Options` directly.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mqds.chaos import nemesis as nem

PROG = "python -m mqds.chaos"


@dataclass
class Options:
    duration_s: float = 120.0
    nemeses: list[str] = field(default_factory=lambda: nem.mix(disks=False))
    nodes: int = 5
    shards: int = 8
    seed: int = 0
    network: str = "auto"
    multi_publishers: int = 2
    pipelined_publishers: int = 2
    pipeline_in_flight: int = 32
    readers: int = 2
    followers: int = 4
    pubsub_consumers: int = 2
    queue_consumers: int = 2
    consumer_poll_s: float = 2.0
    batch: int = 10
    interval_s: float = 0.05
    call_timeout_s: float = 3.0
    hold_s: tuple[float, float] = (3.0, 8.0)
    quiet_s: tuple[float, float] = (2.0, 5.0)
    drain_timeout_s: float = 60.0
    generation_interval_s: float = 20.0
    raft_log_max_bytes: int = 64 * 1024
    raft_segment_bytes: int = 1024 * 1024
    raft_compaction_interval_s: float = 3.0
    hostile: bool = True
    hostile_interval_s: float = 0.5
    work_dir: Path | None = None
    keep: bool = False
    report_json: Path | None = None
    progress_s: float = 5.0
    disk: str = "auto"
    """off, posix, journal, or auto: posix when a disk nemesis is chosen (see ``--disk``)."""

    @property
    def disk_mode(self) -> str:
        """The nodes' disks: "off", or the fault filesystems' metadata mode ("posix", "journal")."""
        if self.disk != "auto":
            return self.disk
        return "posix" if set(self.nemeses) & nem.DISK_NEMESES else "off"

    @property
    def idle_s(self) -> float:
        """The idle-restart nemeses' idle spell: two compaction intervals and 2 s."""
        return 2 * self.raft_compaction_interval_s + 2.0


def _range(text: str) -> tuple[float, float]:
    low, sep, high = text.partition("-")
    try:
        a = float(low)
        b = float(high) if sep else a
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds, or MIN-MAX") from None
    if a < 0 or b < a:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 0 <= MIN <= MAX")
    return a, b


def _nemeses(text: str) -> list[str]:
    if text == "mix":
        return ["mix"]  # resolved with --disk (parse_options)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in nem.NEMESES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown nemesis {', '.join(unknown) or text!r}; choose from {', '.join(nem.NEMESES)} or 'mix'"
        )
    return list(dict.fromkeys(names))


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    nemesis_help = "; ".join(f"{name}: {cls.description}" for name, cls in nem.NEMESES.items())
    parser = argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Start a real multi-process mqds cluster, write and read it while injecting faults, heal, drain, and "
            "check the history: every acknowledged message read back, nothing unexpected, no duplicates, each "
            "sender's messages in order, replicas identical, every acknowledged message delivered to the "
            "persistent-session consumers (redeliveries counted); report how long writes stopped per fault. Exit code "
            "0 = passed, 1 = a violation, 2 = bad options, 3 = the run could not be carried out."
        ),
        epilog="nemeses:\n  " + "\n  ".join(f"{n:<16} {cls.description}" for n, cls in nem.NEMESES.items()),
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds of faults under load; faults go on past it until every chosen nemesis ran once (default 120)",
    )
    parser.add_argument(
        "--nemesis",
        type=_nemeses,
        default="mix",
        metavar="LIST",
        help="'mix' (all, in a seeded order, each once per cycle; the disk nemeses only with --disk posix or "
        "journal), one nemesis, or a comma list. " + nemesis_help,
    )
    parser.add_argument(
        "--disk",
        choices=("auto", "off", "posix", "journal"),
        default="auto",
        help="put each node's data directory on a fault filesystem (mqds.chaos.faultfs; needs root and FUSE: exit "
        "code 3 where it cannot) that the disk nemeses (power-loss-*, disk-*) make lose power, fill up, fail or slow "
        "down. posix: a directory's entries are durable once that directory is fsynced; journal: any fsync makes "
        "every earlier directory change durable, as ext4's journal does; off: plain directories; auto: posix when "
        "a disk nemesis is chosen, else off (default auto)",
    )
    parser.add_argument("--nodes", type=int, default=5, metavar="N", help="nodes in the cluster, 3 or more (default 5)")
    parser.add_argument("--shards", type=int, default=8, metavar="N", help="vnodes, 3 replicas each (default 8)")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="N",
        help="seed of the fault schedule (order, hold times, targets); printed, so a run can be replayed "
        "(default: random)",
    )
    parser.add_argument("--report-json", type=Path, metavar="PATH", help="also write the report as JSON to PATH")
    parser.add_argument(
        "--network",
        choices=("auto", "netns", "hook"),
        default="auto",
        help="netns: each node in its own network namespace, partitions are tc filters (needs root, ip, tc); "
        "hook: nodes on loopback, partitions through the nodes' Raft fault hook; auto: netns when possible "
        "(default auto)",
    )
    parser.add_argument(
        "--multi-publishers",
        type=int,
        default=2,
        metavar="N",
        help="publishers whose every call spans three shards, besides one publisher per shard (default 2)",
    )
    parser.add_argument(
        "--pipelined-publishers",
        type=int,
        default=2,
        metavar="N",
        help="publishers storing one message per store_async call, --pipeline-in-flight calls at a time, each "
        "with a sender of its own (default 2)",
    )
    parser.add_argument(
        "--pipeline-in-flight",
        type=int,
        default=32,
        metavar="N",
        help="unacknowledged calls of each pipelined publisher (default 32)",
    )
    parser.add_argument(
        "--readers", type=int, default=2, metavar="N", help="readers tailing with iterators; odd ones stale_ok (2)"
    )
    parser.add_argument(
        "--followers",
        type=int,
        default=4,
        metavar="N",
        help="push subscribers (Client.follow) on chaos/#, each of which must be sent every acknowledged message "
        "exactly once; odd ones let any replica serve them; from the third on, each shares the client of the one "
        "two before it, so their subscriptions take shared answers (4)",
    )
    parser.add_argument(
        "--pubsub-consumers",
        type=int,
        default=2,
        metavar="N",
        help="persistent-session consumers with their own read position on chaos/#: fetch_offline, ack (2)",
    )
    parser.add_argument(
        "--queue-consumers",
        type=int,
        default=2,
        metavar="N",
        help="consumers sharing queue mode on the topics of a slow sender of their own: fetch_offline, ack each (2)",
    )
    parser.add_argument(
        "--consumer-poll",
        type=float,
        default=2.0,
        metavar="S",
        help="once caught up, a consumer fetches every S seconds; each fetch reads every shard, and acks are Raft "
        "writes, so a shorter S costs the publishers throughput (2)",
    )
    parser.add_argument("--batch", type=int, default=10, metavar="N", help="messages per store_batch call (10)")
    parser.add_argument(
        "--interval", type=float, default=0.05, metavar="S", help="pause of each publisher between calls (0.05)"
    )
    parser.add_argument(
        "--call-timeout",
        type=float,
        default=3.0,
        metavar="S",
        help="deadline of each store_batch call; a call that runs out is retried with its sequence (default 3)",
    )
    parser.add_argument(
        "--hold", type=_range, default=(3.0, 8.0), metavar="MIN-MAX", help="how long a fault lasts, s (3-8)"
    )
    parser.add_argument(
        "--quiet", type=_range, default=(2.0, 5.0), metavar="MIN-MAX", help="time between faults, s (2-5)"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="after the faults, how long publishers may keep retrying unacknowledged calls (default 60)",
    )
    parser.add_argument(
        "--generation-interval",
        type=float,
        default=20.0,
        metavar="S",
        help="the nodes' generation_interval_s: generations turn during the run, and clock skew moves them (20)",
    )
    parser.add_argument(
        "--raft-log-max-bytes",
        type=int,
        default=64 * 1024,
        metavar="N",
        help="the nodes' raft_log_max_bytes: small, so logs compact and a wiped node needs a snapshot (65536)",
    )
    parser.add_argument(
        "--raft-segment-bytes",
        type=int,
        default=1024 * 1024,
        metavar="N",
        help="the nodes' raft_segment_bytes: small, so the Raft log starts new segments and deletes old ones "
        "while nodes are killed (1048576)",
    )
    parser.add_argument(
        "--raft-compaction-interval-s",
        type=float,
        default=3.0,
        metavar="S",
        help="the nodes' raft_compaction_interval_s: short, so the idle-restart nemeses' idle spell (twice this "
        "plus 2 s, with no writes) outlasts it and every group compacts while idle (3)",
    )
    parser.add_argument(
        "--hostile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hostile clients beside the workload for the whole run: deep topics, thousands of repeated shards, "
        "empty batches, garbage bytes, admin calls without credentials (and some with the secret, invalid), "
        "bursts of slow calls on one connection, over raw gRPC; any INTERNAL or UNKNOWN answer fails the run "
        "(default on)",
    )
    parser.add_argument(
        "--hostile-interval",
        type=float,
        default=0.5,
        metavar="S",
        help="seconds between two hostile requests (0.5)",
    )
    parser.add_argument(
        "--work-dir", type=Path, metavar="DIR", help="where the nodes' data and logs go (default: a new temp dir)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work dir (it is always kept when the run fails)")
    parser.add_argument(
        "--progress", type=float, default=5.0, metavar="S", help="seconds between progress lines; 0 = none (5)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the harness does (to stderr)")
    return parser


def parse_options(argv: Sequence[str] | None, prog: str = PROG) -> tuple[Options, argparse.Namespace]:
    parser = build_parser(prog)
    ns = parser.parse_args(argv)
    if ns.nodes < 3:
        parser.error("--nodes must be 3 or more (a majority must survive a minority failing)")
    counts = (
        ns.readers,
        ns.followers,
        ns.multi_publishers,
        ns.pipelined_publishers,
        ns.pubsub_consumers,
        ns.queue_consumers,
    )
    if ns.shards < 1 or ns.batch < 1 or ns.pipeline_in_flight < 1 or min(counts) < 0:
        parser.error(
            "--shards, --batch and --pipeline-in-flight must be 1 or more; --readers, --followers, "
            "--multi-publishers, --pipelined-publishers, --pubsub-consumers and --queue-consumers 0 or more"
        )
    if ns.consumer_poll <= 0:
        parser.error("--consumer-poll must be greater than 0")
    if ns.duration <= 0 or ns.call_timeout <= 0 or ns.drain_timeout <= 0:
        parser.error("--duration, --call-timeout and --drain-timeout must be greater than 0")
    if ns.raft_compaction_interval_s <= 0 or ns.hostile_interval <= 0:
        parser.error("--raft-compaction-interval-s and --hostile-interval must be greater than 0")
    nemeses = ns.nemesis if isinstance(ns.nemesis, list) else _nemeses(ns.nemesis)
    if nemeses == ["mix"]:
        nemeses = nem.mix(disks=ns.disk in ("posix", "journal"))
    if ns.disk == "off" and set(nemeses) & nem.DISK_NEMESES:
        parser.error(f"--disk off: the nemeses {', '.join(sorted(set(nemeses) & nem.DISK_NEMESES))} need a disk")
    opts = Options(
        duration_s=ns.duration,
        nemeses=nemeses,
        nodes=ns.nodes,
        shards=ns.shards,
        seed=ns.seed if ns.seed is not None else random.SystemRandom().randrange(1, 2**31),
        network=ns.network,
        multi_publishers=ns.multi_publishers,
        pipelined_publishers=ns.pipelined_publishers,
        pipeline_in_flight=ns.pipeline_in_flight,
        readers=ns.readers,
        followers=ns.followers,
        pubsub_consumers=ns.pubsub_consumers,
        queue_consumers=ns.queue_consumers,
        consumer_poll_s=ns.consumer_poll,
        batch=ns.batch,
        interval_s=ns.interval,
        call_timeout_s=ns.call_timeout,
        hold_s=ns.hold,
        quiet_s=ns.quiet,
        drain_timeout_s=ns.drain_timeout,
        generation_interval_s=ns.generation_interval,
        raft_log_max_bytes=ns.raft_log_max_bytes,
        raft_segment_bytes=ns.raft_segment_bytes,
        raft_compaction_interval_s=ns.raft_compaction_interval_s,
        hostile=ns.hostile,
        hostile_interval_s=ns.hostile_interval,
        work_dir=ns.work_dir,
        keep=ns.keep,
        report_json=ns.report_json,
        progress_s=ns.progress,
        disk=ns.disk,
    )
    return opts, ns
