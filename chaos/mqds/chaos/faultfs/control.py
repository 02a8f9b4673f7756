"""The fault filesystem's control socket: the commands a chaos run sends to a mounted filesystem, and their client.

The filesystem process (:mod:`~mqds.chaos.faultfs.daemon`) listens on a Unix socket; a request is one line of
JSON, ``{"command": NAME, ...arguments}``, and so is the answer,
``{"ok": true, "result": {...}}`` or ``{"ok": false, "error": "..."}``.
:class:`ControlClient` is the caller's side, one connection per command.

| command | arguments | does |
|---|---|---|
| ``ping`` | | answers with the filesystem's pid |
| ``status`` | | space used, files and directories with unsynced changes, faults in force, counts |
| ``power_loss`` | ``torn`` (bool), ``torn_pattern``, ``seed`` | all not synced is lost (kill the mount's users first) |
| ``disk_full`` | ``limit_bytes`` or ``free_bytes`` | ENOSPC for writes that grow past the limit, creates at it |
| ``fail`` | ``pattern``, ``ops`` (read, write, fsync), ``errno`` (EIO) | those operations on matching paths fail |
| ``slow`` | ``sync_delay_s`` | every fsync, fdatasync and directory fsync first waits that long |
| ``heal`` | ``space``, ``errors``, ``slow`` (bools, all by default) | lifts those faults |
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)


class FaultFsError(RuntimeError):
    """The fault filesystem could not be mounted, reached, or refused a command."""


class ControlServer:
    """Answers commands on a Unix socket with ``handler``, a thread per connection (in the filesystem's process)."""

    def __init__(self, path: str, handler: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.path = path
        self.handler = handler
        if os.path.exists(path):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.listen(8)
        self._thread = threading.Thread(target=self._accept, name="faultfs-control", daemon=True)

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="faultfs-command", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rwb") as stream:
            for line in stream:
                try:
                    request = json.loads(line)
                    if not isinstance(request, dict):
                        raise ValueError("a request is a JSON object")
                    answer: dict[str, Any] = {"ok": True, "result": self.handler(request)}
                except Exception as err:
                    log.exception("faultfs: command failed: %s", line[:200])
                    answer = {"ok": False, "error": f"{type(err).__name__}: {err}"}
                stream.write(json.dumps(answer).encode() + b"\n")
                stream.flush()


class ControlClient:
    """Sends commands to a mounted fault filesystem."""

    def __init__(self, path: str, timeout_s: float = 120.0) -> None:
        self.path = path
        self.timeout_s = timeout_s

    def call(self, command: str, **arguments: Any) -> dict[str, Any]:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout_s)
                sock.connect(self.path)
                sock.sendall(json.dumps({"command": command, **arguments}).encode() + b"\n")
                with sock.makefile("rb") as stream:
                    line = stream.readline()
        except OSError as err:
            raise FaultFsError(f"fault filesystem control {self.path}: {command}: {err}") from err
        if not line:
            raise FaultFsError(f"fault filesystem control {self.path}: {command}: no answer")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise FaultFsError(f"fault filesystem: {command}: {answer.get('error')}")
        result: dict[str, Any] = answer["result"]
        return result

    def ping(self) -> int:
        return int(self.call("ping")["pid"])

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def power_loss(self, *, torn: bool = False, torn_pattern: str = "*", seed: int = 0) -> dict[str, Any]:
        """Lose everything not synced; kill every process that uses the mount first."""
        return self.call("power_loss", torn=torn, torn_pattern=torn_pattern, seed=seed)

    def disk_full(self, *, limit_bytes: int | None = None, free_bytes: int | None = None) -> dict[str, Any]:
        """ENOSPC past ``limit_bytes`` in all, or past ``free_bytes`` more than the filesystem holds now."""
        return self.call("disk_full", limit_bytes=limit_bytes, free_bytes=free_bytes)

    def fail(self, pattern: str, ops: Iterable[str] = ("read", "write", "fsync"), errno: str = "EIO") -> dict[str, Any]:
        """Fail ``ops`` on the files whose path inside the mount matches ``pattern``."""
        return self.call("fail", pattern=pattern, ops=sorted(ops), errno=errno)

    def slow(self, sync_delay_s: float) -> dict[str, Any]:
        return self.call("slow", sync_delay_s=sync_delay_s)

    def heal(self, *, space: bool = True, errors: bool = True, slow: bool = True) -> dict[str, Any]:
        """Lift the faults: a full disk, the error rules, slow syncs (all by default)."""
        return self.call("heal", space=space, errors=errors, slow=slow)
