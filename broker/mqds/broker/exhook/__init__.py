"""EMQX ExHook provider: serves ``emqx.exhook.v3.HookProvider`` with :class:`~mqds.broker.actions.BrokerHooks`.

``mqds exhook`` runs it; :mod:`mqds.broker.exhook.provider` has the
servicer, the server and what ExHook can and cannot do;
:mod:`mqds.broker.exhook.listener` how callers are authenticated (mutual TLS)
and :mod:`mqds.broker.exhook.methods` which methods are served. The generated
protobuf modules are in :mod:`mqds.broker.exhook.v3`.
"""

from mqds.broker.exhook.listener import ProviderTLS
from mqds.broker.exhook.provider import SERVICE, ExhookServer, HookProvider, to_message

__all__ = ["SERVICE", "ExhookServer", "HookProvider", "ProviderTLS", "to_message"]
