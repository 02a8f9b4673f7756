"""The error a node raises when it cannot start (every part of the node raises this one)."""

from __future__ import annotations


class StartupError(RuntimeError):
    """The node cannot start; the message says why and what to do."""
