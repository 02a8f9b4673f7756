"""What ``store_async`` returns: the call itself, a future that costs one object.

A ``concurrent.futures.Future`` makes a ``threading.Condition`` (a lock,
a deque, bound methods) and two lists when it is built, fifteen memory
blocks in all, and a pipelined call needed one beside its own state. Here
the call's state (:class:`~mqds.client.core.pipeline_calls.CallState`) and its
future are one object:

- :class:`StoreFuture` (the synchronous client) is a
  ``concurrent.futures.Future`` that makes nothing until someone waits: a
  caller blocking in ``result()`` before the call settled gets a lock of its
  own then; callbacks are kept only when given; ``concurrent.futures.wait``
  and ``as_completed`` work through the same hooks a ``Future`` has
  (``_condition``, ``_state``, ``_waiters``), backed by one lock shared by
  every handle. The messages it returns (``timestamp_us`` and ``shard``
  set) are built when ``result()`` is called.
- :class:`mqds.client.aio.handles.AsyncStoreFuture` (the asyncio client)
  is an ``asyncio.Future`` with the call's state in its slots.

The pipeline settles a call under its own lock; the transport then
publishes it (:func:`publish`) outside that lock, in the order the calls
settled, so a shard's futures complete in call order and callbacks may
call the client again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from typing import Any

from mqds.client.core.pipeline_calls import CALL_SLOTS, CallState
from mqds.client.model import Message
from mqds.protocol.errors import MqdsError

__all__ = ["StoreFuture", "publish", "stored"]

log = logging.getLogger(__name__)

# Guards every StoreFuture's waiters and callbacks (held for a few attribute writes at a time). Re-entrant:
# concurrent.futures.wait takes each future's _condition in turn, and here they are all this one.
_SHARED = threading.RLock()

_PENDING, _FINISHED, _CANCELLED = 0, 1, 2
_STATE_NAMES = {_PENDING: "PENDING", _FINISHED: "FINISHED", _CANCELLED: "CANCELLED_AND_NOTIFIED"}


class StoreFuture(CallState, futures.Future[list[Message]]):
    """A pipelined call of the synchronous client, and its ``concurrent.futures.Future``.

    ``result()`` returns the stored messages (``timestamp_us`` and ``shard``
    set) or raises the call's error, as the documented future did.
    ``cancel()`` gives up waiting (the future is cancelled) but not the
    write: its messages may already be on their way, and are stored.
    """

    __slots__ = (*CALL_SLOTS, "_callbacks", "_done_state", "_fwaiters", "_waiter")

    def __init__(  # no Future.__init__: its condition and lists are what this class saves
        self,
        messages: Message | Sequence[Message],
        n_shards: int,
        deadline: float,
    ) -> None:
        self.setup(messages, n_shards, deadline)
        self._done_state = _PENDING
        self._waiter: Any = None
        self._callbacks: Any = None
        self._fwaiters: list[Any] | None = None

    @classmethod
    def failed_with(cls, err: MqdsError) -> StoreFuture:
        """A future that failed before it was a call (no map in time)."""
        handle = cls([], 1, 0.0)
        handle.error = handle.error or err
        handle._done_state = _FINISHED
        return handle

    # -- the Future API --------------------------------------------------------

    def done(self) -> bool:
        return self._done_state != _PENDING

    def cancelled(self) -> bool:
        return self._done_state == _CANCELLED

    def running(self) -> bool:
        return False

    def cancel(self) -> bool:
        with _SHARED:
            if self._done_state != _PENDING:
                return self._done_state == _CANCELLED
            self._done_state = _CANCELLED
            callbacks = self._wake()
        self._run(callbacks)
        return True

    def result(self, timeout: float | None = None) -> list[Message]:
        if self._done_state == _PENDING and not self._wait(timeout):
            raise futures.TimeoutError()
        if self._done_state == _CANCELLED:
            raise futures.CancelledError()
        return self.outcome()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._done_state == _PENDING and not self._wait(timeout):
            raise futures.TimeoutError()
        if self._done_state == _CANCELLED:
            raise futures.CancelledError()
        return self._error()

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        with _SHARED:
            if self._done_state == _PENDING:
                cbs = self._callbacks
                if cbs is None:
                    self._callbacks = fn
                elif type(cbs) is list:
                    cbs.append(fn)
                else:
                    self._callbacks = [cbs, fn]
                return
        self._run([(self, fn)])

    def set_running_or_notify_cancel(self) -> bool:
        raise RuntimeError("a pipelined call is settled by its client, not by an executor")

    def set_result(self, result: object) -> None:
        raise RuntimeError("a pipelined call is settled by its client, not by an executor")

    def set_exception(self, exception: BaseException | None) -> None:
        raise RuntimeError("a pipelined call is settled by its client, not by an executor")

    def __repr__(self) -> str:
        return f"<StoreFuture at {id(self):#x} state={_STATE_NAMES[self._done_state].lower()}>"

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the call is done (at most ``timeout`` seconds); whether it is."""
        return self._done_state != _PENDING or self._wait(timeout)

    # -- what concurrent.futures.wait and as_completed use ------------------------

    @property
    def _condition(self) -> Any:  # type: ignore[override]
        return _SHARED

    @property
    def _state(self) -> str:  # type: ignore[override]
        return _STATE_NAMES[self._done_state]

    @property
    def _waiters(self) -> list[Any]:  # type: ignore[override]
        if self._fwaiters is None:
            self._fwaiters = []
        return self._fwaiters

    # -- settling ----------------------------------------------------------------

    def _error(self) -> MqdsError | None:
        try:
            self.outcome()
        except MqdsError as err:
            return err
        return None

    def _wait(self, timeout: float | None) -> bool:
        with _SHARED:
            if self._done_state != _PENDING:
                return True
            lock = self._waiter
            if lock is None:
                lock = self._waiter = threading.Lock()
                lock.acquire()
        if lock.acquire(True, -1 if timeout is None else max(0.0, timeout)):
            lock.release()  # the next waiter of the same call, if any
            return True
        return self._done_state != _PENDING

    def _wake(self) -> list[tuple[StoreFuture, Callable[[Any], object]]]:
        """Under ``_SHARED``, once done: release the waiters; the callbacks to run (outside the lock)."""
        if self._waiter is not None:
            self._waiter.release()
        if self._fwaiters:
            failed = self._done_state == _FINISHED and (self.error is not None or bool(self.failed))
            for waiter in self._fwaiters:
                if failed:
                    waiter.add_exception(self)
                elif self._done_state == _CANCELLED:
                    waiter.add_cancelled(self)
                else:
                    waiter.add_result(self)
        cbs, self._callbacks = self._callbacks, None
        if cbs is None:
            return []
        return [(self, fn) for fn in cbs] if type(cbs) is list else [(self, cbs)]

    @staticmethod
    def _run(callbacks: Iterable[tuple[StoreFuture, Callable[[Any], object]]]) -> None:
        for handle, fn in callbacks:
            try:
                fn(handle)
            except Exception:
                log.exception("exception calling callback for %r", handle)


def publish(calls: Iterable[CallState]) -> None:
    """Complete settled calls' futures, in order: wake their waiters, then run their callbacks."""
    callbacks: list[tuple[StoreFuture, Callable[[Any], object]]] = []
    with _SHARED:
        for call in calls:
            handle: StoreFuture = call  # type: ignore[assignment]
            if handle._done_state != _PENDING:
                continue  # cancelled by its caller
            handle._done_state = _FINISHED
            if handle._waiter is not None or handle._fwaiters or handle._callbacks is not None:
                callbacks += handle._wake()
    StoreFuture._run(callbacks)


def stored(future: StoreFuture) -> list[Message]:
    """The stored messages of a pipelined call, once it is done (its error raised)."""
    return future.result()
