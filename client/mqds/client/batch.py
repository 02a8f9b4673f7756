"""MessageBatch: messages as a node sent them, turned into Python objects only when asked.

A ``Next`` or ``Follow`` answer of 1,000 messages is parsed by protobuf's C
parser in one step; building a :class:`~mqds.client.model.Message` for each
costs ten times that (eight attribute reads and a dataclass each). A batch
keeps the parsed protobuf messages and builds objects as they are iterated
or indexed, so a reader that counts, forwards or wants columns (the Spark
source, benchmarks, ``mqds replay --count``) pays for the parse only, and a
reader that wants objects gets them one at a time, as before.

A batch read with the C extension (``mqds.client.core.wire_columns``) holds the
answer's bytes themselves, not even parsed: protobuf parses them the first
time a message is read, and a reader of columns reads them from the bytes.

A message of the answer that does not parse (damaged bytes) is left out
when the answer is parsed, and counted (``skipped``): until then such a
batch's length counts it (the C reader only checked the answer's framing).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import overload

from mqds.client.core.answer_rows import parse_answer
from mqds.client.model import Iterator as StreamIterator
from mqds.client.model import Message, Properties
from mqds.v1 import storage_pb2 as pb

# Each column is one pass of C code over the protobuf messages, no bytecode per message.
_TOPIC, _PAYLOAD, _SENDER, _QOS, _RETAIN = map(attrgetter, ("topic", "payload", "sender", "qos", "retain"))


class MessageBatch(Sequence[Message]):
    """A read-only sequence of :class:`Message` over protobuf messages: objects are built as they are read.

    Indexing and iteration give ``Message`` objects (a new one each time);
    the column methods (``topics()``, ``payloads()``, ...) give one list per
    field without building them. Equal to any sequence of the same messages.
    """

    __slots__ = ("_answer", "_count", "_items", "_nbytes", "_times", "skipped")

    def __init__(self, items: Sequence[pb.Message] = (), times: Sequence[int] | None = None, nbytes: int = 0) -> None:
        self._items: Sequence[pb.Message] | None = items
        self._times = times
        self._nbytes = nbytes
        self._answer: bytes | None = None
        self._count = 0
        self.skipped = 0
        """Messages of the answer left out because they do not parse (known once it was parsed)."""

    @classmethod
    def of_answer(cls, answer: bytes, count: int, times: Sequence[int] | None = None) -> MessageBatch:
        """The ``count`` messages of a serialized ``NextResponse``, parsed when first read (``times``: as sent)."""
        batch = cls((), times, len(answer))
        batch._items = None
        batch._answer = answer
        batch._count = count
        return batch

    @property
    def answer(self) -> bytes | None:
        """The node's whole answer these messages came in (a serialized ``NextResponse``), while kept: a
        batch read with the C extension, until a message of it is read one by one (then protobuf parsed
        it). None for a batch cut from answers, or built here."""
        return self._answer

    def _messages(self) -> Sequence[pb.Message]:
        items = self._items
        if items is None:
            answer = self._answer
            assert answer is not None
            response, skipped = parse_answer(answer)
            items = self._items = response.messages
            if skipped:
                self.skipped = len(skipped)
                if self._times is not None:
                    gone = set(skipped)
                    self._times = [t for i, t in enumerate(self._times) if i not in gone]
            # Parsed once: the bytes go, so a batch read ahead holds what its nbytes counts, not twice that.
            self._answer = None
        return items

    @property
    def nbytes(self) -> int:
        """The size on the wire of the answer(s) the messages came in, in bytes: a batch cut from several
        answers, or a slice, counts its share (0 when not known: a batch built here, not read)."""
        return self._nbytes

    @property
    def wire(self) -> Sequence[pb.Message]:
        """The protobuf messages themselves (``mqds.v1.Message``), as parsed from the answer."""
        return self._messages()

    @property
    def times(self) -> Sequence[int]:
        """Each message's storage timestamp (µs), without reading the messages when the node sent them apart."""
        if self._times is None:
            self._times = [m.timestamp_us for m in self._messages()]
        return self._times

    def __len__(self) -> int:
        items = self._items
        return self._count if items is None else len(items)

    def __bool__(self) -> bool:
        return len(self) > 0

    @overload
    def __getitem__(self, index: int) -> Message: ...

    @overload
    def __getitem__(self, index: slice) -> MessageBatch: ...

    def __getitem__(self, index: int | slice) -> Message | MessageBatch:
        messages = self._messages()
        if isinstance(index, slice):
            items = list(messages[index])
            share = self._nbytes * len(items) // len(messages) if messages else 0
            return MessageBatch(items, None if self._times is None else self._times[index], share)
        return Message.from_pb(messages[index])

    def __iter__(self) -> Iterator[Message]:
        return map(Message.from_pb, self._messages())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a view, compared by content

    def __add__(self, other: Sequence[Message]) -> list[Message]:
        """Concatenation, as the lists ``messages`` used to be: a list of ``Message``."""
        return [*self, *other]

    def __radd__(self, other: Sequence[Message]) -> list[Message]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"MessageBatch({len(self)} messages)"

    # -- columns: one list per field, no Message objects -----------------------

    def topics(self) -> list[str]:
        return list(map(_TOPIC, self._messages()))

    def payloads(self) -> list[bytes]:
        return list(map(_PAYLOAD, self._messages()))

    def senders(self) -> list[str]:
        return list(map(_SENDER, self._messages()))

    def qos(self) -> list[int]:
        return list(map(_QOS, self._messages()))

    def retain(self) -> list[bool]:
        return list(map(_RETAIN, self._messages()))

    def timestamps(self) -> list[int]:
        """Each message's storage timestamp (µs since the epoch)."""
        return list(self.times)

    def properties(self) -> list[Properties]:
        """Each message's user properties as ``(name, value)`` pairs, in order."""
        return [tuple((p.key, p.value) for p in m.properties) if m.properties else () for m in self._messages()]

    def last_timestamp_us(self) -> int | None:
        """The last message's timestamp (None when the batch is empty)."""
        if not self:
            return None
        return self._messages()[-1].timestamp_us if self._times is None else self._times[-1]


def wire_times(data: bytes) -> Sequence[int]:
    """A node's packed timestamps (8 bytes little-endian each, ``NextResponse.timestamps``) as integers.

    A memory view over the bytes where the machine is little-endian (no
    integer objects made until one is read); a byte-swapped array elsewhere.
    """
    if sys.byteorder == "little":
        return memoryview(data).cast("Q")
    swapped = array("Q", data)
    swapped.byteswap()
    return swapped


@dataclass(frozen=True)
class NextResult:
    """What ``Client.next`` returns.

    ``end_of_stream`` is True once the stream's generation is closed and fully
    read; an empty ``messages`` without it means "nothing yet". ``messages``
    is a :class:`MessageBatch`: a sequence of ``Message``
    built as it is read, with columns for readers that want no objects.
    """

    messages: MessageBatch
    iterator: StreamIterator
    end_of_stream: bool
    streams_done: int = 0
    """After ``first_batch``: how many of its streams the answer read to their end (its messages are
    theirs, stream after stream); ``iterator`` continues the next one when ``end_of_stream`` is False."""
