"""``mqds exhook``: serve EMQX's ExHook gRPC interface, keeping broker state in mqds by hook rules."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from mqds.broker.actions import BrokerHooks
from mqds.broker.exhook.listener import INSECURE_FLAG, ProviderTLS, check_listener, describe
from mqds.broker.exhook.positions import DEFAULT_TTL_S
from mqds.broker.exhook.provider import (
    DEFAULT_ACK_CACHE_SIZE,
    SERVICE,
    ExhookServer,
    HookProvider,
    UndecodableRequests,
)
from mqds.broker.hooks import HookConfig, HookConfigError, load_config, parse_duration
from mqds.cli.console import EXIT_OK, EXIT_USAGE, CommandError, connection
from mqds.client import aio
from mqds.client.connection import ConnectionSettings
from mqds.protocol.errors import MqdsError
from mqds.protocol.limits import SESSION_NEVER_EXPIRES

DEFAULT_LISTEN = "127.0.0.1:9000"
STARTUP_CHECK_TIMEOUT_S = 10.0
STOP_GRACE_S = 5.0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _provider_tls(opts: argparse.Namespace) -> ProviderTLS | None:
    if bool(opts.server_cert) != bool(opts.server_key):
        raise CommandError("--server-cert and --server-key go together", EXIT_USAGE)
    if opts.client_ca and not opts.server_cert:
        raise CommandError("--client-ca needs TLS: give --server-cert and --server-key too", EXIT_USAGE)
    if not opts.server_cert:
        return None
    try:
        return ProviderTLS.from_files(opts.server_cert, opts.server_key, opts.client_ca)
    except ValueError as err:
        raise CommandError(str(err), EXIT_USAGE) from None


async def _serve(
    opts: argparse.Namespace,
    config: HookConfig,
    settings: ConnectionSettings,
    tls: ProviderTLS | None,
) -> int:
    async with aio.Client(opts.endpoints, settings=settings) as client:
        try:
            cmap = await client.cluster_map(timeout_s=min(settings.timeout_s, STARTUP_CHECK_TIMEOUT_S))
        except MqdsError as err:
            raise CommandError(f"cannot reach the mqds cluster at {opts.endpoints}: {err}") from None
        hooks = BrokerHooks(client, config, node=opts.node)
        provider = HookProvider(hooks, ack_cache_size=opts.ack_cache_size, ack_positions_ttl_s=opts.ack_positions_ttl_s)
        try:
            server = ExhookServer(provider, opts.listen, tls, insecure_no_client_auth=opts.insecure_no_client_auth)
        except ValueError as err:
            raise CommandError(str(err), EXIT_USAGE) from None
        try:
            address = await server.start()
        except OSError as err:
            raise CommandError(str(err)) from None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        try:
            needed = ", ".join(hooks.needed_hooks()) or "none"
            scheme = describe(tls)
            print(
                f"mqds exhook: serving {SERVICE} on {address} ({scheme}) for the mqds cluster at {opts.endpoints} "
                f"({_count(len(cmap.nodes), 'node')}, {_count(cmap.n_shards, 'vnode')}); "
                f"{_count(len(config.rules), 'rule')} from {config.source}, hooks: {needed}. Ctrl-C stops.",
                flush=True,
            )
            await stop.wait()
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            await server.stop(STOP_GRACE_S)
        summary = provider.summary()
        if server.guard.refused:
            summary += f"\n  refused: calls of methods not served {server.guard.refused}"
        print("mqds exhook: stopped; " + summary, flush=True)
    return EXIT_OK


def _ttl_s(text: str) -> int:
    """``--ack-positions-ttl`` in whole seconds: a duration of 1 s to about 136 years; no infinity (it bounds)."""
    try:
        seconds = parse_duration(text)
    except ValueError as err:
        raise CommandError(f"--ack-positions-ttl: {err}", EXIT_USAGE) from None
    if seconds is None or not 1 <= seconds <= SESSION_NEVER_EXPIRES:
        raise CommandError(
            f"--ack-positions-ttl {text!r}: give a duration from 1s to {SESSION_NEVER_EXPIRES} seconds "
            "(the records must expire)",
            EXIT_USAGE,
        )
    return int(seconds)


def run(opts: argparse.Namespace) -> int:
    try:
        config = load_config(opts.config)
    except HookConfigError as err:
        raise CommandError(str(err), EXIT_USAGE) from None
    for note in config.notes:
        print(f"mqds exhook: {note}", flush=True)
    if opts.ack_cache_size < 1:
        raise CommandError("--ack-cache-size must be at least 1", EXIT_USAGE)
    opts.ack_positions_ttl_s = _ttl_s(opts.ack_positions_ttl)
    tls = _provider_tls(opts)
    # Before the cluster is asked anything: a listener that would let anyone in is a usage error.
    try:
        insecure = check_listener(opts.listen, tls, insecure_no_client_auth=opts.insecure_no_client_auth)
    except ValueError as err:
        raise CommandError(str(err), EXIT_USAGE) from None
    if insecure:
        print(
            f"mqds exhook: WARNING: {INSECURE_FLAG}: {opts.listen} takes calls from other machines and "
            f"authenticates no caller ({describe(tls)}): anyone who reaches it stores messages with this "
            "provider's token",
            file=sys.stderr,
            flush=True,
        )
    logging.basicConfig(
        level=logging.INFO if opts.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("grpc._cython.cygrpc").addFilter(UndecodableRequests())
    return asyncio.run(_serve(opts, config, connection(opts, 30.0), tls))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], connection: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "exhook",
        parents=[connection],
        help="serve EMQX's ExHook gRPC interface, keeping client state, subscriptions and messages in mqds",
        description=(
            f"Serve {SERVICE} (EMQX 5.9+ ExHook v3) so that EMQX calls mqds at its hook points. The rules in "
            "--config (TOML, YAML, or an EMQX backend's .conf lines; examples in deploy/hooks/) decide what each "
            "hook does: record clients "
            "online and offline, store published messages and retained messages, store subscriptions, record "
            "acknowledgements. Point EMQX at it with exhook.servers = [{name = mqds, url = "
            '"https://HOST:PORT", ssl = {enable = true, certfile, keyfile, cacertfile, verify = verify_peer}}]. '
            "EMQX sends no token: on an address other machines can reach, the provider serves mutual TLS "
            "(--server-cert, --server-key, --client-ca) and refuses to start without it. ExHook cannot hand "
            "messages or subscriptions back to EMQX sessions: offline "
            "and retained messages found on subscribe are counted, not delivered (see "
            "docs/brokers.md). Runs until Ctrl-C or SIGTERM, then prints what it handled."
        ),
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        required=True,
        help="the hook rules: a .toml or .yaml file, or an EMQX backend's own .conf lines (see docs/brokers.md; "
        "deploy/hooks/ has examples)",
    )
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        default=DEFAULT_LISTEN,
        help=f"where EMQX connects (default {DEFAULT_LISTEN}; port 0 picks one). An address other machines can "
        "reach (0.0.0.0:9000: every interface) needs mutual TLS",
    )
    parser.add_argument(
        "--node",
        metavar="NAME",
        help="the broker node name recorded with online clients (default: the config's node, else the EMQX "
        "node each call names)",
    )
    parser.add_argument(
        "--ack-cache-size",
        type=int,
        metavar="N",
        default=DEFAULT_ACK_CACHE_SIZE,
        help="how many EMQX message ids this process remembers with their stored positions, to record their "
        f"acknowledgements without asking the cluster (default {DEFAULT_ACK_CACHE_SIZE:,}; older ones are "
        "forgotten first, and read back from the cluster when acknowledged)",
    )
    parser.add_argument(
        "--ack-positions-ttl",
        metavar="DURATION",
        default=f"{DEFAULT_TTL_S // 3600}h",
        help="how long the cluster keeps each stored message's EMQX id -> position record, by which a restarted "
        "provider still records the acknowledgements of messages stored before (default "
        f"{DEFAULT_TTL_S // 3600}h; 45s, 30m, 2h, 1d; shorter for a message with a shorter expiry interval). "
        "Written only when some rule records acknowledgements: one retained record per stored message",
    )
    parser.add_argument(
        "--server-cert",
        metavar="FILE",
        help="PEM certificate (chain) to serve TLS with, for EMQX's exhook ssl option (an https:// url); the "
        "name EMQX dials must be in it; needs --server-key",
    )
    parser.add_argument("--server-key", metavar="FILE", help="PEM private key of --server-cert")
    parser.add_argument(
        "--client-ca",
        metavar="FILE",
        help="PEM CA certificate(s) that signed EMQX's client certificate (its exhook ssl certfile): every "
        "caller must present one (mutual TLS); use a CA that issues certificates to EMQX only",
    )
    parser.add_argument(
        INSECURE_FLAG,
        action="store_true",
        help="serve without client certificates on an address other machines can reach: anyone who connects "
        "can store messages with this provider's token (refused without this flag)",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log each provider load and what could not be delivered"
    )
    parser.set_defaults(run=run)
