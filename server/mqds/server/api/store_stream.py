"""Storage.StoreStream: pipelined stores on one call, answered in order, through a bounded window.

A reader thread takes the client's batches off the stream, checks the
stream's rules and proposes each one at once (``StorageService.start_store``),
so many batches are in flight in Raft together and the ones that arrive
during a round share the next entry (group commit, ``raft/batching.py``).
The call's own thread answers them in the order they came, each as its
commit (or failure) is known. Between the two sits a queue of
``store_stream_window`` batches: when it is full the reader stops reading,
gRPC stops granting the client flow-control credit, and a client that
sends faster than the cluster commits, or never reads its answers, is held
back instead of buffered for.

Rules of the stream (a break ends it with a status, after the answers to
the batches before): every batch names the stream's producer_id and a
sequence above the previous batch's (OUT_OF_ORDER otherwise); a batch within
max_batch_messages and max_request_bytes; a batch at least every
``idle_s`` (STREAM_IDLE). A batch the node refuses (a shard it does not
lead, a producer_id too long) is answered with its error in ``failures``,
and the stream goes on; an invalid message is answered alone in
``message_failures`` and the rest of its batch is stored. After a shard's
batch failed in a way a client retries (NOT_LEADER, a timeout), the
stream's later batches of that shard are answered with the same failure
without being proposed, so the client's resend, in order and with the same
sequences, keeps them in order and stores each once. The reader learns of
such a failure from the shard's latest proposal itself, before it proposes
the next batch, not only when the answering thread gets to it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from mqds.protocol import errors
from mqds.protocol.errors import REASONS, MqdsError, Reason
from mqds.protocol.sharding import shard_of
from mqds.server.api.request_bounds import check_parsed
from mqds.server.api.shards_api import Shards
from mqds.server.api.store_in_flight import StoreInFlight
from mqds.server.raft.futures import Proposal
from mqds.server.wire import (
    STORE_STREAM_REQUEST_BATCH_TAG,
    STORE_STREAM_RESPONSE_RESULT_TAG,
    STORE_STREAM_RESPONSE_SEQUENCE_TAG,
    varint,
)
from mqds.v1 import storage_pb2 as pb

log = logging.getLogger(__name__)

_PUT_WAIT_S = 0.5
_END = object()


class BatchStore(Protocol):
    """What a stream stores its batches through (``StorageService`` is one)."""

    @property
    def shards(self) -> Shards: ...

    def check_batch_size(self, request: pb.StoreBatchRequest) -> None: ...

    def start_store(
        self, request: pb.StoreBatchRequest, raw: bytes | None = None, refused: dict[int, MqdsError] | None = None
    ) -> StoreInFlight: ...


def answer_bytes(sequence: int, result: pb.StoreBatchResponse | bytes) -> bytes:
    """An encoded StoreStreamResponse."""
    body = result if isinstance(result, bytes) else result.SerializeToString()
    head = STORE_STREAM_RESPONSE_SEQUENCE_TAG + varint(sequence) + STORE_STREAM_RESPONSE_RESULT_TAG
    return head + varint(len(body)) + body


def batch_bytes(raw: bytes) -> bytes | None:
    """The StoreBatchRequest bytes inside a StoreStreamRequest's, when the frame holds exactly that field."""
    if raw[:1] != STORE_STREAM_REQUEST_BATCH_TAG:
        return None
    length, shift, pos = 0, 0, 1
    while pos < len(raw):
        byte = raw[pos]
        length |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return raw[pos:] if len(raw) - pos == length else None
        shift += 7
    return None


@dataclass(frozen=True)
class _Refused:
    """A batch refused as a whole before anything was proposed, and the shard of its first message."""

    error: MqdsError
    shard: int


