"""Shared catch-up reads: subscribers behind the feed at nearby positions share one disk read."""

from __future__ import annotations

import threading
import time

from storage_support import msg

from mqds.server.cluster.catchup import CatchUp
from mqds.server.wire import FOLLOW_RESPONSE_MESSAGES_TAG as ANSWER_TAG
from mqds.v1 import storage_pb2 as pb

STORED = {ts: msg("a/b", f"{ts}".encode()).SerializeToString() for ts in range(10, 1000, 10)}
"""The filter's messages on disk: timestamps 10, 20, ..., 990."""
LAST_TS = 1000


class Disk:
    """What the follow service's loader does, over ``STORED``: counts its reads."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.reads = 0
        self.messages = 0
        self.delay_s = delay_s

    def load(self, after_us: int, count: int) -> tuple[list[tuple[int, bytes]], int]:
        self.reads += 1
        time.sleep(self.delay_s)
        found = [(ts, stored) for ts, stored in sorted(STORED.items()) if ts > after_us][:count]
        self.messages += len(found)
        return found, found[-1][0] if len(found) == count else LAST_TS


def stamps(pieces: list[bytes]) -> list[int]:
    messages = pb.FollowResponse.FromString(b"".join(pieces)).messages
    assert all(m.shard == 3 and int(m.payload) == m.timestamp_us for m in messages)
    return [m.timestamp_us for m in messages]


def test_subscribers_at_nearby_positions_share_one_read_and_each_gets_only_what_follows_its_own() -> None:
    catchup, disk = CatchUp(3, 1 << 20, ANSWER_TAG), Disk()
    for position in (0, 5, 10, 95, 200):
        pieces, reached = catchup.read("a/#", position, 10, None, disk.load, chunk=40)
        expected = [ts for ts in sorted(STORED) if ts > position][:10]
        assert stamps(pieces) == expected and reached == expected[-1]
    assert disk.reads == 1  # one read of 40 from position 0 covered (0, 400]: every one of them
    # Past the segment: a new read, from there.
    pieces, reached = catchup.read("a/#", 400, 10, None, disk.load, chunk=40)
    assert stamps(pieces) == list(range(410, 510, 10)) and disk.reads == 2
    # Another filter never takes this filter's segments.
    catchup.read("other/#", 0, 10, None, disk.load, chunk=40)
    assert disk.reads == 3
    assert catchup.read_from_disk == disk.messages and catchup.served == 70


def test_a_convoy_moves_through_the_backlog_one_read_per_segment() -> None:
    catchup, disk = CatchUp(3, 1 << 20, ANSWER_TAG), Disk()
    positions = [0] * 50
    got: list[list[int]] = [[] for _ in positions]
    while any(p < LAST_TS for p in positions):
        for i, position in enumerate(positions):
            if position < LAST_TS:
                pieces, positions[i] = catchup.read("a/#", position, 7, None, disk.load, chunk=100)
                got[i] += stamps(pieces)
    assert all(g == sorted(STORED) for g in got)  # each: everything once, in order
    assert disk.reads == 1  # 99 messages: one segment, (0, 1000], served 50 times
    assert catchup.served == 50 * len(STORED)


def test_the_end_of_a_segment_moves_a_position_to_its_end_and_bytes_bound_an_answer() -> None:
    catchup, disk = CatchUp(3, 1 << 20, ANSWER_TAG), Disk()
    pieces, reached = catchup.read("a/#", 985, 10, None, disk.load, chunk=10)
    assert stamps(pieces) == [990] and reached == LAST_TS  # nothing more up to the replica's last timestamp
    one = len(catchup.read("a/#", 0, 1, None, disk.load, chunk=10)[0][0])
    pieces, reached = catchup.read("a/#", 0, 10, 2 * one + 1, disk.load, chunk=10)
    assert stamps(pieces) == [10, 20] and reached == 20
    pieces, _ = catchup.read("a/#", 0, 10, 1, disk.load, chunk=10)
    assert stamps(pieces) == [10]  # the first always comes


def test_segments_stay_within_their_bytes_and_a_reset_forgets_them() -> None:
    catchup, disk = CatchUp(3, 4096, ANSWER_TAG), Disk()
    for position in range(0, 990, 10):
        catchup.read("a/#", position, 1, None, disk.load, chunk=5)
        assert catchup.size_bytes <= 4096
    reads = disk.reads
    catchup.read("a/#", 0, 1, None, disk.load, chunk=5)
    assert disk.reads == reads + 1  # the oldest segments went to make room
    catchup.reset()
    assert catchup.size_bytes == 0
    catchup.read("a/#", 980, 1, None, disk.load, chunk=5)
    assert disk.reads == reads + 2


def test_a_storm_of_subscribers_of_one_filter_reads_once() -> None:
    catchup, disk = CatchUp(3, 1 << 20, ANSWER_TAG), Disk(delay_s=0.05)
    results: list[list[int]] = []
    lock = threading.Lock()

    def subscriber(position: int) -> None:
        pieces, _ = catchup.read("a/#", position, 5, None, disk.load, chunk=100)
        with lock:
            results.append(stamps(pieces))

    threads = [threading.Thread(target=subscriber, args=(i % 7,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(results) == 40 and all(r == [10, 20, 30, 40, 50] for r in results)
    assert disk.reads == 1


def test_a_reset_during_a_read_keeps_nothing_of_it() -> None:
    """A generation dropped while a catch-up read runs: what it read is served once, never kept."""
    catchup = CatchUp(3, 1 << 20, ANSWER_TAG)
    disk = Disk()

    def load_across_a_drop(after_us: int, count: int) -> tuple[list[tuple[int, bytes]], int]:
        catchup.reset()  # the drop lands while the read runs
        return disk.load(after_us, count)

    pieces, _ = catchup.read("a/#", 0, 5, None, load_across_a_drop, chunk=50)
    assert stamps(pieces) == [10, 20, 30, 40, 50] and catchup.size_bytes == 0
    catchup.read("a/#", 0, 5, None, disk.load, chunk=50)
    assert disk.reads == 2
