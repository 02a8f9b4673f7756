"""The peer in the same sitting: NATS JetStream's benchmark script, run beside ``mqds bench --small-writes``.

Used by ``mqds bench --small-writes --peer-anchors DIR``. The anchors
directory holds the peer's benchmark, ``jetstream_bench.py``, and the
``setup.sh`` that installs what it needs once per machine: a virtualenv with
nats-py at ``$ANCHORS/venv`` and a nats-server that knows
``sync_interval: always`` at ``$ANCHORS/bin/nats-server-<version>``
(``$ANCHORS`` defaults to ``anchors`` in the temporary directory, as in
``setup.sh``). The script starts three nats-servers on loopback, a file-backed
stream with three replicas, and measures with one Python client process:
``publish_sync`` (one message at a time, p50/p99) and ``publish_pipelined``
(up to ``--window`` PubAcks outstanding, msgs/s). It prints JSON lines; this
module runs it as a subprocess, reads those lines and gives the figures to
set beside mqds's: the medians (``kind: median``) of the sync mode measured,
and the CPU per 1,000 messages of its client and servers (from its
``kind: run`` lines, those of discarded runs left out).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PEER_SCRIPT = "jetstream_bench.py"
SETUP_SCRIPT = "setup.sh"
ANCHORS_ENV = "ANCHORS"
# The same sync promise as mqds's acknowledgement: fsync on a majority before the PubAck.
PEER_SYNC = "always"
PEER_TIMEOUT_S = 3600.0
PIPELINED = "publish_pipelined"
SYNC = "publish_sync"


class PeerMissing(Exception):
    """The peer is not installed where this command looked: the message says where, and how to install it."""


class PeerFailed(Exception):
    """The peer's script ran but gave no figures (it failed, or printed no medians)."""


def anchors_home(environ: Mapping[str, str] | None = None) -> Path:
    """Where ``setup.sh`` installs the peer: ``$ANCHORS``, else ``anchors`` in the temporary directory."""
    env = os.environ if environ is None else environ
    return Path(env.get(ANCHORS_ENV) or os.path.join(tempfile.gettempdir(), "anchors"))


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", path.name))


def default_nats_server(home: Path) -> str | None:
    """The newest ``nats-server-<version>`` under ``home/bin`` (what ``setup.sh`` puts there), else the one on PATH."""
    found = sorted((p for p in (home / "bin").glob("nats-server-*") if os.access(p, os.X_OK)), key=_version_key)
    if found:
        return str(found[-1])
    return shutil.which("nats-server")


@dataclass(frozen=True)
class PeerSetup:
    """Where the peer's script, its Python and its server are; ``extra`` is added to the script's arguments."""

    script: Path
    python: str
    nats_server: str
    home: Path
    extra: tuple[str, ...] = ()

    def command(self, window: int, size: int, workdir: Path) -> list[str]:
        """The script's command line: one fresh cluster, fsync before each PubAck, this run's window and size.

        Its store directories and its results file go under ``workdir``;
        ``extra`` comes last, so it can change any of these.
        """
        return [
            self.python,
            str(self.script),
            *("--runs", "1", "--sync", PEER_SYNC, "--window", str(window), "--size", str(size)),
            *("--nats-server", self.nats_server),
            *("--base-dir", str(workdir / "jetstream"), "--out", str(workdir / "jetstream.jsonl")),
            *self.extra,
        ]


def locate(
    anchors: str | os.PathLike[str],
    python: str | None = None,
    nats_server: str | None = None,
    extra_args: str = "",
    environ: Mapping[str, str] | None = None,
) -> PeerSetup:
    """The peer's setup from the anchors directory and the options; :class:`PeerMissing` says what is missing."""
    scripts = Path(anchors)
    home = anchors_home(environ)
    setup_hint = (
        f"install it once per machine with the anchors directory's {SETUP_SCRIPT} "
        f"(`bash {scripts / SETUP_SCRIPT}`, as root; it installs under ${ANCHORS_ENV}, now {home}), "
        "or point at an installed one with --peer-python and --peer-nats-server "
        "(docs/performance.md, 'Beside the peer')"
    )
    script = scripts / PEER_SCRIPT
    if not script.is_file():
        raise PeerMissing(
            f"the peer's benchmark is not there: no {PEER_SCRIPT} in {scripts} "
            "(--peer-anchors names the anchors directory that holds it)"
        )
    interpreter = python or str(home / "venv" / "bin" / "python")
    if not (os.path.isfile(interpreter) and os.access(interpreter, os.X_OK)):
        raise PeerMissing(f"the peer is not installed: no Python with nats-py at {interpreter}; {setup_hint}")
    server = nats_server or default_nats_server(home)
    if server is None or not (os.path.isfile(server) and os.access(server, os.X_OK)):
        where = server or f"{home / 'bin'}/nats-server-<version> or on PATH"
        raise PeerMissing(f"the peer is not installed: no nats-server at {where}; {setup_hint}")
    return PeerSetup(script, interpreter, server, home, tuple(shlex.split(extra_args)))


@dataclass
class PeerRun:
    """What one run of the peer's script measured (the medians of its runs, for the sync mode chosen)."""

    server_version: str
    sync: str
    pipelined_msgs_per_s: float
    sync_p50_ms: float
    sync_p99_ms: float | None = None
    # CPU of its client process and its three servers per 1,000 acknowledged messages, per phase (None unknown).
    pipelined_cpu_ms_per_1k: float | None = None
    sync_cpu_ms_per_1k: float | None = None
    runs: int = 1
    discarded: int = 0


