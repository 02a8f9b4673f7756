"""The store path's key building in C (``mqds.server.storage._store_native``) against the Python one.

Replicas must hold the same keys whichever of the two built them (a node without a C compiler
beside nodes with one), so the C version must make exactly the Python version's calls.
``make install`` builds the C part wherever a C compiler is present, so these tests fail, rather
than skip, when a compiler is there and the module is not.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_support import native, printed_with_and_without_pure_python, skip_without_compiler
from storage_support import random_message

from mqds.server.storage import keys, writes
from mqds.server.storage.shard import Engine, ShardStorage

_store_native = native("mqds.server.storage._store_native")
pytestmark = skip_without_compiler(_store_native, "store")

HANDLE = object()


class Recorder:
    """A write batch's put that records its calls."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[tuple[bytes, bytes, object]] = []
        self.fail_at = fail_at

    def put(self, key: bytes, value: bytes, handle: object) -> None:
        if len(self.calls) == self.fail_at:
            raise RuntimeError("the write batch refused a put")
        self.calls.append((key, value, handle))


def run(put_batch: writes.PutBatch, *args: object) -> tuple[list[int], list[tuple[bytes, bytes, object]]]:
    recorder = Recorder()
    streams = put_batch(recorder.put, HANDLE, *args)  # type: ignore[arg-type]
    return streams, recorder.calls


prefixes = st.binary(min_size=0, max_size=12)
routes_strategy = st.dictionaries(
    st.text(min_size=1, max_size=6),
    st.tuples(prefixes, st.lists(prefixes, max_size=4).map(tuple), st.integers(0, 2**32 - 1)),
    min_size=1,
    max_size=8,
)


def test_the_c_version_is_built_and_used() -> None:
    assert _store_native is not None, "make install builds mqds.server.storage._store_native where cc is present"
    assert writes.NATIVE


@settings(max_examples=300, deadline=None)
@given(
    routes=routes_strategy,
    picks=st.lists(st.integers(0, 7), max_size=60),
    first=st.one_of(st.integers(0, 2**40), st.integers(2**64 - 200, 2**64 - 61)),
    data=st.data(),
)
def test_c_and_python_make_the_same_calls(
    routes: dict[str, writes.Route], picks: list[int], first: int, data: st.DataObject
) -> None:
    """Repeated topics, topics sharing index prefixes or a stream, none, timestamps near 2**64."""
    names = sorted(routes)
    topics = [names[i % len(names)] for i in picks]
    values = [data.draw(st.binary(max_size=20)) for _ in topics]
    native = run(_store_native.put_batch, topics, values, first, routes)
    assert native == run(writes.put_batch_python, topics, values, first, routes)
    streams, calls = native
    assert streams == list(dict.fromkeys(routes[t][2] for t in topics))
    # One data key per message, then one index key per prefix.
    assert len(calls) == len(topics) + len({p for t in topics for p in routes[t][1]})


def test_postings_list_each_prefix_s_messages_by_position() -> None:
    routes: dict[str, writes.Route] = {
        "a/1": (b"Da", (b"I1", b"Ix"), 7),
        "a/2": (b"Da", (b"I2", b"Ix"), 7),
        "b/1": (b"Db", (b"I1",), 9),
    }
    topics = ["a/1", "a/2", "b/1", "a/1", "a/2"]
    streams, calls = run(_store_native.put_batch, topics, [b"v%d" % i for i in range(5)], 100, routes)
    assert streams == [7, 9]
    index = {key: value for key, value, _ in calls[5:]}
    assert index == {
        b"I1" + keys.u64(100): keys.encode_postings([0, 2, 3]),
        b"Ix" + keys.u64(100): keys.encode_postings([0, 1, 3, 4]),
        b"I2" + keys.u64(101): keys.encode_postings([1, 4]),
    }
    assert calls[4] == (b"Da" + keys.u64(104), b"v4", HANDLE)


