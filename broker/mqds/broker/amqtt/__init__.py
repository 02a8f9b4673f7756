"""mqds inside the amqtt MQTT broker (3.1.1): the plugin and its parts, one concept per module.

:mod:`~mqds.broker.amqtt.plugin` has :class:`MqdsPlugin` (configured as
``mqds.broker.amqtt_plugin.MqdsPlugin``, the path that stays stable), its
options and its amqtt event handlers; :mod:`~mqds.broker.amqtt.writer` stores
publishes in per-shard waves; :mod:`~mqds.broker.amqtt.delivery` sends one
client its stored messages in order and acknowledges them;
:mod:`~mqds.broker.amqtt.internals` wraps amqtt's private broker methods;
:mod:`~mqds.broker.amqtt.puback` sends publishers' PUBACK/PUBREC once stored;
:mod:`~mqds.broker.amqtt.protocol` refuses CONNECTs that are not MQTT 3.1.1.
``DESIGN.md`` next to this package explains the seams and the design.

Importing this package imports nothing; its modules need amqtt
(``pip install mqds-broker``).
"""
