"""The errors a client call raises: every one a :class:`MqdsError` with a ``reason``.

``err.retriable`` says whether trying again may succeed; ``err.reason`` names
exactly what failed (see :data:`REASONS` for the full table). The classes and
the table are defined once, in :mod:`mqds.protocol.errors`, and shared with the
server.
"""

from mqds.protocol.errors import (
    REASONS,
    AuthenticationError,
    DeadlineExceededError,
    FailedPreconditionError,
    GenerationDroppedError,
    InternalError,
    InvalidArgumentError,
    MqdsError,
    NotFoundError,
    NotLeaderError,
    PartialBatchError,
    PermissionDeniedError,
    Reason,
    UnavailableError,
)

__all__ = [
    "REASONS",
    "AuthenticationError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "GenerationDroppedError",
    "InternalError",
    "InvalidArgumentError",
    "MqdsError",
    "NotFoundError",
    "NotLeaderError",
    "PartialBatchError",
    "PermissionDeniedError",
    "Reason",
    "UnavailableError",
]
