"""The public Storage service: checks requests and translates them to Raft commands and reads.

Each method takes a parsed request and returns a response message (or its
serialised bytes, on the replay path where building protobuf objects per
message would cost more than the read itself). Failures are raised as
``MqdsError`` with a reason; ``handlers.py`` turns them into gRPC statuses.

Writes become commands proposed to the shard's Raft group on its leader and
answer once committed and applied there. Reads run on the shard's leader
after a read index confirmed it still leads (or on any replica with
``stale_ok``). Requests that need a leader this node is not get NOT_LEADER
with the leader's id and address in the error metadata.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf.unknown_fields import UnknownFieldSet

from mqds.protocol import errors
from mqds.protocol.errors import MqdsError, Reason
from mqds.protocol.messages import Problem, message_problem
from mqds.protocol.sharding import shard_of
from mqds.protocol.topics import TopicError, validate_filter
from mqds.protocol.wire import varint
from mqds.server.api import backup_service, delete_service, follow, store_stream
from mqds.server.api.follow_registry import FollowCalls
from mqds.server.api.handlers import takes_raw_request
from mqds.server.api.shards_api import Shards, ShardsAPI, now_us
from mqds.server.api.store_in_flight import StoreInFlight
from mqds.server.cluster.store_limits import StoreLimits
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.raft.group import Proposal
from mqds.server.storage import IteratorDecodeError, IteratorState, StorePart
from mqds.server.wire import (
    NEXT_RESPONSE_END_OF_STREAM_TAG,
    NEXT_RESPONSE_ITERATOR_TAG,
    NEXT_RESPONSE_MESSAGES_TAG,
    NEXT_RESPONSE_STREAMS_DONE_TAG,
    NEXT_RESPONSE_TIMESTAMPS_TAG,
    encode_rows,
    repeated_field,
    store_command,
    times_field,
    unknown_field_text,
    unknown_fields,
)
from mqds.v1 import storage_pb2 as pb

log = logging.getLogger(__name__)

_END_OF_STREAM = NEXT_RESPONSE_END_OF_STREAM_TAG + varint(1)  # NextResponse.end_of_stream = true


def _stored_bytes(rows: list[tuple[bytes, bytes]]) -> int:
    """The stored messages' bytes of a read's rows (what an answer's byte budget counts)."""
    return sum(len(value) for _, value in rows)


MAX_PRODUCER_ID_BYTES = 128
# A fence can be this far (microseconds) after the node's clock: the shards'
# clocks differ, but not by a day.
_FENCE_AHEAD_US = 86_400 * 1_000_000
# Bytes a Next or FetchMessages answer adds to each stored message (field
# tags, lengths, timestamp and shard), so the budget covers them too.
_PER_MESSAGE_BYTES = 24


class StorageService(ShardsAPI):
    """Implements mqds.v1.Storage over the vnodes of one node."""

    def __init__(
        self,
        shards: Shards,
        *,
        max_payload_bytes: int,
        max_batch_messages: int,
        max_next_batch: int,
        max_answer_bytes: int | None = None,
        max_entry_bytes: int | None = None,
        clock: Callable[[], int] = now_us,
        stream_window: int = 256,
        stream_idle_s: float = 300.0,
        follow_limits: follow.FollowLimits | None = None,
        scratch_dir: str | None = None,
        node_id: str = "",
        store_limits: StoreLimits | None = None,
    ) -> None:
        super().__init__(shards, max_answer_bytes=max_answer_bytes, max_entry_bytes=max_entry_bytes)
        self.store_limits = store_limits
        """The figures of retention rules with discard=new: the messages over one are refused alone (LIMIT_REACHED)."""
        self.scratch_dir = scratch_dir
        """Where exports put their checkpoints (the data directory's tmp); None: no exports."""
        self.node_id = node_id
        self.follow_limits = follow_limits or follow.FollowLimits()
        self.follow_calls = FollowCalls()
        """The Follow calls open on this node (``mqds consumers`` lists them, the lag metrics measure them)."""
        self.stream_window = stream_window
        self.stream_idle_s = stream_idle_s
        self.max_payload_bytes = max_payload_bytes
        self.max_batch_messages = max_batch_messages
        self.max_next_batch = max_next_batch
        self.clock = clock

    # -- helpers -------------------------------------------------------------

    def _propose_started(
        self,
        commands: list[tuple[int, bytes]],
        refused: dict[int, MqdsError] | None = None,
        parsed: StorePart | None = None,
    ) -> list[Proposal | MqdsError]:
        """Propose one command per shard without waiting; each proposal, or the ``MqdsError`` it was refused with.

        A shard in ``refused`` is not proposed to: its part gets that error.
        ``parsed``: the one command's parse (``_store_part``), handed to the
        replica so that applying it here does not parse it again.
        """
        self._check_commands(commands)
        started: list[Proposal | MqdsError] = []
        for shard, body in commands:
            if refused and shard in refused:
                started.append(refused[shard])
                continue
            vnode = None
            try:
                vnode = self.shards.leader_vnode(shard)
                if parsed is not None:
                    vnode.replica.expect_store(body, parsed)
                # The disk quota is the group's to check (RaftGroup.admit), for this and every other proposal.
                started.append(vnode.group.propose(body))
            except MqdsError as err:
                if vnode is not None and parsed is not None:
                    vnode.replica.unexpect_store(body)
                started.append(err)
        return started

    @staticmethod
    def _store_part(request: pb.StoreBatchRequest, raw: bytes, now: int) -> StorePart | None:
        """``store_command(raw, now)`` as applying it parses it, from the request parsed from ``raw``; None when the
        request holds a field StoreBatchRequest does not have.

        Applying a store command parses it as a VnodeCommand (its messages: the
        topics) and as a VnodeCommandEncoded (each message's bytes as logged).
        For the command built from a request's own bytes both are the
        request's: StoreMessages has the request's fields 1, 3 and 4 (its
        ``now_us``, field 5, is the one appended last, and wins), and field 1's
        bytes are the request's messages as they came (StoreMessagesEncoded
        reads them from the request's bytes, the same as from the command's).
        The parse succeeds on the command where it did on the request, with
        one exception this refuses: a field the request does not have (a group
        nested 100 deep parses in the request and not one level deeper, in the
        command). The messages hold no unknown field (``unknown_fields``).
        """
        if len(UnknownFieldSet(request)):
            return None
        producer = request.producer_id
        dedup = (producer.encode(), request.sequence) if producer else None
        return StorePart(request.messages, now, dedup, cpb.StoreMessagesEncoded.FromString(raw).messages)

    def _check_message(self, message: pb.Message) -> Problem | None:
        """What is wrong with a message of a batch (the rules of ``mqds.protocol.messages``), or None."""
        m = message
        return message_problem(m.topic, m.payload, m.sender, m.qos, m.properties, self.max_payload_bytes)

    # -- RPCs ----------------------------------------------------------------

    @takes_raw_request
    def StoreBatch(self, request: pb.StoreBatchRequest, raw: bytes | None = None) -> pb.StoreBatchResponse | bytes:
        """Store a batch; ``raw`` (the request's bytes) lets a single-shard batch be logged as it came."""
        return self.start_store(request, raw).finish(self.shards.write_timeout_s)

    def start_store(
        self, request: pb.StoreBatchRequest, raw: bytes | None = None, refused: dict[int, MqdsError] | None = None
    ) -> StoreInFlight:
        """Check a batch and propose its parts without waiting for them; ``finish`` waits and answers.

        A part for a shard in ``refused`` is not proposed: it fails with that
        error (a stream's earlier batch of the shard failed, see StoreStream).
        A message that breaks a rule is left out of its shard's part and
        answered alone (``StoreInFlight.invalid``). Raises ``MqdsError`` for a
        batch refused as a whole.
        """
        messages = request.messages
        self.check_batch_size(request)
        producer = request.producer_id
        if producer:
            if len(producer.encode("utf-8")) > MAX_PRODUCER_ID_BYTES:
                raise errors.error(
                    Reason.INVALID_REQUEST, f"producer_id is over {MAX_PRODUCER_ID_BYTES} bytes; use a shorter id"
                )
            if request.sequence == 0:
                raise errors.error(Reason.INVALID_REQUEST, "sequence must be 1 or more when producer_id is set")
        if not messages:
            return StoreInFlight([], {}, 0, [])  # nothing to store: nothing proposed
        n_shards = self.shards.n_shards
        max_payload = self.max_payload_bytes
        # No payload can be over the limit when the whole request is not.
        check_payload = raw is None or len(raw) > max_payload
        as_sent = raw is not None
        by_shard: dict[int, list[int]] = {}
        shard_cache: dict[str, int] = {}
        invalid: dict[int, tuple[int, Problem]] = {}
        for index, message in enumerate(messages):
            topic = message.topic
            sender = message.sender
            shard = shard_cache.get(sender, -1)
            # The common case is checked cheaply (16,383 characters are at
            # most 65,535 UTF-8 bytes; a sender's length once); anything else
            # gets the full check and its precise error.
            if (
                shard < 0
                or not 0 < len(topic) <= 16383
                or "+" in topic
                or "#" in topic
                or "\x00" in topic
                or message.qos > 2
                or (check_payload and len(message.payload) > max_payload)
                or len(message.properties)
            ):
                if shard < 0:
                    shard = shard_cache[sender] = shard_of(sender, n_shards)
                problem = self._check_message(message)
                if problem is not None:
                    invalid[index] = (shard, problem)
                    continue
            if message.timestamp_us or message.shard:
                message.ClearField("timestamp_us")
                message.ClearField("shard")
                as_sent = False
            by_shard.setdefault(shard, []).append(index)
        # Fields protobuf kept as unknown ones would be stored as they came: such a message fails alone too.
        for found in unknown_fields(raw if raw is not None else request.SerializeToString()):
            index = found[0]
            if index not in invalid:
                shard = shard_cache[messages[index].sender]
                by_shard[shard].remove(index)
                if not by_shard[shard]:
                    del by_shard[shard]
                invalid[index] = (shard, (Reason.INVALID_MESSAGE, unknown_field_text(found)))
        if self.store_limits is not None:
            self._over_limits(by_shard, messages, invalid)
        if invalid:
            as_sent = False  # the command is built without them
        now = self.clock()
        order = sorted(by_shard)
        commands = []
        parsed = None
        if len(order) == 1 and as_sent and raw is not None:
            # StoreMessages is wire-compatible with the request: its bytes
            # plus now_us are the command (see commands.proto).
            commands.append((order[0], store_command(raw, now)))
            parsed = self._store_part(request, raw, now)
        else:
            for shard in order:
                cmd = cpb.VnodeCommand()
                store = cmd.store
                store.now_us = now
                if producer:
                    store.producer_id = producer
                    store.sequence = request.sequence
                indexes = by_shard[shard]
                if len(order) == 1 and not invalid:
                    store.messages.extend(messages)
                else:
                    store.messages.extend([messages[i] for i in indexes])
                commands.append((shard, cmd.SerializeToString()))
        started = self._propose_started(commands, refused, parsed)
        return StoreInFlight(order, by_shard, len(messages), started, invalid)

    def _over_limits(
        self, by_shard: dict[int, list[int]], messages: Any, invalid: dict[int, tuple[int, Problem]]
    ) -> None:
        """Leave out of their parts, as refused alone (LIMIT_REACHED), the messages a retention rule with
        discard=new refuses in their shard (``StoreLimits``)."""
        assert self.store_limits is not None
        for shard in list(by_shard):
            refused = self.store_limits.refused(shard, ((i, messages[i]) for i in by_shard[shard]))
            if not refused:
                continue
            for index, problem in refused.items():
                invalid[index] = (shard, problem)
            by_shard[shard] = [i for i in by_shard[shard] if i not in refused]
            if not by_shard[shard]:
                del by_shard[shard]

    def check_batch_size(self, request: pb.StoreBatchRequest) -> None:
        """Refuse a batch of more than max_batch_messages (BATCH_TOO_LARGE)."""
        if len(request.messages) > self.max_batch_messages:
            raise errors.error(
                Reason.BATCH_TOO_LARGE,
                f"batch has {len(request.messages)} messages, over the limit of {self.max_batch_messages} "
                "(max_batch_messages); split it",
            )

    def StoreStream(self, requests: Iterator[Any], context: Any) -> Iterator[bytes]:
        """Pipelined stores on one call (``store_stream.py``): each batch answered in order as it commits."""
        return store_stream.serve(self, requests, self.stream_window, self.stream_idle_s, self.shards.write_timeout_s)

    def Follow(self, requests: Iterator[Any], context: Any) -> Iterator[bytes]:
        """Push subscriptions on one call (``follow.py``): committed messages sent as they come, within credit."""
        return follow.serve(
            self.shards,
            requests,
            self.follow_limits,
            self.max_answer_bytes,
            self.clock,
            registry=(self.follow_calls, context.peer() if context is not None else ""),
        )

    def GetStreams(self, request: pb.GetStreamsRequest) -> pb.GetStreamsResponse:
        levels = self._filter(request.topic_filter)
        response = pb.GetStreamsResponse()
        numbers = self._shard_numbers(0, True, request.shards)
        size = 0
        for vnode in self._read(numbers, request.stale_ok):
            with vnode.replica.reading() as storage:
                refs = storage.get_streams(levels, request.start_time_us)
            # A ranked stream takes its pattern and at most 40 bytes more.
            size += sum(len(ref.pattern) + 40 for ref in refs)
            self._check_answer(
                size,
                f"the streams matching {request.topic_filter!r}",
                "ask for fewer shards at a time (shards), a narrower topic filter or a later start_time_us",
            )
            for ref in refs:
                response.streams.add(
                    rank=pb.Rank(shard=vnode.shard, generation=ref.generation),
                    stream=pb.Stream(shard=vnode.shard, generation=ref.generation, id=ref.stream, pattern=ref.pattern),
                )
        return response

    def MakeIterator(self, request: pb.MakeIteratorRequest) -> pb.MakeIteratorResponse:
        if not request.HasField("stream"):
            raise errors.error(Reason.INVALID_REQUEST, "stream is required: pass a stream returned by GetStreams")
        self._filter(request.topic_filter)
        stream = request.stream
        (vnode,) = self._read(self._shard_numbers(stream.shard, False), request.stale_ok)
        with vnode.replica.reading() as storage:
            state = storage.make_iterator(stream.generation, stream.id, request.topic_filter, request.start_time_us)
        token = pb.IteratorToken(shard=state.shard, generation=state.generation, state=state.encode())
        return pb.MakeIteratorResponse(iterator=token)

    def Next(self, request: pb.NextRequest) -> bytes:
        if request.batch_size < 1:
            raise errors.error(Reason.INVALID_REQUEST, "batch_size must be at least 1")
        fence = request.fence_us or None
        if fence is not None and fence > self.clock() + _FENCE_AHEAD_US:
            raise errors.error(
                Reason.INVALID_REQUEST,
                f"fence_us {fence} is more than a day after this node's clock: pass a fence that GetFences returned",
            )
        starts = self._starts(request, fence)
        state = None if starts else self._iterator_state(request.iterator)
        shard = starts[0].stream.shard if starts else state.shard  # type: ignore[union-attr]  # one of the two
        (vnode,) = self._read(self._shard_numbers(shard, False), request.stale_ok)
        batch = min(request.batch_size, self.max_next_batch)
        # Past the budget the read stops (after one message at least) and the
        # iterator it returns continues from there.
        budget = None
        if self.max_answer_bytes is not None:
            # The answer's iterator: the request's, or a new one holding one of the starts' filters.
            token_size = len(request.iterator.state) + max((64 + len(w.topic_filter) for w in starts), default=0)
            budget = max(0, self.max_answer_bytes - 256 - token_size - _PER_MESSAGE_BYTES * batch)
        rows: list[tuple[bytes, bytes]] = []
        done = 0
        with vnode.replica.reading() as storage:
            while True:
                if starts:
                    where = starts[done]
                    state = storage.make_iterator(
                        where.stream.generation, where.stream.id, where.topic_filter, where.start_time_us, fence
                    )
                assert state is not None
                result = storage.next(state, batch - len(rows), fence, budget)
                # Sizes are summed only where a read goes on into another stream, not on a plain read's path.
                size = _stored_bytes(result.rows) if rows and budget is not None else None
                if size is not None and budget is not None and size > budget:
                    # A later stream whose first message alone passes what is left: not in this answer;
                    # the iterator starts it, for the next call.
                    position, ended = state, False
                    break
                rows += result.rows
                position, ended = result.state, result.end_of_stream
                done += ended and bool(starts)
                # On to the next stream while this one is read to the fence and there is room for more.
                if not starts or not ended or done == len(starts) or len(rows) >= batch:
                    break
                if budget is not None:
                    budget -= _stored_bytes(result.rows) if size is None else size
                    if budget <= 0:
                        break
            shard = storage.shard
            body, times = encode_rows(NEXT_RESPONSE_MESSAGES_TAG, rows, shard)
        token_bytes = pb.IteratorToken(
            shard=shard, generation=position.generation, state=position.encode()
        ).SerializeToString()
        body += repeated_field(NEXT_RESPONSE_ITERATOR_TAG, [token_bytes])
        if ended:
            body += _END_OF_STREAM
        body += times_field(NEXT_RESPONSE_TIMESTAMPS_TAG, times)
        if done:
            body += NEXT_RESPONSE_STREAMS_DONE_TAG + varint(done)
        return body

    def _starts(self, request: pb.NextRequest, fence: int | None) -> list[pb.IteratorStart]:
        """The streams a ``start`` (and ``then``) asks to read, checked; [] for a read from an iterator."""
        if not request.HasField("start"):
            if request.then:
                raise errors.error(Reason.INVALID_REQUEST, "then goes with start: the streams to read after it")
            return []
        if request.HasField("iterator"):
            raise errors.error(Reason.INVALID_REQUEST, "give iterator or start, not both")
        if request.then and fence is None:
            raise errors.error(
                Reason.INVALID_REQUEST, "then needs fence_us: a stream is read to its end only up to a fence"
            )
        starts = [request.start, *request.then]
        first = request.start.stream
        for where in starts:
            if not where.HasField("stream"):
                raise errors.error(
                    Reason.INVALID_REQUEST, "start.stream is required: pass a stream returned by GetStreams"
                )
            if (where.stream.shard, where.stream.generation) != (first.shard, first.generation):
                raise errors.error(
                    Reason.INVALID_REQUEST,
                    f"then's streams must be of start's shard {first.shard} and generation {first.generation}",
                )
            self._filter(where.topic_filter)
        return starts

    @staticmethod
    def _iterator_state(token: pb.IteratorToken) -> IteratorState:
        """The position a client's iterator token holds, checked (INVALID_ITERATOR when it is not one of ours)."""
        try:
            state = IteratorState.decode(token.state)
        except IteratorDecodeError as err:
            raise errors.error(Reason.INVALID_ITERATOR, str(err)) from None
        try:
            # The checksum catches damage, not forgery: the filter is checked too.
            validate_filter(state.topic_filter)
        except TopicError as err:
            raise errors.error(Reason.INVALID_ITERATOR, f"iterator holds a bad topic filter: {err}") from None
        if (state.shard, state.generation) != (token.shard, token.generation):
            raise errors.error(
                Reason.INVALID_ITERATOR,
                f"iterator token says shard {token.shard} generation {token.generation} but its state is for "
                f"shard {state.shard} generation {state.generation}",
            )
        return state

    def AddGeneration(self, request: pb.AddGenerationRequest) -> pb.AddGenerationResponse:
        numbers = self._shard_numbers(request.shard, request.all_shards, request.shards)
        commands = []
        now = self.clock()
        for shard in numbers:
            with self.shards.leader_vnode(shard).replica.reading() as storage:
                current = storage.current_generation
            cmd = cpb.VnodeCommand(add_generation=cpb.AddGeneration(now_us=now, if_current=current))
            commands.append((shard, cmd.SerializeToString()))
        response = pb.AddGenerationResponse()
        for info in self._propose_all(commands):
            log.info("shard %d: started generation %d", info.shard, info.generation)
            response.generations.append(self._generation(info))
        return response

    def ListGenerations(self, request: pb.ListGenerationsRequest) -> pb.ListGenerationsResponse:
        response = pb.ListGenerationsResponse()
        numbers = self._shard_numbers(request.shard, request.all_shards, request.shards)
        size = 0
        for vnode in self._read(numbers, request.stale_ok):
            with vnode.replica.reading() as storage:
                generations = [self._generation(info) for info in storage.generations()]
            size += sum(g.ByteSize() + 3 for g in generations)
            self._check_answer(size, "the generations asked for", "ask for fewer shards at a time (shards)")
            response.generations.extend(generations)
        return response

    def GetFences(self, request: pb.GetFencesRequest) -> pb.GetFencesResponse:
        response = pb.GetFencesResponse()
        size = 0
        for vnode in self._read(self._shard_numbers(0, True, request.shards), request.stale_ok):
            with vnode.replica.reading() as storage:
                fence = response.fences.add(
                    shard=vnode.shard, timestamp_us=storage.last_ts, applied_index=storage.applied_index
                )
                infos = storage.generations()
                fence.generations.extend(self._generation(info) for info in infos)
                fence.estimated_keys.extend(storage.estimated_keys(info.generation) for info in infos)
            size += fence.ByteSize() + 5
            self._check_answer(size, "the fences asked for", "ask for fewer shards at a time (shards)")
        return response

    def DropGeneration(self, request: pb.DropGenerationRequest) -> pb.DropGenerationResponse:
        (shard,) = self._shard_numbers(request.shard, False)
        cmd = cpb.VnodeCommand(drop_generation=cpb.DropGeneration(generation=request.generation))
        (info,) = self._propose_all([(shard, cmd.SerializeToString())])
        log.info("shard %d: dropped generation %d", info.shard, info.generation)
        return pb.DropGenerationResponse(dropped=self._generation(info))

    def DeleteMessages(self, request: pb.DeleteMessagesRequest) -> pb.DeleteMessagesResponse:
        return delete_service.delete_messages(self.shards, request)

    def ExportShard(self, request: pb.ExportShardRequest) -> Iterator[pb.ExportShardResponse]:
        if self.scratch_dir is None:
            raise errors.error(Reason.INVALID_REQUEST, "this node takes no exports (it has no scratch directory)")
        return backup_service.export_shard(self, request, self.scratch_dir, self.node_id, self.clock)

    def ImportShard(self, request: pb.ImportShardRequest) -> pb.ImportShardResponse:
        return backup_service.import_shard(self, request, self.clock)
