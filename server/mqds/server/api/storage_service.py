"""The public Storage service: checks requests and translates them to the storage layer.

Each method takes a parsed request and returns a response message (or its
serialised bytes, on the replay path where building protobuf objects per
message would cost more than the read itself). Failures are raised as
``MqdsError`` with a reason; ``handlers.py`` turns them into gRPC statuses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from mqds.protocol import errors
from mqds.protocol.errors import Reason
from mqds.protocol.sharding import shard_of
from mqds.protocol.topics import MAX_TOPIC_BYTES, TopicError, validate_filter, validate_topic
from mqds.server.storage import GenerationInfo, IteratorDecodeError, IteratorState, ShardStorage
from mqds.server.storage.shard import encode_messages, repeated_field
from mqds.v1 import storage_pb2 as pb

log = logging.getLogger(__name__)

_MESSAGES_TAG = b"\x0a"  # NextResponse.messages, field 1, length-delimited
_ITERATOR_TAG = b"\x12"  # NextResponse.iterator, field 2, length-delimited
_END_OF_STREAM = b"\x18\x01"  # NextResponse.end_of_stream = true


def now_us() -> int:
    return time.time_ns() // 1000


class StorageService:
    """Implements mqds.v1.Storage over the shards of one node."""

    def __init__(
        self,
        shards: Sequence[ShardStorage],
        *,
        max_payload_bytes: int,
        max_batch_messages: int,
        max_next_batch: int,
        clock: Callable[[], int] = now_us,
    ) -> None:
        self.shards = list(shards)
        self.max_payload_bytes = max_payload_bytes
        self.max_batch_messages = max_batch_messages
        self.max_next_batch = max_next_batch
        self.clock = clock

    # -- helpers -------------------------------------------------------------

    def _shard(self, shard: int) -> ShardStorage:
        if not 0 <= shard < len(self.shards):
            raise errors.error(
                Reason.UNKNOWN_SHARD, f"shard {shard} does not exist; shards are 0 to {len(self.shards) - 1}"
            )
        return self.shards[shard]

    def _shards(self, shard: int, all_shards: bool) -> list[ShardStorage]:
        return self.shards if all_shards else [self._shard(shard)]

    @staticmethod
    def _filter(topic_filter: str) -> list[str]:
        try:
            return validate_filter(topic_filter)
        except TopicError as err:
            raise errors.error(Reason.INVALID_TOPIC_FILTER, str(err)) from None

    @staticmethod
    def _generation(info: GenerationInfo) -> pb.Generation:
        return pb.Generation(
            shard=info.shard,
            generation=info.generation,
            since_us=info.since_us,
            until_us=info.until_us or 0,
            created_at_us=info.created_at_us,
            current=info.current,
        )

    def _check_message(self, index: int, message: pb.Message) -> None:
        try:
            validate_topic(message.topic)
        except TopicError as err:
            raise errors.error(Reason.INVALID_TOPIC, f"message {index}: {err}") from None
        if len(message.payload) > self.max_payload_bytes:
            raise errors.error(
                Reason.PAYLOAD_TOO_LARGE,
                f"message {index} (topic {message.topic!r}): payload is {len(message.payload)} bytes, "
                f"over the limit of {self.max_payload_bytes} (max_payload_bytes)",
            )
        if message.qos > 2:
            raise errors.error(Reason.INVALID_MESSAGE, f"message {index}: qos must be 0, 1 or 2, got {message.qos}")
        if len(message.sender.encode("utf-8")) > MAX_TOPIC_BYTES:
            raise errors.error(Reason.INVALID_MESSAGE, f"message {index}: sender clientid is over 65,535 bytes")

    # -- RPCs ----------------------------------------------------------------

    def StoreBatch(self, request: pb.StoreBatchRequest) -> pb.StoreBatchResponse:
        messages = request.messages
        if len(messages) > self.max_batch_messages:
            raise errors.error(
                Reason.BATCH_TOO_LARGE,
                f"batch has {len(messages)} messages, over the limit of {self.max_batch_messages} "
                "(max_batch_messages); split it",
            )
        n_shards = len(self.shards)
        by_shard: dict[int, list[int]] = {}
        for index, message in enumerate(messages):
            self._check_message(index, message)
            if message.timestamp_us or message.shard:
                message.ClearField("timestamp_us")
                message.ClearField("shard")
            by_shard.setdefault(shard_of(message.sender, n_shards), []).append(index)
        response = pb.StoreBatchResponse()
        positions = [pb.MessagePosition() for _ in messages]
        for shard, indexes in sorted(by_shard.items()):
            first = self.shards[shard].store([messages[i] for i in indexes], self.clock(), sync=request.sync)
            for offset, index in enumerate(indexes):
                positions[index].shard = shard
                positions[index].timestamp_us = first + offset
        response.positions.extend(positions)
        return response

    def GetStreams(self, request: pb.GetStreamsRequest) -> pb.GetStreamsResponse:
        levels = self._filter(request.topic_filter)
        response = pb.GetStreamsResponse()
        for storage in self.shards:
            for ref in storage.get_streams(levels, request.start_time_us):
                response.streams.add(
                    rank=pb.Rank(shard=storage.shard, generation=ref.generation),
                    stream=pb.Stream(
                        shard=storage.shard, generation=ref.generation, id=ref.stream, pattern=ref.pattern
                    ),
                )
        return response

    def MakeIterator(self, request: pb.MakeIteratorRequest) -> pb.MakeIteratorResponse:
        if not request.HasField("stream"):
            raise errors.error(Reason.INVALID_REQUEST, "stream is required: pass a stream returned by GetStreams")
        self._filter(request.topic_filter)
        stream = request.stream
        state = self._shard(stream.shard).make_iterator(
            stream.generation, stream.id, request.topic_filter, request.start_time_us
        )
        token = pb.IteratorToken(shard=state.shard, generation=state.generation, state=state.encode())
        return pb.MakeIteratorResponse(iterator=token)

    def Next(self, request: pb.NextRequest) -> bytes:
        if request.batch_size < 1:
            raise errors.error(Reason.INVALID_REQUEST, "batch_size must be at least 1")
        token = request.iterator
        storage = self._shard(token.shard)
        try:
            state = IteratorState.decode(token.state)
        except IteratorDecodeError as err:
            raise errors.error(Reason.INVALID_ITERATOR, str(err)) from None
        if (state.shard, state.generation) != (token.shard, token.generation):
            raise errors.error(
                Reason.INVALID_ITERATOR,
                f"iterator token says shard {token.shard} generation {token.generation} but its state is for "
                f"shard {state.shard} generation {state.generation}",
            )
        result = storage.next(state, min(request.batch_size, self.max_next_batch))
        shard = storage.shard
        body = encode_messages(_MESSAGES_TAG, result.entries, shard)
        token_bytes = pb.IteratorToken(
            shard=shard, generation=state.generation, state=result.state.encode()
        ).SerializeToString()
        body += repeated_field(_ITERATOR_TAG, [token_bytes])
        if result.end_of_stream:
            body += _END_OF_STREAM
        return body

    def AddGeneration(self, request: pb.AddGenerationRequest) -> pb.AddGenerationResponse:
        response = pb.AddGenerationResponse()
        for storage in self._shards(request.shard, request.all_shards):
            info = storage.add_generation(self.clock())
            log.info("shard %d: started generation %d", storage.shard, info.generation)
            response.generations.append(self._generation(info))
        return response

    def ListGenerations(self, request: pb.ListGenerationsRequest) -> pb.ListGenerationsResponse:
        response = pb.ListGenerationsResponse()
        for storage in self._shards(request.shard, request.all_shards):
            response.generations.extend(self._generation(info) for info in storage.generations())
        return response

    def DropGeneration(self, request: pb.DropGenerationRequest) -> pb.DropGenerationResponse:
        info = self._shard(request.shard).drop_generation(request.generation)
        log.info("shard %d: dropped generation %d", info.shard, info.generation)
        return pb.DropGenerationResponse(dropped=self._generation(info))
