"""amqtt speaks MQTT 3.1.1 only: a CONNECT of any other protocol level is refused with CONNACK 0x01.

amqtt 0.12 parses a CONNECT's payload before it looks at the protocol level.
An MQTT 5 CONNECT carries properties between its variable header and its
payload, which amqtt reads as the client id's length: with properties (an MQTT 5
client resuming a session sends a Session Expiry Interval) that length runs past
the packet, amqtt waits for bytes that never come, and the client waits for a
CONNACK that never comes. MQTT 3.1.1 prescribes the answer (§3.2.2.3): CONNACK
with return code 0x01, unacceptable protocol version, then close. So the payload
of a CONNECT that is not level 4 is not read at all, and amqtt's own check of
the level sends that CONNACK. For MQTT 5 clients, use EMQX with ``mqds exhook``.
"""

from __future__ import annotations

from typing import Any

from amqtt.mqtt.connect import ConnectPayload, ConnectVariableHeader

MQTT_3_1_1 = 4
"""The protocol level amqtt speaks."""

_original = ConnectPayload.from_stream.__func__  # type: ignore[attr-defined]


async def _payload_from_stream(
    cls: type[ConnectPayload], reader: Any, fixed_header: Any, variable_header: ConnectVariableHeader | None
) -> ConnectPayload:
    if variable_header is not None and variable_header.proto_level != MQTT_3_1_1:
        payload = cls()
        payload.client_id = ""  # never used: the CONNECT is refused for its protocol level
        return payload
    return await _original(cls, reader, fixed_header, variable_header)


def install() -> None:
    """Make amqtt refuse CONNECTs of other protocol levels without reading their payload (idempotent)."""
    ConnectPayload.from_stream = classmethod(_payload_from_stream)  # type: ignore[method-assign,assignment]
