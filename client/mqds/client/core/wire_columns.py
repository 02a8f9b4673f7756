"""``Next`` answers read in C: the envelope without the messages, and the messages as Arrow-ready columns.

A ``Next`` answer of 10,000 messages parsed by protobuf costs little (about
80 ns a message); what costs is reading it: a Python wrapper per message and
an object per field (1.6 µs a message to make the Spark source's columns).
The C extension ``mqds.client.core._wire_columns`` reads the answer's bytes
directly:

- :func:`envelope`: how many messages, the iterator, ``end_of_stream``, the
  packed timestamps and ``streams_done``, skipping over the messages (their framing checked);
  so a reader that counts, or forwards the bytes, never parses them;
- :func:`columns`: the messages of several answers as the buffers of Arrow
  arrays (offsets and data for strings, a bitmap for booleans, int32 and
  int64 values), built in one pass, no Python object per message. The
  client does not need pyarrow: the Spark source wraps these buffers. A
  message protobuf could not parse (damaged bytes) is no row and is counted
  (``Columns.skipped``): one bad message never costs the others.

:data:`native` is None where the extension was not built (no C compiler when
the package was installed): callers then parse with protobuf, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple

native: ModuleType | None
try:
    from mqds.client.core import _wire_columns as native
except ImportError:  # built by make install; optional elsewhere
    native = None

# The columns' bits for columns(): the C code's WANT_* values (_wire_columns.c).
WANT_TOPIC = 1
WANT_PAYLOAD = 2
WANT_SENDER = 4
WANT_QOS = 8
WANT_RETAIN = 16
WANT_PROPERTIES = 32
WANT_TIMESTAMP = 64
WANT_ALL = WANT_TOPIC | WANT_PAYLOAD | WANT_SENDER | WANT_QOS | WANT_RETAIN | WANT_PROPERTIES | WANT_TIMESTAMP


class Envelope(NamedTuple):
    """A ``NextResponse`` without its messages."""

    n: int  # messages
    iterator: bytes  # a serialized IteratorToken
    end_of_stream: bool
    timestamps: bytes  # NextResponse.timestamps: 8 bytes little-endian a message (empty from old nodes)
    streams_done: int  # NextResponse.streams_done: streams a read from a start finished


class Columns(NamedTuple):
    """The messages of some answers as Arrow buffers (None: a column not asked for).

    Strings and bytes: ``n + 1`` int32 offsets and the data; ``qos``: n int32;
    ``retain``: a bitmap of n bits; properties: ``n + 1`` int32 offsets into
    the entries, whose keys and values are strings (``property_offsets[-1]``
    of them); ``timestamps``: n int64 (µs). In the machine's byte order.
    ``skipped``: the answers' messages that are not rows (protobuf could not
    parse them); n counts the others.
    """

    n: int
    topic_offsets: bytes | None
    topic_data: bytes | None
    payload_offsets: bytes | None
    payload_data: bytes | None
    sender_offsets: bytes | None
    sender_data: bytes | None
    qos: bytes | None
    retain: bytes | None
    property_offsets: bytes | None
    key_offsets: bytes | None
    key_data: bytes | None
    value_offsets: bytes | None
    value_data: bytes | None
    timestamps: bytes | None
    skipped: int


def envelope(answer: bytes) -> Envelope:
    """The envelope of a serialized ``NextResponse``; ValueError if it is not one. Needs :data:`native`."""
    assert native is not None, "mqds.client.core._wire_columns is not built"
    return Envelope(*native.envelope(answer))


def columns(answers: Sequence[bytes], want: int = WANT_ALL) -> Columns:
    """The messages of ``answers`` (serialized ``NextResponse``), in order, as :class:`Columns`.

    ``want``: the ``WANT_*`` bits of the columns to build. A message that
    does not parse is left out and counted in ``skipped``; ValueError for
    bytes whose framing is not such answers'; OverflowError past 2 GiB in a
    column. Needs :data:`native`.
    """
    assert native is not None, "mqds.client.core._wire_columns is not built"
    return Columns(*native.columns(list(answers), want))
