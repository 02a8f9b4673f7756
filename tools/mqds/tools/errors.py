"""The error of the local-process harness."""

from __future__ import annotations


class LocalClusterError(RuntimeError):
    """A local cluster cannot do what was asked (no recorded cluster, a port in use, ...); the message says why."""
