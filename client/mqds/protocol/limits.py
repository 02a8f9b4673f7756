"""Bounds of the API that clients and nodes both need to know.

A node refuses a request over them with INVALID_REQUEST (gRPC
INVALID_ARGUMENT) saying which bound it broke; the client splits larger
work into calls within them, so a caller never meets them.
"""

from __future__ import annotations

MAX_SESSIONS_PER_CALL = 1_000
"""The (clientid, topic filter) pairs of one ``Sessions.GetReadPositions`` or ``StartReadPositions`` call, and the
sessions of one ``Sessions.FetchMessagesShared`` call, at most."""

SESSION_NEVER_EXPIRES = 0xFFFFFFFF
"""The largest Session Expiry Interval (MQTT 5's four-byte 4294967295 seconds): the session never expires.
Also the bound of every expiry interval in seconds (sessions, messages): 0 to this."""
