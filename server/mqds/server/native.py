"""Choosing between a C part and its Python twin, once, when a module is imported.

The node's C extensions (``_wire_native``, ``storage/_store_native``) are
optional: ``setup.py`` builds them where a compiler is present. Each has a
Python twin making the same output, which runs where the extension was not
built or where ``MQDS_PURE_PYTHON`` is set (to compare, or to rule the C
parts out).
"""

from __future__ import annotations

import importlib
import os
from typing import TypeVar

PURE_PYTHON_ENV = "MQDS_PURE_PYTHON"

F = TypeVar("F")


def native_or(module: str, name: str, python: F) -> F:
    """``module.name`` where that C extension was built and ``MQDS_PURE_PYTHON`` is not set, else ``python``."""
    if os.environ.get(PURE_PYTHON_ENV):
        return python
    try:
        chosen: F = getattr(importlib.import_module(module), name)
    except ImportError:
        return python
    return chosen
