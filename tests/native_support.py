"""What the tests of the C extensions share: importing one, skipping without a compiler, which version is chosen."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest


def native(name: str) -> Any:
    """The C extension ``name``, or None where the package installed without it."""
    try:
        module: ModuleType = importlib.import_module(name)
    except ImportError:  # pragma: no cover - only without a compiler
        return None
    return module


def skip_without_compiler(module: ModuleType | None, python_does: str) -> pytest.MarkDecorator:
    """Skip where the module is missing and no compiler could have built it; fail where one could have."""
    return pytest.mark.skipif(
        module is None and shutil.which("cc") is None and shutil.which("gcc") is None,
        reason=f"no C compiler here: the package installed without its C part, and nodes {python_does} in Python",
    )


def printed_with_and_without_pure_python(code: str) -> dict[bool, list[str]]:
    """The words ``code`` prints in a fresh interpreter with ``MQDS_PURE_PYTHON`` set (True) and without (False)."""
    return {
        flag: subprocess.run(
            [sys.executable, "-c", code],
            env={"MQDS_PURE_PYTHON": "1"} if flag else {},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()
        for flag in (True, False)
    }
