"""The push subscribers of a chaos run (``Client.follow`` on ``chaos/#``).

Each follower thread subscribes once, from the start of what is stored, and
takes what the nodes push until it is stopped, through every fault: its
subscription must move each shard's part to another replica when a node dies
or loses its leadership, with nothing lost, repeated or reordered. It records
every message it is sent (the checker compares that with what was
acknowledged: exactly once each, each sender's in order) and notes as it goes
a message that was never attempted or that comes before an earlier one of
its sender. Odd followers let any replica serve them (``any_replica``);
from the third on, each shares the client of the one two before it, so the
nodes send the two shared answers (one cohort) while they stand together.
Followers are not paused: they write nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from mqds.chaos.history import TOPIC_FILTER, History, ReadMessage, parse_message
from mqds.client import Client, FollowBatch
from mqds.client import errors as E

log = logging.getLogger(__name__)

_USERS_LOCK = threading.Lock()


class Follower:
    """One thread following ``chaos/#`` with a push subscription, recording what it is sent."""

    def __init__(
        self,
        name: str,
        make_client: Callable[[], Client],
        history: History,
        *,
        any_replica: bool,
        share_with: Follower | None = None,
    ) -> None:
        self.name = name
        # A follower sharing another's client has its subscriptions on the same Follow calls: the nodes serve
        # the two at one position as one cohort, with shared answers. The client's owner closes it.
        if share_with is None:
            self.client = make_client()
            self.users: list[int] = [1]
            """How many followers still use the client (under ``_USERS_LOCK``); the last one closes it."""
        else:
            self.client = share_with.client
            self.users = share_with.users
            with _USERS_LOCK:
                self.users[0] += 1
        self.history = history
        self.log = history.add_follower(name, any_replica)
        self.any_replica = any_replica
        self.last_seq: dict[str, int] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"chaos-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def finish(self, deadline: float) -> bool:
        """Wait (until ``deadline``, monotonic) for every acknowledged message to have come; then stop."""
        while time.monotonic() < deadline and self.thread.is_alive():
            if not self.history.follower_missing(self.name):
                self.log.complete = True
                break
            time.sleep(0.2)
        self.stop()
        return self.log.complete

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._follow()
                except E.MqdsError as err:  # not retriable: the subscription ended
                    self.log.errors += 1
                    self.history.record_anomaly("follower-error", f"{self.name}: {err}")
                    self._stop.wait(1.0)
        except Exception as err:
            log.exception("follower %s died", self.name)
            self.history.record_anomaly("follower-crashed", f"{self.name}: {err!r}")
        finally:
            with _USERS_LOCK:
                self.users[0] -= 1
                last = self.users[0] == 0
            if last:
                self.client.close()

    def _follow(self) -> None:
        with self.client.follow(TOPIC_FILTER, window=2000, any_replica=self.any_replica) as sub:
            while not self._stop.is_set():
                batch = sub.poll(0.5)
                self.log.restarts = sub.restarts
                if batch is not None:
                    self._observe(batch)

    def _observe(self, batch: FollowBatch) -> None:
        got = []
        for m in batch.messages:
            key = parse_message(m.topic, m.payload)
            if key is None:
                self.history.record_anomaly("follower-unexpected", f"{self.name}: unparsable message on {m.topic!r}")
                continue
            last = self.last_seq.get(key[0])
            if last is not None and key[1] <= last:
                self.history.record_anomaly(
                    "follower-order", f"{self.name}: {key[0]}#{key[1]} after #{last} (shard {batch.shard})"
                )
            self.last_seq[key[0]] = max(key[1], last if last is not None else key[1])
            got.append(ReadMessage(key[0], key[1], int(m.shard or 0), int(m.timestamp_us or 0)))
        self.history.record_followed(self.name, got)
