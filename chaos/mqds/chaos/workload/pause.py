"""Pausing the workload's writers: a :class:`PauseGate` per worker, :class:`WorkloadPause` over all of them.

Publishers and consumers pass a :class:`PauseGate` before each unit of work
(a batch with its retries; a fetch with its acknowledgements), and so do the
hostile clients (one request). :class:`WorkloadPause` closes the gates of all
of them and waits (bounded) until the units in flight are done, so the
cluster gets no writes at all for an idle spell (the ``idle-restart``
nemeses); a call still in flight when the bound runs out goes on as any call
does (a kill makes its outcome unknown, and it is retried). Readers are not
paused: reads write nothing.
"""

from __future__ import annotations

import threading
import time

from mqds.chaos.history import History


class PauseGate:
    """Where a worker thread may be held between two units of work.

    The worker calls :meth:`enter` before a unit (it blocks while the gate is
    closed, and returns False once ``stop`` is set) and :meth:`leave` after it.
    :meth:`close` makes the next ``enter`` block; :meth:`wait_quiet` waits
    until no unit is in flight; :meth:`open` lets the worker go on.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False

    def enter(self, stop: threading.Event) -> bool:
        with self._cond:
            while self._closed and not stop.is_set():
                self._cond.wait(0.2)
            if stop.is_set():
                return False
            self._busy = True
            return True

    def leave(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True

    def open(self) -> None:
        with self._cond:
            self._closed = False
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def wait_quiet(self, timeout_s: float) -> bool:
        """Until no unit of work is in flight (True), or ``timeout_s`` passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._busy, timeout_s)


class WorkloadPause:
    """Pause and resume the writers of a run (publishers, consumers, hostile clients): each has a PauseGate."""

    def __init__(self, history: History) -> None:
        self.history = history
        self.gates: dict[str, PauseGate] = {}
        self.paused_at: float | None = None

    def add(self, name: str, gate: PauseGate) -> None:
        self.gates[name] = gate

    @property
    def paused(self) -> bool:
        return self.paused_at is not None

    def pause(self, timeout_s: float) -> list[str]:
        """Close every gate, then wait until the units in flight are done; the names of those still busy."""
        self.paused_at = self.history.clock()
        for gate in self.gates.values():
            gate.close()
        deadline = time.monotonic() + timeout_s
        return [name for name, gate in self.gates.items() if not gate.wait_quiet(max(0.0, deadline - time.monotonic()))]

    def resume(self) -> float | None:
        """Open every gate; when the pause began (None if it was not paused)."""
        began, self.paused_at = self.paused_at, None
        for gate in self.gates.values():
            gate.open()
        return began
