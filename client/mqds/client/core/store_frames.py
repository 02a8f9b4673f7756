"""Pipelined writes' wire work: a message checked and sized, a batch's frame, a batch's answer; in C when built.

A one-message ``store_async`` call used to check its message with
:mod:`mqds.protocol.messages`, encode it to bytes of its own
(:func:`mqds.protocol.wire.encode_message`), and get its answer as a
protobuf ``StoreStreamResponse`` whose positions were read one wrapper
each. The C extension ``mqds.client.core._store_frames`` does the three without
a Python object per message:

- :func:`message_size`: the message checked against the node's rules and
  its wire size (what the batch limits count), at the call;
- :func:`store_frame`: a batch's ``StoreStreamRequest`` written in one
  buffer from the messages themselves, when the batch is sealed;
- :func:`read_answer`: an answer that stored every message read as its
  sequence and timestamps; any other answer (failures, refused messages)
  goes to protobuf, as every answer does without the extension.

Without the extension (no C compiler when the package was installed) the
same functions check and encode in Python. ``tests/client/test_store_frames.py``
checks both against protobuf.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

from mqds.client.model import Message
from mqds.protocol import messages as rules
from mqds.protocol.errors import MqdsError, Reason
from mqds.protocol.wire import encode_message, store_stream_frame
from mqds.v1 import storage_pb2 as pb

__all__ = ["message_size", "native", "read_answer", "store_frame"]

native: ModuleType | None
try:
    from mqds.client.core import _store_frames as native
except ImportError:  # built by make install; optional elsewhere
    native = None


_MAX_EXPIRY_S = 0xFFFF_FFFF
"""The largest Message Expiry Interval (MQTT 5: a four-byte integer; mqds.v1.Message.message_expiry_s)."""


def _encode(m: Message) -> bytes:
    return encode_message(m.topic, m.payload, m.sender, m.qos, m.retain, m.properties, m.message_expiry_s)


def message_size(index: int, m: Message) -> int:
    """``m``'s wire size; raises the node's error for a message no node stores (``index``: its place in the call)."""
    if native is not None:
        size: int = native.message_size(m)
        if size >= 0:
            return size
    problem = rules.message_problem(m.topic, m.payload, m.sender, m.qos, m.properties)
    expiry = m.message_expiry_s
    if problem is None and (type(expiry) is not int or not 0 <= expiry <= _MAX_EXPIRY_S):
        problem = (Reason.INVALID_MESSAGE, f"message_expiry_s must be 0 to {_MAX_EXPIRY_S:,} seconds, got {expiry!r}")
    if problem is not None:
        raise rules.problem_error(f"message {index}", problem)
    return len(_encode(m))


def store_frame(messages: list[Message], producer_id: str, sequence: int) -> bytes:
    """The ``StoreStreamRequest`` of a batch of checked messages (:func:`message_size` took each)."""
    if native is not None:
        try:
            frame: bytes = native.store_frame(messages, producer_id, sequence)
            return frame
        except ValueError:  # one it leaves to Python (checked already, but not of the plain types)
            pass
    return store_stream_frame([_encode(m) for m in messages], producer_id, sequence)


def read_answer(data: bytes) -> Any:
    """``StoreStream``'s deserializer: ``(sequence, timestamps)`` for an answer that stored every message,
    else the parsed ``StoreStreamResponse``."""
    if native is not None:
        plain = native.read_answer(data)
        if plain is not None:
            return plain
    return pb.StoreStreamResponse.FromString(data)


def check_messages(batch: Sequence[Message]) -> tuple[list[int], dict[int, MqdsError]]:
    """Each message's wire size (-1 for a refused one), and the refused ones with their errors ({} usually)."""
    sizes: list[int] = []
    refused: dict[int, MqdsError] = {}
    for index, m in enumerate(batch):
        try:
            sizes.append(message_size(index, m))
        except MqdsError as err:
            refused[index] = err
            sizes.append(-1)
    return sizes, refused
