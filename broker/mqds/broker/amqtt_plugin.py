"""The amqtt plugin under its configuration path, ``mqds.broker.amqtt_plugin.MqdsPlugin``.

amqtt configuration files, deploy manifests and ``mqds broker`` name the
plugin by this path; the plugin itself is :mod:`mqds.broker.amqtt.plugin`
(importing it makes amqtt refuse CONNECTs that are not MQTT 3.1.1).
"""

from mqds.broker.amqtt.plugin import DEFAULT_RULES, MqdsPlugin, settings_from

__all__ = ["DEFAULT_RULES", "MqdsPlugin", "settings_from"]