class _Stream:
    """The state of one StoreStream call, shared by its reader thread and the thread answering."""

    def __init__(self, service: BatchStore, window: int) -> None:
        self.service = service
        self.pending: queue.Queue[Any] = queue.Queue(maxsize=window)
        self.closed = threading.Event()
        self.producer = ""
        self.sequence = 0
        self.refused: dict[int, MqdsError] = {}
        """Shards whose batch failed in a way a client retries: their later batches fail the same way."""
        self.last: dict[int, Proposal] = {}
        """Each shard's latest proposal on this stream, checked before the next is proposed."""

    def check(self, batch: pb.StoreBatchRequest) -> None:
        """The stream's rules for one batch (a break ends the stream)."""
        if not batch.producer_id:
            raise errors.error(
                Reason.INVALID_REQUEST, "every batch on a StoreStream needs a producer_id (and a sequence)"
            )
        if self.producer and batch.producer_id != self.producer:
            raise errors.error(
                Reason.OUT_OF_ORDER,
                f"batch {batch.sequence} names producer {batch.producer_id!r}, but this stream is "
                f"{self.producer!r}'s: open a stream per producer",
            )
        if batch.sequence <= self.sequence:
            raise errors.error(
                Reason.OUT_OF_ORDER,
                f"batch sequence {batch.sequence} after {self.sequence} on this stream: sequences must increase "
                "(resend unacknowledged batches on a new stream)",
            )
        self.service.check_batch_size(batch)
        self.producer = batch.producer_id
        self.sequence = batch.sequence

    def note_failure(self, shard: int, err: MqdsError | None) -> None:
        """A shard's batch failed with ``err``: if a client retries that, the shard's later batches fail too."""
        if err is not None and REASONS[err.reason].retriable:
            self.refused.setdefault(shard, err)

    def start(self, request: Any) -> tuple[int, StoreInFlight | _Refused]:
        """Check and propose one frame; its sequence and what is in flight (or the batch's own error)."""
        parsed = check_parsed(request)
        frame: pb.StoreStreamRequest = parsed.parsed
        batch = frame.batch
        self.check(batch)
        # A batch whose proposal already failed (before the thread answering it
        # got to it) refuses its shard's next ones now: a leader elected again
        # meanwhile would otherwise store them ahead of the client's resend.
        for shard, proposal in list(self.last.items()):
            self.note_failure(shard, proposal.failed())
        try:
            started = self.service.start_store(batch, batch_bytes(parsed.raw), self.refused)
            for shard, item in zip(started.order, started.started, strict=True):
                if isinstance(item, Proposal):
                    self.last[shard] = item
                else:  # refused at once: not the leader, say
                    self.note_failure(shard, item)
            return batch.sequence, started
        except MqdsError as err:  # refused as a whole: a producer_id too long, say
            n_shards = self.service.shards.n_shards
            return batch.sequence, _Refused(err, shard_of(batch.messages[0].sender, n_shards) if batch.messages else 0)

    def read(self, requests: Iterator[Any]) -> None:
        """The reader thread: frames in, proposals out, until the stream ends or breaks a rule."""
        end: Any = _END
        try:
            for request in requests:
                if self.closed.is_set():
                    return
                if not self.put(self.start(request)):
                    return
        except MqdsError as err:
            end = err
        except Exception as err:  # the call was cancelled or broke: nothing more to read
            log.debug("StoreStream reader ends: %s", err)
        self.put(end)

    def put(self, item: Any) -> bool:
        """Queue ``item`` for answering, waiting for room; False if the stream was closed meanwhile."""
        while not self.closed.is_set():
            try:
                self.pending.put(item, timeout=_PUT_WAIT_S)
                return True
            except queue.Full:
                continue
        return False

    def answer(self, sequence: int, started: StoreInFlight | _Refused, timeout_s: float) -> bytes:
        """The answer to one batch, once its parts committed or failed; remembers shards that failed."""
        if isinstance(started, _Refused):
            err = started.error
            response = pb.StoreBatchResponse()
            response.failures.add(
                shard=started.shard, reason=err.reason.value, message=err.message, metadata=err.metadata
            )
            return answer_bytes(sequence, response)
        results = started.outcome(timeout_s)
        for shard, result in zip(started.order, results, strict=True):
            self.note_failure(shard, result if isinstance(result, MqdsError) else None)
        return answer_bytes(sequence, started.answer(results, raise_if_none=False))


def serve(
    service: BatchStore, requests: Iterator[Any], window: int, idle_s: float, timeout_s: float
) -> Iterator[bytes]:
    """Answer a StoreStream call: yields each batch's encoded answer, in order."""
    stream = _Stream(service, window)
    reader = threading.Thread(target=stream.read, args=(requests,), name="store-stream", daemon=True)
    reader.start()
    try:
        while True:
            try:
                item = stream.pending.get(timeout=idle_s)
            except queue.Empty:
                raise errors.error(
                    Reason.STREAM_IDLE,
                    f"no batch on this StoreStream for {idle_s:g} s (store_stream_idle_s): open a new one when "
                    "there is something to store",
                ) from None
            if item is _END:
                return
            if isinstance(item, MqdsError):
                raise item
            sequence, started = item
            yield stream.answer(sequence, started, timeout_s)
    finally:
        stream.closed.set()
