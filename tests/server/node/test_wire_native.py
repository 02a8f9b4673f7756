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

from mqds.server import wire
from mqds.server.storage import keys

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
