"""``mqds generations list|add|drop``: the time-based generations of the shards."""

from __future__ import annotations

import argparse

from mqds.cli.console import EXIT_OK, EXIT_USAGE, CommandError, connection, format_time_us, table
from mqds.cli.secret import cluster_secret_options, with_cluster_secret
from mqds.client import Client, Generation


def _when(us: int | None, current: str = "current") -> str:
    if us is None:
        return current
    return "the start" if us == 0 else format_time_us(us, "seconds")


def _rows(gens: list[Generation]) -> str:
    rows = [
        [g.shard, g.generation, _when(g.since_us), _when(g.until_us, "(current, takes writes)"), _when(g.created_at_us)]
        for g in gens
    ]
    return table(["SHARD", "GEN", "SINCE", "UNTIL", "CREATED"], rows, right=(0, 1))


def _check_shard(shard: int | None) -> None:
    if shard is not None and shard < 0:
        raise CommandError("--shard must be 0 or more", EXIT_USAGE)


def run(opts: argparse.Namespace) -> int:
    # add and drop are admin calls: they present the cluster secret when one is given.
    with Client(opts.endpoints, settings=with_cluster_secret(connection(opts, 30.0), opts)) as client:
        if opts.action == "list":
            _check_shard(opts.shard)
            gens = client.list_generations(opts.shard, stale_ok=opts.stale_ok)
            print(_rows(gens))
            current = sum(1 for g in gens if g.current)
            shards = len({g.shard for g in gens})
            print(
                f"\n{len(gens)} generations in {shards} shard{'s' if shards != 1 else ''}: "
                f"{current} current, {len(gens) - current} closed (read-only, can be dropped)"
            )
        elif opts.action == "add":
            _check_shard(opts.shard)
            added = client.add_generation(opts.shard)
            print(_rows(added))
            print(f"\nstarted {len(added)} new generation{'s' if len(added) != 1 else ''}; new writes go to them")
        else:
            if opts.shard < 0 or opts.generation < 0:
                raise CommandError("SHARD and GENERATION must be 0 or more", EXIT_USAGE)
            dropped = client.drop_generation(opts.shard, opts.generation)
            print(
                f"dropped shard {dropped.shard} generation {dropped.generation} "
                f"({_when(dropped.since_us)} to {_when(dropped.until_us)}); its disk space is freed"
            )
    return EXIT_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], connection: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "generations",
        parents=[connection],
        help="list, start or drop generations",
        description=(
            "Each shard's messages are cut into generations (time intervals). Writes go to the current one; "
            "closed ones are read-only and are dropped whole to free disk (retention does that by itself when "
            "retention_period_s is set)."
        ),
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="{list,add,drop}")
    listing = actions.add_parser(
        "list", parents=[connection], help="every generation of every shard (or one)", description="List generations."
    )
    listing.add_argument("--shard", type=int, metavar="N", help="only this shard")
    listing.add_argument(
        "--stale-ok", action="store_true", help="let any replica answer (works while a vnode has no leader)"
    )
    add = actions.add_parser(
        "add",
        parents=[connection, cluster_secret_options()],
        help="close the current generation and start a new one",
        description="Close the current generation of every shard (or of one) and start a new one.",
    )
    add.add_argument("--shard", type=int, metavar="N", help="only this shard (default: every shard)")
    drop = actions.add_parser(
        "drop",
        parents=[connection, cluster_secret_options()],
        help="drop a closed generation and free its disk",
        description="Drop a closed generation of a shard: its messages are deleted and its disk freed. "
        "The current generation cannot be dropped (add a new one first).",
    )
    drop.add_argument("shard", type=int, metavar="SHARD", help="the shard")
    drop.add_argument("generation", type=int, metavar="GENERATION", help="the generation (see 'generations list')")
    parser.set_defaults(run=run)
