"""The read path's answer encoding in C (``mqds.server._wire_native``) against the Python one.

``make install`` builds the C part wherever a C compiler is present (pip install -e), so these
tests fail, rather than skip, when a compiler is there and the module is not.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_support import native, printed_with_and_without_pure_python, skip_without_compiler

from mqds.protocol.wire import varint
from mqds.server import wire
from mqds.server.storage import keys
from mqds.v1 import storage_pb2 as pb

_wire_native = native("mqds.server._wire_native")
pytestmark = skip_without_compiler(_wire_native, "encode")

row_lists = st.lists(
    st.tuples(
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**64 - 1),
        # Sizes across the varint boundaries of the field's length (1, 2 and 3 bytes).
        st.one_of(st.binary(max_size=300), st.integers(16_370, 16_400).map(lambda n: b"\x05" * n)),
    ),
    max_size=40,
)


def test_the_c_encoding_is_built_and_used() -> None:
    assert _wire_native is not None, "make install builds mqds.server._wire_native where a C compiler is present"
    assert wire.NATIVE
    assert wire.message_expiry_s is _wire_native.message_expiry
    assert wire.expiry_intervals is _wire_native.expiry_intervals


@settings(max_examples=300, deadline=None)
@given(rows=row_lists, shard=st.integers(0, 2**32 - 1), tag=st.sampled_from([b"\x0a", b"\x1a", b"\xa2\x01"]))
def test_c_and_python_encode_the_same_bytes(rows: list[tuple[int, int, bytes]], shard: int, tag: bytes) -> None:
    engine_rows = [(keys.data_key(stream, ts), stored) for stream, ts, stored in rows]
    tail = wire.shard_field(shard)
    assert _wire_native.encode_rows(tag, engine_rows, tail) == wire.encode_rows_python(tag, engine_rows, tail)


@pytest.mark.parametrize(
    ("rows", "error", "words"),
    [
        ([(b"D" + b"\x00" * 11, b"x")], ValueError, "a data key is 13 bytes, not 12"),
        ([(keys.data_key(1, 2), "text")], TypeError, "key and value must be bytes"),
        ([[keys.data_key(1, 2), b"x"]], TypeError, "is not a (key, value) tuple"),
        ([(keys.data_key(1, 2), b"x", b"y")], TypeError, "is not a (key, value) tuple"),
    ],
)
def test_bad_rows_are_refused_with_an_error_not_a_crash(rows: list[object], error: type, words: str) -> None:
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        _wire_native.encode_rows(b"\x0a", rows, b"")
    with pytest.raises(TypeError):
        _wire_native.encode_rows(b"\x0a", tuple(rows), b"")  # a list, nothing else


def test_pure_python_is_chosen_with_the_environment_variable() -> None:
    code = "from mqds.server import wire; print(wire.NATIVE, wire._ENCODE_ROWS.__name__)"
    env_runs = printed_with_and_without_pure_python(code)
    assert env_runs[True] == ["False", "encode_rows_python"]
    assert env_runs[False] == ["True", "encode_rows"]


def test_a_list_another_thread_changes_meanwhile_is_encoded_as_it_was_when_the_call_began() -> None:
    """The copy runs without the GIL, over the rows as they were: never over rows replaced and freed meanwhile."""
    rows = [(keys.data_key(1, ts), bytes([ts % 256]) * 300) for ts in range(20_000)]
    key = keys.data_key(1, 10_000)
    short, long = b"\x01" * 10, b"\x02" * 40_000
    tail = wire.shard_field(2)
    expected = set()
    for value in (short, long):
        rows[10_000] = (key, value)
        expected.add(wire.encode_rows_python(b"\x0a", rows, tail))
    stop = threading.Event()

    def churn() -> None:
        # A new tuple and new bytes each time: the ones replaced are freed at once.
        while not stop.is_set():
            rows[10_000] = (key, bytes(short))
            rows[10_000] = (key, bytes(long))

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(30):
            assert _wire_native.encode_rows(b"\x0a", rows, tail) in expected
    finally:
        stop.set()
        thread.join()


stored_messages = st.builds(
    lambda topic, payload, qos, props, expiry, again: (
        pb.Message(
            topic=topic,
            payload=payload,
            sender="s",
            qos=qos,
            properties=[pb.UserProperty(key=k, value=v) for k, v in props],
            message_expiry_s=expiry,
        ).SerializeToString()
        # The field again, as a fetch appends what is left of the interval (protobuf keeps the last one).
        + b"".join(wire.MESSAGE_MESSAGE_EXPIRY_S_TAG + varint(v) for v in again)
    ),
    st.text(max_size=20),
    # Payloads full of the field's tag byte (0x48, "H"): the scan skips them by their length.
    st.one_of(st.binary(max_size=300), st.integers(0, 300).map(lambda n: b"H" * n)),
    st.integers(0, 2),
    st.lists(st.tuples(st.text(max_size=5), st.text(max_size=5)), max_size=3),
    st.one_of(st.just(0), st.integers(0, 2**32 - 1)),
    st.lists(st.integers(0, 2**32 - 1), max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(stored=stored_messages)
def test_c_and_python_read_the_same_expiry_interval(stored: bytes) -> None:
    assert _wire_native.message_expiry(stored) == wire.message_expiry_python(stored)


@settings(max_examples=100, deadline=None)
@given(batch=st.lists(st.one_of(stored_messages, st.just(b"")), max_size=20))
def test_c_and_python_find_the_same_messages_with_an_interval_in_a_batch(batch: list[bytes]) -> None:
    assert _wire_native.expiry_intervals(batch) == wire.expiry_intervals_python(batch)


def test_the_expiry_scan_refuses_what_is_not_bytes_and_reads_damaged_bytes_as_no_interval() -> None:
    with pytest.raises(TypeError, match="stored message's bytes"):
        _wire_native.message_expiry("text")
    with pytest.raises(TypeError, match="message 1 is not bytes"):
        _wire_native.expiry_intervals([b"", "text"])
    with pytest.raises(TypeError, match="a list"):
        _wire_native.expiry_intervals((b"",))
    assert _wire_native.message_expiry(b"\x12\x7f" + b"x" * 3) == 0  # a length past the end
    assert _wire_native.message_expiry(b"\x48") == 0  # the tag without its value
