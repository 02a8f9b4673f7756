"""What both sides of the wire agree on: errors, MQTT topic rules, sharding."""
