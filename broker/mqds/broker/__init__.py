"""Broker persistence: what an MQTT broker keeps in mqds, driven by hook rules.

:mod:`mqds.broker.hooks` loads and checks the rules (which broker hook runs
which action on which topics; TOML or YAML files, see ``deploy/hooks/``);
:mod:`mqds.broker.actions` has :class:`BrokerHooks`, the asyncio dispatcher
every broker integration calls; :mod:`mqds.broker.exhook` serves EMQX's
ExHook gRPC interface with it (``mqds exhook``).

Importing this package needs only the mqds client; YAML files need PyYAML
(``pip install mqds-broker``).
"""

from mqds.broker.actions import BrokerHooks, Delivery
from mqds.broker.catalogue import ACTIONS, HOOKS
from mqds.broker.hooks import HookConfig, HookConfigError, OfflineOpts, Rule, load_config, parse_config

__all__ = [
    "ACTIONS",
    "HOOKS",
    "BrokerHooks",
    "Delivery",
    "HookConfig",
    "HookConfigError",
    "OfflineOpts",
    "Rule",
    "load_config",
    "parse_config",
]
