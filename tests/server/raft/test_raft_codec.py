"""The replication layer's restricted codec, its manifests, and the placement of replicas."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqds.server.cluster import placement
from mqds.server.raft import codec
from mqds.server.raft.group import decode_manifest, encode_manifest

# -- codec -----------------------------------------------------------------------

MESSAGES: list[dict[str, Any]] = [
    {"type": "request_vote", "term": 3, "last_log_index": 10, "last_log_term": 2, "transfer": False},
    {"type": "response_vote", "term": 3},
    {
        "type": "append_entries",
        "term": 4,
        "commit_index": 9,
        "prevLogIdx": 9,
        "prevLogTerm": 3,
        "entries": [(b"\x00cmd", 10, 4), (b"\x01", 11, 4), (b"\x02" + codec.encode_membership(1, "n9"), 12, 4)],
    },
    {"type": "append_entries", "term": 4, "commit_index": 9, "serialized": (b"manifest", True, False)},
    {"type": "append_entries", "term": 4, "commit_index": 9, "serialized": None},
    {"type": "next_node_idx", "next_node_idx": 12, "reset": False, "success": True},
    {"type": "next_node_idx", "next_node_idx": 12, "reset": False, "success": True, "declines_leadership": True},
    {"type": "apply_command", "command": b"\x00x", "request_id": 7},
    {"type": "apply_command_response", "request_id": 7, "log_idx": 12, "log_term": 4},
    {"type": "apply_command_response", "request_id": 8, "error": 2},
    {"type": "timeout_now", "term": 4},
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m["type"])
def test_every_pysyncobj_message_round_trips(message: dict[str, Any]) -> None:
    assert codec.decode(codec.encode(message)) == message


@pytest.mark.parametrize(
    ("command", "words"),
    [
        (b"\x02" + pickle.dumps(["add", "n4", "anything"]), "membership change"),
        (b"\x03" + pickle.dumps(1), "command type 3"),
        (b"", "empty"),
        (b"\x01junk", "no-op entry with a body"),
    ],
)
def test_entries_pysyncobj_would_unpickle_are_refused(command: bytes, words: str) -> None:
    message = {"type": "append_entries", "term": 1, "commit_index": 0, "prevLogIdx": 1, "prevLogTerm": 0}
    raw = codec.encode({**message, "entries": [(command, 2, 1)]})
    with pytest.raises(codec.MalformedMessage, match=words):
        codec.decode(raw)


def test_entries_must_follow_each_other() -> None:
    message = {"type": "append_entries", "term": 1, "commit_index": 0, "prevLogIdx": 1, "prevLogTerm": 0}
    with pytest.raises(codec.MalformedMessage, match="does not follow"):
        codec.decode(codec.encode({**message, "entries": [(b"\x01", 5, 1)]}))


def test_chunked_entries_are_never_sent() -> None:
    with pytest.raises(ValueError, match="pickled"):
        codec.encode({"type": "append_entries", "transmission": "start", "data": b"x", "term": 1, "commit_index": 0})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_decoding_arbitrary_bytes_never_does_worse_than_refuse(raw: bytes) -> None:
    try:
        decoded = codec.decode(raw)
    except codec.MalformedMessage:
        return
    # Whatever parses is plain data: numbers, booleans, bytes and tuples of them.
    assert isinstance(decoded, dict) and isinstance(decoded["type"], str)


# -- manifests -----------------------------------------------------------------------


def test_manifest_round_trip_and_damage() -> None:
    raw = encode_manifest(3, "n1", (b"\x00last", 10, 2), (b"\x01", 9, 2), ["n1", "n2"], b"payload")
    manifest = decode_manifest(raw)
    assert (manifest.group, manifest.source, manifest.last, manifest.prev) == (
        3,
        "n1",
        (b"\x00last", 10, 2),
        (b"\x01", 9, 2),
    )
    assert manifest.members == ["n1", "n2"] and manifest.payload == b"payload"
    with pytest.raises(ValueError, match="checksum"):
        decode_manifest(raw[:-1] + bytes([raw[-1] ^ 1]))


# -- placement ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 7), st.integers(1, 24), st.integers(1, 5))
def test_initial_placement_is_valid_and_even(n_nodes: int, n_shards: int, rf: int) -> None:
    nodes = [f"n{i}" for i in range(n_nodes)]
    layout = placement.initial_placement(nodes, n_shards, rf)
    width = min(rf, n_nodes)
    counts = placement.replica_counts(layout, nodes)
    leaders = placement.replica_counts({s: r[:1] for s, r in layout.items()}, nodes)
    assert all(len(r) == len(set(r)) == width for r in layout.values())
    assert max(counts.values()) - min(counts.values()) <= 1
    assert max(leaders.values()) - min(leaders.values()) <= 1
    assert placement.next_move(layout, nodes, rf) is None


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6), st.integers(1, 16), st.integers(1, 4), st.data())
def test_moves_converge_after_joins_and_leaves(n_nodes: int, n_shards: int, rf: int, data: st.DataObject) -> None:
    nodes = [f"n{i}" for i in range(n_nodes)]
    layout = placement.initial_placement(nodes, n_shards, rf)
    active = list(nodes)
    if data.draw(st.booleans()):
        active.append("new")
    if len(active) > 1 and data.draw(st.booleans()):
        active.remove(data.draw(st.sampled_from(active)))
    for _ in range(10 * n_shards * rf + 10):
        move = placement.next_move(layout, active, rf)
        if move is None:
            break
        before = len(layout[move.shard])
        layout = placement.apply_move(layout, move)
        # Never fewer replicas than before a move, unless it only removes a surplus or a leaving node's.
        assert len(layout[move.shard]) >= before - (0 if move.target else 1)
    else:
        pytest.fail("moves did not converge")
    width = min(rf, len(active))
    counts = placement.replica_counts(layout, active)
    assert all(len(r) == len(set(r)) == width and set(r) <= set(active) for r in layout.values())
    assert max(counts.values()) - min(counts.values()) <= 1
    balanced = placement.balance_leaders(layout)
    leaders = placement.replica_counts({s: r[:1] for s, r in balanced.items()}, active)
    assert all(sorted(balanced[s]) == sorted(layout[s]) for s in layout)
    assert max(leaders.values()) - min(leaders.values()) <= max(1, len(active) - n_shards)
