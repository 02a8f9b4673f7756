"""One local ``mqds-server`` process: start, wait until ready, kill -9, SIGTERM, pause, resume, adopt by pid.

Every wait is bounded; a process that dies during start-up raises with the
end of its log. A process another program started (``mqds cluster up``) is
adopted by pid; a recorded pid counts only while its process still runs
``mqds-server`` on that data directory, so a recycled pid is never signalled.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mqds.client import ConnectionSettings
from mqds.tools.ports import free_port
from mqds.tools.waiting import READY_SERVICE, wait_serving


def _server_executable() -> str:
    """``mqds-server`` beside this Python (a virtualenv's bin/), else the one on PATH."""
    sibling = Path(sys.executable).with_name("mqds-server")
    if sibling.exists():
        return str(sibling)
    return shutil.which("mqds-server") or str(sibling)


SERVER = _server_executable()


PAUSE_WAIT_S = 10.0
"""How long ``pause`` waits for every thread of a node to stop."""


def thread_states(pid: int) -> list[str]:
    """The state letter of every thread of ``pid`` (``/proc/PID/task/*/stat``); none once it is gone."""
    states = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as stat:
                # "tid (comm) S ...": the command may hold spaces and parentheses; the state follows the last ")".
                states.append(stat.read().rsplit(b")", 1)[1].split()[0].decode())
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return states


STOPPED_STATES = frozenset("TtDZX")
"""Thread states that run no more user code once SIGSTOP is pending: stopped, or in the kernel
(uninterruptible, such as a write to a slow or faulty disk: it stops on its way out), or gone."""


def wait_stopped(pid: int, timeout_s: float) -> None:
    """Wait until no thread of ``pid`` can run user code (``STOPPED_STATES``) or it is gone; raise after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = thread_states(pid)
        if all(state in STOPPED_STATES for state in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} not stopped {timeout_s:.0f} s after SIGSTOP: thread states {states}")
        time.sleep(0.001)


def _process_alive(pid: int, marker: str) -> bool:
    """Whether ``pid`` runs and has ``marker`` as one of its arguments (a recycled pid does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: the pid was recycled
        return False
    proc = Path("/proc") / str(pid)
    if not proc.is_dir():
        return True  # no /proc (macOS): the signal check is all there is
    try:
        argv = (proc / "cmdline").read_bytes().split(b"\0")
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        # A killed process's main thread is a zombie while its other threads
        # still exit, and its sockets close only after the last one.
        threads = len(os.listdir(proc / "task"))
    except (OSError, IndexError):
        return False
    if state in ("Z", "X"):
        return threads > 1
    return marker.encode() in argv


class NodeProcess:
    """One mqds-server process with a fixed node id, port and data directory."""

    def __init__(
        self,
        data_dir: Path,
        *,
        node_id: str = "n1",
        port: int | None = None,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        detach: bool = False,
        connection: ConnectionSettings | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.node_id = node_id
        self.port = port or free_port()
        # The node's Prometheus endpoint on 127.0.0.1 (metrics_listen), if any.
        self.metrics_port = metrics_port
        self.args = list(args)
        self.env = dict(env or {})
        # Detached: in a session of its own, so it outlives this program and
        # a Ctrl-C in the terminal does not reach it.
        self.detach = detach
        # How to reach the node (TLS), for the readiness checks.
        self.connection = connection
        self.proc: subprocess.Popen[bytes] | None = None
        # Set by launch, or by adopt for a process another program started.
        self.pid: int | None = None
        self._terminating = False
        self.log_path = data_dir.parent / f"{node_id}-{self.port}.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        """Where the node serves its Prometheus metrics, when started with a metrics port."""
        return None if self.metrics_port is None else f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        metrics = ["--metrics-listen", f"127.0.0.1:{self.metrics_port}"] if self.metrics_port is not None else []
        return [
            SERVER,
            "--node-id",
            self.node_id,
            "--listen",
            self.address,
            "--data-dir",
            str(self.data_dir),
            *metrics,
            *self.args,
        ]

    def launch(self) -> NodeProcess:
        """Start the process without waiting for it."""
        assert not self.running, "already running"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=self.detach,
            )
        self.pid = self.proc.pid
        self._terminating = False
        return self

    def adopt(self, pid: int) -> None:
        """Take charge of a process another program started (``mqds cluster up``); it is signalled by pid."""
        self.proc = None
        self.pid = pid
        self._terminating = False

    def wait(self, timeout_s: float = 30, service: str = READY_SERVICE) -> NodeProcess:
        """Until the node reports ``service`` SERVING (by default: ready to serve)."""
        assert self.pid is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running:
                code = f" with {self.proc.returncode}" if self.proc is not None else ""
                raise RuntimeError(f"mqds-server {self.node_id} exited{code}:\n{self.output()}")
            if wait_serving(self.address, 0.5, service, self.connection):
                return self
        self.kill()
        raise TimeoutError(f"mqds-server {self.node_id} not serving after {timeout_s}s:\n{self.output()}")

    def start(self, timeout_s: float = 30, service: str = READY_SERVICE) -> NodeProcess:
        """Start the process and wait until it is ready (``service=""``: only until it runs)."""
        return self.launch().wait(timeout_s, service)

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """kill -9: no shutdown code runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        elif self.proc is None and self.pid is not None and self.running:
            os.kill(self.pid, signal.SIGKILL)
            if not self._gone_within(10):
                raise TimeoutError(f"mqds-server {self.node_id} (pid {self.pid}) still runs after SIGKILL")

    def _gone_within(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.running:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def terminate(self) -> None:
        """SIGTERM without waiting: the node stops accepting calls, finishes in-flight ones and exits."""
        if self.running and not self._terminating:
            assert self.pid is not None
            os.kill(self.pid, signal.SIGTERM)
            # Once: a second SIGTERM would interrupt the node's shutdown with another.
            self._terminating = True

    def stop(self, timeout_s: float = 20) -> int:
        """SIGTERM and wait; returns the exit code (0 for an adopted process, whose code is not known here)."""
        if self.proc is None:
            if self.pid is not None and self.running:
                self.terminate()
                if not self._gone_within(timeout_s):
                    self.kill()
                    raise subprocess.TimeoutExpired(self.command(), timeout_s)
            return 0
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
                raise
        return int(self.proc.returncode)

    def restart(self, timeout_s: float = 30) -> NodeProcess:
        self.kill()
        return self.start(timeout_s)

    @property
    def running(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self.pid is not None and _process_alive(self.pid, str(self.data_dir))

    def pause(self) -> None:
        """SIGSTOP: the process stays, but does nothing (a long GC pause, a frozen VM).

        Returns once no thread of it can run its code (``wait_stopped``): the
        kernel stops a process's threads one by one as each next runs, so on a
        busy machine a thread that was already awake went on serving calls for
        a while after ``kill`` returned (a test's "the node does not answer"
        call was answered).
        """
        if self.running:
            assert self.pid is not None
            os.kill(self.pid, signal.SIGSTOP)
            wait_stopped(self.pid, PAUSE_WAIT_S)

    def resume(self) -> None:
        if self.running:
            assert self.pid is not None
            os.kill(self.pid, signal.SIGCONT)
