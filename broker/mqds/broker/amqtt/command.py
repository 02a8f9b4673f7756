"""``mqds broker``: an amqtt MQTT broker whose sessions, subscriptions and messages persist in mqds.

It runs amqtt (``pip install 'mqds-broker[cli]'``) with the
:class:`mqds.broker.amqtt_plugin.MqdsPlugin` plugin in the foreground until
Ctrl-C or SIGTERM, then stops cleanly (the stores and acknowledgements in
progress finish, connected clients are recorded offline) and prints what it
did. amqtt is imported only when the command runs, so the client installs
without it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from pathlib import Path
from typing import Any

from mqds.cli.console import EXIT_OK, EXIT_USAGE, CommandError, connection
from mqds.client.connection import parse_endpoints
from mqds.protocol.share_groups import MAX_LEASE_S

PLUGIN = "mqds.broker.amqtt_plugin.MqdsPlugin"
AUTH_PLUGIN = "amqtt.plugins.authentication.AnonymousAuthPlugin"
DEFAULT_LISTEN = "127.0.0.1:1883"


def _listen(text: str) -> str:
    _, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 0.0.0.0:1883)")
    if not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: the port must be 1 to 65535")
    return text


class _NoTraceback(logging.Filter):
    """Without -v, amqtt's errors are shown as one line: the command says what went wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = None
        record.exc_text = None
        return True


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _lease(text: str) -> int:
    value = _positive(text)
    if value > MAX_LEASE_S:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_LEASE_S}")
    return value


def _amqtt_config(path: str | None) -> dict[str, Any]:
    """The amqtt broker configuration to start from: the --amqtt-config file, or one plain TCP listener."""
    if path is None:
        return {"plugins": {AUTH_PLUGIN: {"allow_anonymous": True}}}
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise CommandError(f"{path}: cannot read: {err.strerror or err}", EXIT_USAGE) from None
    except yaml.YAMLError as err:
        raise CommandError(f"{path}: not valid YAML: {err}", EXIT_USAGE) from None
    if not isinstance(data, dict):
        raise CommandError(f"{path}: expected amqtt's broker configuration (a mapping)", EXIT_USAGE)
    plugins = data.get("plugins")
    if isinstance(plugins, list):  # amqtt's older list form
        merged: dict[str, Any] = {}
        for entry in plugins:
            merged.update({entry: {}} if isinstance(entry, str) else dict(entry))
        plugins = merged
    if plugins is None:
        plugins = {AUTH_PLUGIN: {"allow_anonymous": True}}
    if not isinstance(plugins, dict):
        raise CommandError(f"{path}: plugins must be a mapping of plugin class -> options", EXIT_USAGE)
    data["plugins"] = plugins
    return data


def broker_config(opts: argparse.Namespace) -> dict[str, Any]:
    """amqtt's broker configuration for the command line: listeners, plugins, the mqds plugin's options."""
    config = _amqtt_config(opts.amqtt_config)
    if opts.listen is not None or "listeners" not in config:
        config["listeners"] = {"default": {"type": "tcp", "bind": opts.listen or DEFAULT_LISTEN}}
    settings = connection(opts, 10.0)
    plugin: dict[str, Any] = {
        "endpoints": ",".join(parse_endpoints(opts.endpoints)),
        "hooks": opts.hooks,
        "node": opts.node,
        "timeout_s": float(settings.timeout_s),
        "tls": bool(opts.tls),
        "tls_ca": opts.tls_ca,
        "tls_cert": opts.tls_cert,
        "tls_key": opts.tls_key,
        "tls_server_name": opts.tls_server_name,
        "token": opts.token,
        "max_inflight": opts.max_inflight,
        "puback_after_store": not opts.early_puback,
        "queue_redelivery": not opts.no_queue_redelivery,
        "queue_ack_wait_ms": opts.queue_ack_wait_ms,
        "queue_max_deliveries": opts.queue_max_deliveries,
        "queue_backoff_ms": opts.queue_backoff_ms,
        "queue_max_unacked": opts.queue_max_unacked,
        "queue_dead_letter_topic": opts.queue_dead_letter_topic,
        "shared_poll_ms": opts.shared_poll_ms,
        "shared_lease_s": opts.shared_lease_s,
    }
    # The mqds plugin's own entry (if the file had one) is replaced by the command line's.
    config["plugins"] = {name: cfg for name, cfg in config["plugins"].items() if name != PLUGIN} | {PLUGIN: plugin}
    return config


