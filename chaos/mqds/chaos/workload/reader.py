"""The iterator readers of a chaos run.

Each reader thread tails the filter ``chaos/#`` the way a broker replays a
persistent session: it asks for the streams now and again, keeps an iterator
per stream, and calls ``next`` on each. It checks what it sees as it goes (a
message that was never attempted, one seen twice, a sender's messages out of
order within a stream) and records every message it saw, so the checker can
tell whether anything read during the faults is missing at the end. One
reader reads from leaders (linearizable), the other with ``stale_ok`` from
any replica. Readers are not paused: reads write nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from mqds.chaos.history import TOPIC_FILTER, History, MessageKey, ReadMessage, parse_message
from mqds.client import Client, Message
from mqds.client import errors as E
from mqds.client.model import Iterator, Stream

log = logging.getLogger(__name__)


class Reader:
    """One thread tailing ``chaos/#`` with iterators, checking what it sees."""

    def __init__(
        self,
        name: str,
        make_client: Callable[[], Client],
        history: History,
        *,
        stale_ok: bool,
        batch_size: int = 500,
        streams_every_s: float = 1.0,
    ) -> None:
        self.name = name
        self.client = make_client()
        self.history = history
        self.stale_ok = stale_ok
        self.batch_size = batch_size
        self.streams_every_s = streams_every_s
        self.iterators: dict[Stream, Iterator | None] = {}
        self.last_seq: dict[tuple[Stream, str], int] = {}
        self.seen: set[MessageKey] = set()
        self.errors = 0
        self.read = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"chaos-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        next_streams = 0.0
        try:
            while not self._stop.is_set():
                try:
                    if time.monotonic() >= next_streams:
                        self._discover()
                        next_streams = time.monotonic() + self.streams_every_s
                    got = self._poll()
                except E.MqdsError as err:
                    self._error(err)
                    self._stop.wait(0.2)
                    continue
                if not got:
                    self._stop.wait(0.2)
        except Exception as err:
            log.exception("reader %s died", self.name)
            self.history.record_anomaly("reader-crashed", f"{self.name}: {err!r}")
        finally:
            self.client.close()

    def _error(self, err: E.MqdsError) -> None:
        self.errors += 1
        if err.retriable:
            return
        if self.stale_ok and isinstance(err, E.NotFoundError):
            # A replica behind (or being rebuilt after a wipe) may not know the stream yet.
            return
        self.history.record_anomaly("reader-error", f"{self.name}: {err}")

    def _discover(self) -> None:
        for _, stream in self.client.get_streams(TOPIC_FILTER, 0, stale_ok=self.stale_ok, timeout_s=5):
            if stream not in self.iterators:
                self.iterators[stream] = self.client.make_iterator(
                    stream, TOPIC_FILTER, 0, stale_ok=self.stale_ok, timeout_s=5
                )

    def _poll(self) -> int:
        got = 0
        for stream, iterator in list(self.iterators.items()):
            if iterator is None or self._stop.is_set():
                continue
            try:
                result = self.client.next(iterator, self.batch_size, stale_ok=self.stale_ok, timeout_s=5)
            except E.MqdsError as err:
                self._error(err)
                continue
            self._observe(stream, result.messages)
            got += len(result.messages)
            self.iterators[stream] = None if result.end_of_stream else result.iterator
        return got

    def _observe(self, stream: Stream, messages: Sequence[Message]) -> None:
        seen = []
        for m in messages:
            key = parse_message(m.topic, m.payload)
            if key is None:
                self.history.record_anomaly("reader-unexpected", f"{self.name}: unparsable message on {m.topic!r}")
                continue
            if not self.history.is_attempted(key):
                self.history.record_anomaly("reader-unexpected", f"{self.name}: {key[0]}#{key[1]} never attempted")
            if key in self.seen:
                self.history.record_anomaly("reader-duplicate", f"{self.name}: {key[0]}#{key[1]} seen twice")
            self.seen.add(key)
            last = self.last_seq.get((stream, key[0]))
            if last is not None and key[1] <= last:
                self.history.record_anomaly(
                    "reader-order", f"{self.name}: {key[0]}#{key[1]} after #{last} in shard {stream.shard} stream"
                )
            self.last_seq[(stream, key[0])] = key[1]
            seen.append(ReadMessage(key[0], key[1], int(m.shard or 0), int(m.timestamp_us or 0)))
        self.read += len(seen)
        self.history.record_seen(seen)
