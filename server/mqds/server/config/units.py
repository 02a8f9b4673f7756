"""Values of the node's settings as people write them: sizes and durations with units, booleans, numbers.

A setting whose name ends in ``_bytes`` is a size, one ending in ``_s`` a
duration; both still accept a plain number (bytes, seconds). Each parser
raises ValueError; the loader turns that into a message naming the setting
and what it accepts.

>>> parse_size("16MiB"), parse_size("16 MiB"), parse_size("1GB"), parse_size(1024), parse_size("64_000")
(16777216, 16777216, 1000000000, 1024, 64000)
>>> parse_duration("250ms"), parse_duration("30s"), parse_duration("5m"), parse_duration("1h"), parse_duration("0.2")
(0.25, 30.0, 300.0, 3600.0, 0.2)
>>> format_size(16 * 1024 * 1024), format_duration(3600.0), format_duration(0.2)
('16MiB', '1h', '200ms')
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
DURATION_UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}

SIZE_HELP = "a size: a whole number of bytes, or a number with a unit B, KB, MB, GB, KiB, MiB, GiB (e.g. 16MiB)"
DURATION_HELP = "a duration: a number of seconds, or a number with a unit ms, s, m, h, d (e.g. 250ms, 30s, 5m)"

_QUANTITY = re.compile(r"^\s*([-+]?(?:\d[\d_]*)?(?:\.\d+)?(?:[eE][-+]?\d+)?)\s*([A-Za-z]*)\s*$")


def kind_of(name: str, default: Any) -> str:
    """``size``, ``duration``, ``bool``, ``int``, ``float`` or ``str``: how a setting's values are read."""
    if name.endswith("_bytes") and type(default) is int:
        return "size"
    if name.endswith("_s") and type(default) is float:
        return "duration"
    return type(default).__name__


def describe(kind: str) -> str:
    """What a setting of this kind accepts, for error messages."""
    return {
        "size": SIZE_HELP,
        "duration": DURATION_HELP,
        "bool": "bool (true or false, yes or no, on or off, 1 or 0)",
        "int": "int (a whole number)",
        "float": "float (a number)",
        "str": "str (text)",
    }[kind]


def _quantity(raw: str, units: dict[str, Any]) -> tuple[Decimal, Any]:
    match = _QUANTITY.match(raw)
    if not match or not match.group(1).strip("+-") or match.group(2).lower() not in units:
        raise ValueError(raw)
    try:
        number = Decimal(match.group(1).replace("_", ""))
    except InvalidOperation:
        raise ValueError(raw) from None
    return number, units[match.group(2).lower()]


def parse_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if not isinstance(raw, str):
        raise ValueError(f"not a boolean: {raw!r}")
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {raw!r}")


def parse_int(raw: Any) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, str):
        return int(raw.replace("_", ""))
    raise ValueError(f"not an int: {raw!r}")


def parse_float(raw: Any) -> float:
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw)
    if isinstance(raw, str):
        return float(raw)
    raise ValueError(f"not a float: {raw!r}")


def parse_str(raw: Any) -> str:
    if isinstance(raw, str):
        return raw
    raise ValueError(f"not a string: {raw!r}")


def parse_size(raw: Any) -> int:
    """Bytes: an int, or a string such as ``"16777216"``, ``"16MiB"``, ``"16 MiB"``, ``"1.5GB"``."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if not isinstance(raw, str):
        raise ValueError(f"not a size: {raw!r}")
    try:
        return int(raw.replace("_", ""))
    except ValueError:
        pass
    number, factor = _quantity(raw, SIZE_UNITS)
    value = number * factor
    if value != value.to_integral_value():
        raise ValueError(f"not a whole number of bytes: {raw!r}")
    return int(value)


def parse_duration(raw: Any) -> float:
    """Seconds: a number, or a string such as ``"0.2"``, ``"250ms"``, ``"30s"``, ``"5m"``, ``"1h"``."""
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw)
    if not isinstance(raw, str):
        raise ValueError(f"not a duration: {raw!r}")
    try:
        return float(raw)
    except ValueError:
        pass
    number, factor = _quantity(raw, DURATION_UNITS)
    return float(number) * factor


PARSERS = {
    "size": parse_size,
    "duration": parse_duration,
    "bool": parse_bool,
    "int": parse_int,
    "float": parse_float,
    "str": parse_str,
}


def format_size(value: int) -> str:
    """The largest binary unit that divides the size exactly: ``16MiB``, ``1000`` (bytes)."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        factor = SIZE_UNITS[unit.lower()]
        if value and value % factor == 0:
            return f"{value // factor}{unit}"
    return str(value)


def format_duration(value: float) -> str:
    """The largest unit that gives a whole number: ``1h``, ``10s``, ``200ms``, else seconds."""
    for unit in ("d", "h", "m", "s", "ms"):
        count = value / DURATION_UNITS[unit]
        if value and abs(count - round(count)) < 1e-9:
            return f"{round(count)}{unit}"
    return f"{value:g}s"