def _listeners(config: dict[str, Any]) -> str:
    return ", ".join(
        f"{'mqtt' if listener.get('type', 'tcp') == 'tcp' else listener.get('type')}://{listener.get('bind')}"
        for listener in config["listeners"].values()
        if listener.get("bind")
    )


def _elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def run_broker(opts: argparse.Namespace) -> int:
    try:
        from amqtt.broker import Broker
        from amqtt.errors import BrokerError
    except ImportError as err:
        raise CommandError(
            f"mqds broker runs amqtt, which is not installed ({err}); install it: pip install 'mqds-broker[cli]'"
        ) from None
    from mqds.broker.amqtt.plugin import DEFAULT_RULES, MqdsPlugin, redelivery_policy
    from mqds.broker.hooks import HookConfigError, load_config

    try:
        rules = load_config(opts.hooks) if opts.hooks else DEFAULT_RULES
    except HookConfigError as err:
        raise CommandError(str(err), EXIT_USAGE) from None
    for note in rules.notes:
        print(f"mqds broker: {note}", flush=True)
    for rule in rules.rules_for("message.delivered"):
        # amqtt has no delivery event: the rule is valid (mqds exhook runs it), but never runs here.
        print(
            f"mqds broker: {rules.source}: {rule.describe()} never runs: amqtt reports no deliveries "
            "(the PUBACKs of what mqds delivers run the message.acked rules)",
            flush=True,
        )
    config = broker_config(opts)
    try:
        redelivery_policy(MqdsPlugin.Config(**config["plugins"][PLUGIN]))
    except ValueError as err:
        raise CommandError(str(err), EXIT_USAGE) from None
    logging.basicConfig(
        level=logging.INFO if opts.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not opts.verbose:
        # amqtt logs every refused delivery at INFO; the plugin refuses on purpose (it sends those itself).
        logging.getLogger("amqtt").setLevel(logging.WARNING)
        for handler in logging.getLogger().handlers:
            handler.addFilter(_NoTraceback())

    async def serve() -> int:
        try:
            broker = Broker(config)
        except Exception as err:  # amqtt's configuration and plugin-loading errors share no base class
            why = f"{err}: {err.__cause__}" if err.__cause__ else str(err)
            raise CommandError(f"amqtt refused the configuration: {why}", EXIT_USAGE) from None
        plugin = broker.plugins_manager.get_plugin(MqdsPlugin.__name__)
        assert isinstance(plugin, MqdsPlugin)
        try:
            await broker.start()
        except BrokerError as err:
            await plugin.close()
            raise CommandError(f"the broker did not start: {err.__cause__ or err}") from None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        where = "rules " + (opts.hooks or "built in (mqds.broker.amqtt_plugin.DEFAULT_RULES)")
        print(
            f"mqds broker: ready: MQTT on {_listeners(config)}, node {plugin.node}; storing in mqds at "
            f"{plugin.config.endpoints}; {where} ({len(rules.rules)} rules); Ctrl-C stops",
            flush=True,
        )
        await stop.wait()
        print("mqds broker: stopping (finishing the stores and acknowledgements in progress) ...", flush=True)
        await broker.shutdown()
        print(f"mqds broker: stopped after {_elapsed(time.monotonic() - plugin.started_at)}: {plugin.summary()}")
        return EXIT_OK

    return asyncio.run(serve())


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], connection: argparse.ArgumentParser) -> None:
    broker = sub.add_parser(
        "broker",
        parents=[connection],
        help="run an amqtt MQTT broker that persists sessions and messages in mqds",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run an MQTT 3.1.1 broker (amqtt) in the foreground with the mqds plugin: every published message\n"
            "is stored in the cluster of --endpoints as the rules of --hooks say; clients get their stored\n"
            "(proxy) subscriptions and retained messages when they connect; a persistent session (clean\n"
            "session off) that was offline gets what it missed when it reconnects, also after this broker\n"
            "restarted; subscribers' PUBACKs move their read positions; a publisher gets its PUBACK once\n"
            "mqds stored the message (--early-puback: amqtt's own). Ctrl-C or SIGTERM stops it cleanly\n"
            "and prints what it did. Needs amqtt: pip install 'mqds-broker[cli]'."
        ),
        epilog=(
            "example:\n"
            "  mqds broker --listen 0.0.0.0:1883 --endpoints mqds-0:7101,mqds-1:7101 --hooks hooks.toml --node b1"
        ),
    )
    broker.add_argument(
        "--listen",
        type=_listen,
        metavar="HOST:PORT",
        help=f"where MQTT clients connect (plain TCP; default {DEFAULT_LISTEN}, or the listeners of --amqtt-config)",
    )
    broker.add_argument(
        "--hooks",
        metavar="FILE",
        help="the hook rules (TOML, YAML, or an EMQX backend's .conf lines; see mqds.broker.hooks) deciding what "
        "is stored, fetched and "
        "acknowledged; default: store every QoS 1/2 and retained message, pubsub offline delivery on every topic",
    )
    broker.add_argument(
        "--node",
        metavar="NAME",
        help="this broker's name, recorded with its online clients (default: the rules' node, then the host name)",
    )
    broker.add_argument(
        "--amqtt-config",
        metavar="FILE",
        help="an amqtt broker configuration (YAML) to start from: its listeners (TLS, websockets), "
        "authentication and other plugins; the mqds plugin is added with this command's options",
    )
    broker.add_argument(
        "--max-inflight",
        type=_positive,
        default=32,
        metavar="N",
        help="messages the plugin sends one client that may await the client's PUBACK at once (default 32)",
    )
    broker.add_argument(
        "--early-puback",
        action="store_true",
        help="acknowledge publishes as amqtt does, when queued, before mqds stored them: faster, but a broker "
        "killed (kill -9, a crash) loses what it acknowledged and had not stored yet. Default: a QoS 1/2 "
        "publish a rule stores gets its PUBACK/PUBREC once mqds stored it; a failed store closes the "
        "publisher's connection unacknowledged (it resends when it reconnects)",
    )
    redelivery = broker.add_argument_group(
        "queue redelivery",
        "How queue subscriptions (on_message_fetch_for_queue) are redelivered by the cluster: each delivery to "
        "a reader is counted; one it does not PUBACK comes again after the ack wait (at its next connection at "
        "once when the connection closed before the PUBACK), and after its last delivery it goes to the "
        "dead-letter topic",
    )
    redelivery.add_argument(
        "--no-queue-redelivery",
        action="store_true",
        help="plain queue fetches instead: an unacknowledged message comes again at each connection, uncounted",
    )
    redelivery.add_argument(
        "--queue-ack-wait-ms",
        type=_positive,
        default=30_000,
        metavar="MS",
        help="how long a delivery waits for its PUBACK before it is due again (1 to 86,400,000; default 30000)",
    )
    redelivery.add_argument(
        "--queue-max-deliveries",
        type=_positive,
        default=1_000,
        metavar="N",
        help="the most times a message is delivered to one reader (1 to 1,000; default 1000)",
    )
    redelivery.add_argument(
        "--queue-backoff-ms",
        default="",
        metavar="MS,MS,...",
        help="waits after the 1st, 2nd, ... delivery instead of the ack wait, the last for later ones "
        "(e.g. 1000,5000,30000; default none)",
    )
    redelivery.add_argument(
        "--queue-max-unacked",
        type=_positive,
        default=1_000,
        metavar="N",
        help="the most messages of one reader delivered and not acknowledged, per shard (1 to 10,000; default 1000)",
    )
    redelivery.add_argument(
        "--queue-dead-letter-topic",
        default="",
        metavar="TOPIC",
        help="where a message goes after its last delivery (a topic without wildcards, with the original topic, "
        "the delivery count and the reader as user properties); default: it is just not delivered again",
    )
    shared = broker.add_argument_group(
        "shared subscriptions",
        "$share/<group>/<filter> (and $queue/<filter>, the group $queue): each connection is a member of the "
        "cluster's share group, and each stored message (QoS 1/2, under a rule that stores it) goes to one "
        "member; with queue redelivery on, the --queue-* settings above govern it too (one the member does "
        "not PUBACK goes to a member again after the ack wait, at once when its connection closed)",
    )
    shared.add_argument(
        "--shared-poll-ms",
        type=_positive,
        default=500,
        metavar="MS",
        help="how often a member fetches when no publish this broker stored woke it: the latency of messages "
        "stored through other brokers and of redeliveries that came due (default 500)",
    )
    shared.add_argument(
        "--shared-lease-s",
        type=_lease,
        default=30,
        metavar="S",
        help="a member's lease in its group, renewed every half of it; the shards of a broker that stopped "
        "without leaving go to the other members this long after (1 to 3600; default 30)",
    )
    broker.add_argument("-v", "--verbose", action="store_true", help="log amqtt's and the plugin's activity (INFO)")
    broker.set_defaults(run=run_broker)
