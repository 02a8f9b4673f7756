"""Group commit: regular commands proposed while the group's cycle was running go into one log entry.

A proposal does not reach pysyncobj at once: it waits in the group's queue
until the thread's next cycle, which hands everything queued since the last
one to pysyncobj as one entry (``0x04 + CommandBatch``), split only where an
entry would pass the entry size limit. While one Raft round is in flight,
the writes that arrive meanwhile are gathered for the next: one append, one
log sync, one append-entries per follower, one apply and one storage write
for all of them, instead of one each. A lone proposal (nothing else queued)
is logged as a plain regular entry, so a single writer pays nothing for it.

Applying a batch entry calls the machine's ``apply_batch`` with the bodies
in order; its list of results goes back to each proposer (:class:`Fanout`).
Only machines that have ``apply_batch`` get batches (a vnode; not the
cluster metadata, whose commands are few).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, cast

from pysyncobj import FAIL_REASON

from mqds.protocol.wire import varint
from mqds.server.raft.futures import Proposal
from mqds.server.raft.v1 import raft_pb2 as rpb
from mqds.server.wire import COMMAND_BATCH_COMMANDS_TAG

_ITEM_OVERHEAD = 8
"""Bytes a command adds to a batch besides its body (tag and length), with room to spare."""


_FRAME_BY_HAND_BYTES = 1024 * 1024
"""Batches holding at least this much are framed by hand (protobuf copies each body twice)."""


def encode(bodies: list[bytes]) -> bytes:
    """The body of a batch entry holding ``bodies``: a serialised ``CommandBatch``.

    Small batches go through protobuf, which is faster per command. A large
    one (a 64 MiB request's) is framed by hand, each body copied once: the
    leader's Raft thread encodes it, and protobuf's two copies kept that
    thread from its heartbeats.
    """
    if sum(map(len, bodies)) < _FRAME_BY_HAND_BYTES:
        return rpb.CommandBatch(commands=bodies).SerializeToString()
    parts: list[bytes] = []
    for body in bodies:
        parts += (COMMAND_BATCH_COMMANDS_TAG, varint(len(body)), body)
    return b"".join(parts)


def decode(body: bytes | memoryview) -> list[bytes]:
    """The regular commands of a batch entry's body (DecodeError if it is not one)."""
    return list(rpb.CommandBatch.FromString(cast(bytes, body)).commands)  # upb parses any buffer


def check(body: bytes | memoryview) -> None:
    """DecodeError unless ``body`` is a batch entry's body; copies no command out."""
    rpb.CommandBatch.FromString(cast(bytes, body))


class Fanout:
    """The callback of a batch entry: hands each proposer its own command's result."""

    __slots__ = ("proposals",)

    def __init__(self, proposals: list[Proposal]) -> None:
        self.proposals = proposals

    def on_result(self, result: Any, fail: int) -> None:
        if fail != FAIL_REASON.SUCCESS or not isinstance(result, list):
            # The entry failed as a whole (lost leadership, or its apply
            # failed before reaching the commands): so did each command.
            for proposal in self.proposals:
                proposal.on_result(result, fail)
            return
        for proposal, one in zip(self.proposals, result, strict=True):
            proposal.on_result(one, FAIL_REASON.SUCCESS)


class ProposalQueue:
    """Proposals waiting for the group's next cycle (any thread adds; the group's cycle drains)."""

    def __init__(self, max_entry_bytes: int) -> None:
        self._items: collections.deque[tuple[bytes, Proposal]] = collections.deque()
        self._max_bytes = max_entry_bytes
        self.batched_entries = 0
        """Batch entries logged (read by the metrics)."""
        self.batched_commands = 0
        """Commands that went into them."""

    def __len__(self) -> int:
        return len(self._items)

    def add(self, body: bytes, proposal: Proposal) -> None:
        self._items.append((body, proposal))

    def drain(self, log: Callable[[bytes, Callable[[Any, int], None], bool], None]) -> None:
        """Hand what is queued to ``log(body, callback, is_batch)``: one entry per run that fits the size limit."""
        items = self._items
        while items:
            run: list[tuple[bytes, Proposal]] = []
            size = 0
            while items:
                body = items[0][0]
                if run and size + len(body) + _ITEM_OVERHEAD > self._max_bytes:
                    break
                run.append(items.popleft())
                size += len(body) + _ITEM_OVERHEAD
            if len(run) == 1:
                body, proposal = run[0]
                log(body, proposal.on_result, False)
            else:
                self.batched_entries += 1
                self.batched_commands += len(run)
                log(encode([body for body, _ in run]), Fanout([p for _, p in run]).on_result, True)

    def fail_all(self, fail: int) -> None:
        """Fail everything queued (the group stops, or is not leader when it drains)."""
        while self._items:
            _, proposal = self._items.popleft()
            proposal.on_result(None, fail)