@pytest.mark.parametrize(
    ("topics", "values", "first", "routes", "error", "words"),
    [
        (["t"], [b"x"], 0, {}, KeyError, "has no route"),
        (["t"], [b"x", b"y"], 0, {"t": (b"D", (), 1)}, ValueError, "1 topics but 2 values"),
        (["t"], ["x"], 0, {"t": (b"D", (), 1)}, TypeError, "value 0 is not bytes"),
        (["t"], [b"x"], 0, {"t": (b"D", ())}, TypeError, "is not"),
        (["t"], [b"x"], 0, {"t": ("D", (), 1)}, TypeError, "is not"),
        (["t"], [b"x"], 0, {"t": (b"D", ("I",), 1)}, TypeError, "not bytes"),
        (["t", "t"], [b"x", b"y"], 2**64 - 1, {"t": (b"D", (), 1)}, OverflowError, "do not fit"),
        (["t"], [b"x"], 2**64, {"t": (b"D", (), 1)}, OverflowError, "int too big"),
        (["t"], [b"x"], -1, {"t": (b"D", (), 1)}, OverflowError, "negative"),
    ],
)
def test_bad_arguments_are_refused_with_an_error_not_a_crash(
    topics: list[str], values: list[object], first: int, routes: dict[str, object], error: type, words: str
) -> None:
    with pytest.raises(error, match=words):
        _store_native.put_batch(Recorder().put, HANDLE, topics, values, first, routes)
    with pytest.raises(TypeError):
        _store_native.put_batch(Recorder().put, HANDLE, tuple(topics), values, first, routes)  # a list, nothing else


def test_a_failing_put_ends_the_call_with_its_error() -> None:
    routes: dict[str, writes.Route] = {"t": (b"D", (b"I",), 1)}
    for fail_at in (0, 1, 3):
        recorder = Recorder(fail_at=fail_at)
        with pytest.raises(RuntimeError, match="refused a put"):
            _store_native.put_batch(recorder.put, HANDLE, ["t"] * 3, [b"a", b"b", b"c"], 5, routes)
        assert len(recorder.calls) == fail_at


def test_a_put_that_changes_the_routes_cannot_make_it_read_a_freed_route() -> None:
    """A route is borrowed from the dict: nothing of it may be used after a put, which may run any Python."""
    routes: dict[str, object] = {}

    def put(key: bytes, value: bytes, handle: object) -> None:
        routes.clear()  # frees the route tuple and its prefixes: the dict held the only references

    for _ in range(200):
        routes["t"] = (bytes(b"D" * 5), tuple(bytes([i]) * 9 for i in range(8)), 10**30)
        with pytest.raises(KeyError, match="has no route"):
            _store_native.put_batch(put, HANDLE, ["t", "t"], [b"a", b"b"], 5, routes)


def _store_script(storage: ShardStorage) -> None:
    rng = random.Random(7)
    storage.initialize(3, applied_index=1)
    for index in range(2, 80):
        if index % 25 == 0:
            storage.add_generation(rng.randint(0, 50_000), applied_index=index)
            continue
        batch = [random_message(rng) for _ in range(rng.randint(0, 40))]
        storage.store(batch, rng.randint(0, 50_000), applied_index=index)


def test_a_shard_stored_in_c_holds_exactly_what_python_stores(
    tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same stores through each version: the same keys and values, trie and presence included."""
    dumps = []
    for name, put_batch in (("c", _store_native.put_batch), ("python", writes.put_batch_python)):
        monkeypatch.setattr(writes, "_PUT_BATCH", put_batch)
        storage = ShardStorage(str(tmp_path / name), 4, engine, lts_threshold_top=3, lts_threshold=2)
        try:
            _store_script(storage)
            dumps.append(list(storage.dump()))
        finally:
            storage.close()
    assert dumps[0] == dumps[1]
    assert sum(1 for cf, key, _ in dumps[0] if cf != "default" and key[:1] == keys.INDEX_TAG) > 50


def test_pure_python_is_chosen_with_the_environment_variable() -> None:
    code = "from mqds.server.storage import writes; print(writes.NATIVE, writes._PUT_BATCH.__name__)"
    runs = printed_with_and_without_pure_python(code)
    assert runs[True] == ["False", "put_batch_python"]
    assert runs[False] == ["True", "put_batch"]
