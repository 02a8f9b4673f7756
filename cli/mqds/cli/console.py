"""What every ``mqds`` command shares: exit codes, the error it raises for the user, times, tables, progress."""

from __future__ import annotations

import datetime
import io
import re
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from mqds.client.connection import ConnectionSettings

# Exit codes of every command.
EXIT_OK = 0
EXIT_FAILED = 1  # the command could not do its job: cluster unreachable, an operation refused
EXIT_USAGE = 2  # the command line is wrong (also what argparse exits with)
EXIT_DEGRADED = 3  # `mqds status`: the cluster answers, but a node is down or a vnode has no leader
EXIT_INTERRUPTED = 130  # Ctrl-C


class CommandError(Exception):
    """A failure the user should read, without a traceback; ``exit_code`` is what the command exits with."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# -- times ---------------------------------------------------------------------

_AGE_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_AGE_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
TIME_HELP = (
    "ISO-8601 (2025-05-01T12:00:00Z, 2025-05-01 12:00 in local time, 2025-05-01) "
    "or an age: 90s, 10m, 2h, 1d, 1h30m (units ms s m h d w); 'now' is now"
)


def parse_time(text: str, now_s: float | None = None) -> int:
    """A point in time given on the command line, as microseconds since the epoch.

    Accepts ISO-8601 (a time without a zone is local time) and ages such as
    ``10m`` or ``1h30m`` (that long before ``now_s``). Raises ValueError
    with a message that says what is accepted.
    """
    now = time.time() if now_s is None else now_s
    value = text.strip()
    if value.lower() == "now":
        return int(now * 1_000_000)
    compact = value.replace(" ", "").lower()
    if compact and _AGE_PART.sub("", compact) == "" and _AGE_PART.match(compact):
        age_s = sum(float(n) * _AGE_UNIT_S[unit] for n, unit in _AGE_PART.findall(compact))
        return int((now - age_s) * 1_000_000)
    try:
        when = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{text!r} is not a time: use {TIME_HELP}") from None
    if when.tzinfo is None:
        when = when.astimezone()  # local time, as a person typing it means
    return int(when.timestamp() * 1_000_000)


def format_time_us(timestamp_us: int, precision: str = "microseconds") -> str:
    """UTC ISO-8601 with a Z, e.g. ``2025-05-01T12:00:00.123456Z`` (parse_time reads it back)."""
    when = datetime.datetime.fromtimestamp(timestamp_us / 1e6, datetime.UTC)
    return when.isoformat(timespec=precision).replace("+00:00", "Z")


# -- output --------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[int] = ()) -> str:
    """Rows under headers in aligned columns, two spaces apart; ``right`` lists the columns aligned right (numbers).

    Laid out by rich (no borders, no colour, no wrapping: a long cell widens its column), so a
    value with brackets is shown as it is, never read as markup.
    """
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    grid = Table(box=None, pad_edge=False, padding=(0, 1), show_edge=False, header_style="")
    for i, header in enumerate(headers):
        grid.add_column(Text(str(header)), justify="right" if i in right else "left", no_wrap=True)
    for row in rows:
        grid.add_row(*(Text(str(cell)) for cell in row))
    out = io.StringIO()
    Console(file=out, width=100_000, color_system=None, highlight=False, emoji=False).print(grid)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


def bar(fraction: float, width: int = 24) -> str:
    """``[#########...............]`` for a fraction between 0 and 1."""
    filled = int(width * min(max(fraction, 0.0), 1.0))
    return "[" + "#" * filled + "." * (width - filled) + "]"


class ProgressLine:
    """One status line: on a terminal, redrawn in place by rich; on a pipe or file, printed every ``every_s`` seconds.

    A pipe gets whole lines at a steady pace (what a CI log or ``tee`` needs), where a live
    display would print nothing until it stops.
    """

    def __init__(self, stream: TextIO | None = None, every_s: float = 5.0) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = every_s
        self._last_print: float | None = None  # the first line prints at once, however long the machine has been up
        self._live: Any = None

    def show(self, text: str, final: bool = False) -> None:
        if self.tty:
            from rich.console import Console
            from rich.live import Live
            from rich.text import Text

            if self._live is None:
                console = Console(file=self.stream, highlight=False, emoji=False)
                self._live = Live(console=console, auto_refresh=False, redirect_stdout=False, redirect_stderr=False)
                self._live.start()
            self._live.update(Text(text), refresh=True)
            if final:
                self.close()
            return
        now = time.monotonic()
        if final or self._last_print is None or now - self._last_print >= self.every_s:
            self.stream.write(text + "\n")
            self.stream.flush()
            self._last_print = now

    def close(self) -> None:
        """End the line (after an interruption too), so what follows starts on its own."""
        if self._live is not None:
            self._live.stop()
            self._live = None


def connection(opts: Any, default_timeout_s: float) -> ConnectionSettings:
    """The connection settings the global options (--timeout, --tls*, --token) describe."""
    try:
        return ConnectionSettings(
            timeout_s=opts.timeout or default_timeout_s,
            tls=opts.tls,
            tls_ca=opts.tls_ca,
            tls_client_cert=opts.tls_cert,
            tls_client_key=opts.tls_key,
            tls_server_name=opts.tls_server_name,
            auth_token=opts.token,
        )
    except ValueError as err:
        raise CommandError(str(err), EXIT_USAGE) from None