def _cpu_ms_per_1k(records: list[dict[str, Any]]) -> float | None:
    """CPU ms per 1,000 messages over ``records`` of one phase: the cores its processes used x the seconds."""
    try:
        cpu_s = sum(float(r["cpu_cores_bench"]) * float(r["seconds"]) for r in records)
        messages = sum(int(r["n"]) for r in records)
    except (KeyError, TypeError, ValueError):
        return None
    return round(cpu_s * 1_000_000 / messages, 1) if records and messages else None


def parse_lines(lines: Iterable[str]) -> PeerRun:
    """The peer's figures from the script's output: JSON lines amid its human table (which is skipped).

    Figures come from its ``kind: median`` lines, of ``sync: always`` where
    it measured that mode, else of the one it measured; the CPU from its
    ``kind: run`` lines of the same mode, less those of runs it discarded
    (a ``kind: discarded`` line follows the lines of the run it names).
    """
    runs: list[dict[str, Any]] = []
    medians: list[dict[str, Any]] = []
    discarded = 0
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        kind = record.get("kind")
        if kind == "run":
            runs.append(record)
        elif kind == "median":
            medians.append(record)
        elif kind == "discarded":
            discarded += 1
            while runs and (runs[-1].get("run"), runs[-1].get("attempt")) == (
                record.get("run"),
                record.get("attempt"),
            ):
                runs.pop()
    modes = {m.get("sync") for m in medians}
    sync = PEER_SYNC if PEER_SYNC in modes else next((m.get("sync") for m in medians), None)
    chosen = {str(m.get("phase")): m for m in medians if m.get("sync") == sync}
    if PIPELINED not in chosen or SYNC not in chosen:
        raise PeerFailed(f"the peer printed no median of {PIPELINED} and {SYNC} (medians of: {sorted(chosen)})")
    pipelined, one = chosen[PIPELINED], chosen[SYNC]
    try:
        return PeerRun(
            server_version=str(pipelined.get("server_version", "?")),
            sync=str(sync),
            pipelined_msgs_per_s=float(pipelined["msgs_per_s"]),
            sync_p50_ms=float(one["p50_ms"]),
            sync_p99_ms=float(one["p99_ms"]) if one.get("p99_ms") is not None else None,
            pipelined_cpu_ms_per_1k=_cpu_ms_per_1k(
                [r for r in runs if r.get("sync") == sync and r.get("phase") == PIPELINED]
            ),
            sync_cpu_ms_per_1k=_cpu_ms_per_1k([r for r in runs if r.get("sync") == sync and r.get("phase") == SYNC]),
            runs=int(pipelined.get("runs", 1)),
            discarded=discarded,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise PeerFailed(f"the peer's medians lack a figure: {err!r}") from None


def run_peer(
    setup: PeerSetup,
    *,
    window: int,
    size: int,
    echo: Callable[[str], None] | None = None,
    timeout_s: float = PEER_TIMEOUT_S,
) -> PeerRun:
    """Run the peer's script once (a fresh 3-server cluster) and read its figures.

    Its standard error (progress: the cluster's start, waits for a quiet
    machine) goes to ``echo`` line by line as it comes. On a timeout the
    script is sent SIGTERM (it stops its servers then), and SIGKILL after 30 s.
    """
    env = dict(os.environ, **{ANCHORS_ENV: str(setup.home)})
    with tempfile.TemporaryDirectory(prefix="mqds-bench-peer-") as workdir:
        command = setup.command(window, size, Path(workdir))
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env
        )
        out_lines: list[str] = []
        err_tail: list[str] = []

        def read_output() -> None:
            assert proc.stdout is not None
            out_lines.extend(proc.stdout)

        def read_errors() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                err_tail.append(line.rstrip("\n"))
                del err_tail[:-20]
                if echo is not None:
                    echo(line.rstrip("\n"))

        # Each pipe has a reader of its own (communicate() would read standard error too, racing the echo).
        readers = [threading.Thread(target=read, daemon=True) for read in (read_output, read_errors)]
        for reader in readers:
            reader.start()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise PeerFailed(f"the peer's benchmark ran past {timeout_s:g} s and was stopped") from None
        except BaseException:
            _stop(proc)
            raise
        finally:
            for reader in readers:
                reader.join(timeout=10)
    if proc.returncode != 0:
        tail = " | ".join(line for line in err_tail[-5:] if line.strip())
        raise PeerFailed(f"the peer's benchmark exited with {proc.returncode}: {tail or '(nothing on stderr)'}")
    return parse_lines(out_lines)


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the script this module started (it stops its servers on it), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@dataclass
class PeerSummary:
    """The peer over every run of a sitting: the median of each figure across runs."""

    runs: list[PeerRun] = field(default_factory=list)
    error: str | None = None

    @staticmethod
    def _median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return round(statistics.median(known), 4) if known else None

    @property
    def pipelined_msgs_per_s(self) -> float | None:
        return self._median([r.pipelined_msgs_per_s for r in self.runs])

    @property
    def sync_p50_ms(self) -> float | None:
        return self._median([r.sync_p50_ms for r in self.runs])

    @property
    def pipelined_cpu_ms_per_1k(self) -> float | None:
        return self._median([r.pipelined_cpu_ms_per_1k for r in self.runs])

    @property
    def sync_cpu_ms_per_1k(self) -> float | None:
        return self._median([r.sync_cpu_ms_per_1k for r in self.runs])

    def describe(self) -> str:
        if not self.runs:
            return "the peer (NATS JetStream): not measured"
        first = self.runs[0]
        return (
            f"NATS JetStream {first.server_version}, 3 servers, 3 replicas, file storage, "
            f"sync_interval: {first.sync}; median of {len(self.runs)} run(s) of its script"
        )


def ratio(mine: float | None, theirs: float | None) -> float | None:
    """``mine / theirs`` to three places; None when either is unknown or ``theirs`` is 0."""
    if mine is None or not theirs:
        return None
    return round(mine / theirs, 3)
