"""A store proposed here is applied from its proposer's parse: the same as parsing the logged command, or not used.

``StorageService.start_store`` hands the replica the parse of the command it
logs from a request's own bytes (``expect_store``); applying takes it instead
of parsing the command as a ``VnodeCommand`` and a ``VnodeCommandEncoded``
(``cluster/proposed_stores.py``). Here: that parse equals the two parses of
the logged bytes, a replica applying with it stores exactly what one
parsing stores, it is used only for equal bytes, and never for a request
whose command would not parse as the request did.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pysyncobj import FAIL_REASON
from storage_support import vnode_replica

from mqds.protocol.wire import STORE_BATCH_REQUEST_MESSAGES_TAG as MESSAGES
from mqds.protocol.wire import encode_message, length_delimited, varint
from mqds.server.api.storage_service import StorageService
from mqds.server.cluster import vnode as vnode_module
from mqds.server.cluster.proposed_stores import ProposedStores
from mqds.server.cluster.v1 import commands_pb2 as cpb
from mqds.server.cluster.vnode import VnodeReplica
from mqds.server.raft import batching
from mqds.server.raft.futures import Proposal
from mqds.server.storage import StorePart
from mqds.server.wire import store_command
from mqds.v1 import storage_pb2 as pb

NOW = 1_700_000_000_000_000


class OneShard:
    """A node with one shard, led here: what the proposer hands its replica, and the commands it proposes."""

    n_shards = 1
    write_timeout_s = 5.0

    def __init__(self) -> None:
        self.expected: list[tuple[bytes, StorePart]] = []
        self.proposed: list[bytes] = []

    def leader_vnode(self, shard: int) -> Any:
        def propose(body: bytes) -> Proposal:
            self.proposed.append(body)
            proposal = Proposal(shard)
            proposal.on_result(NOW, FAIL_REASON.SUCCESS)
            return proposal

        replica = SimpleNamespace(
            expect_store=lambda body, part: self.expected.append((body, part)), unexpect_store=lambda body: None
        )
        return SimpleNamespace(group=SimpleNamespace(propose=propose), replica=replica)


def started(raw: bytes, now: int = NOW) -> OneShard:
    shards = OneShard()
    service = StorageService(
        shards,  # type: ignore[arg-type]
        max_payload_bytes=1 << 20,
        max_batch_messages=1000,
        max_next_batch=100,
        clock=lambda: now,
    )
    service.start_store(pb.StoreBatchRequest.FromString(raw), raw).finish(5.0)
    return shards


texts = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="+#\x00"), max_size=12)
messages = st.builds(
    lambda topic, payload, sender, qos, retain, props: encode_message(
        f"t/{topic}", payload, sender, qos, retain, props
    ),
    texts,
    st.binary(max_size=300),
    st.just("s"),  # one sender: one shard, so the command is the request's own bytes
    st.integers(0, 2),
    st.booleans(),
    st.lists(st.tuples(texts, texts), max_size=3).map(tuple),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(messages, min_size=1, max_size=8), st.text(max_size=8), st.integers(1, 2**64 - 1), st.booleans())
def test_the_parse_handed_over_is_the_logged_commands(
    encoded: list[bytes], producer: str, sequence: int, sync: bool
) -> None:
    request = pb.StoreBatchRequest(messages=[pb.Message.FromString(m) for m in encoded], sync=sync)
    if producer:
        request.producer_id, request.sequence = producer, sequence
    raw = request.SerializeToString()
    shards = started(raw)
    ((body, part),) = shards.expected
    assert shards.proposed == [body] and body == store_command(raw, NOW)
    command = cpb.VnodeCommand.FromString(body).store
    assert list(part.messages) == list(command.messages)
    assert list(part.encoded or ()) == list(cpb.VnodeCommandEncoded.FromString(body).store.messages) == encoded
    assert part.now_us == command.now_us == NOW
    assert part.dedup == ((command.producer_id.encode(), command.sequence) if command.producer_id else None)


def groups(depth: int) -> bytes:
    """An unknown group (field 9) nested ``depth`` deep."""
    return b"\x4b" * depth + b"\x4c" * depth


@pytest.mark.parametrize(
    "extra",
    [varint(9 << 3) + varint(1), groups(1), groups(100)],
    ids=["an unknown varint", "an unknown group", "a group nested 100 deep"],
)
def test_a_request_with_a_field_of_its_own_is_parsed_when_applied(extra: bytes) -> None:
    raw = length_delimited(MESSAGES, encode_message("a/b", b"p", "s", 1, False)) + extra
    shards = started(raw)
    assert shards.proposed == [store_command(raw, NOW)]  # logged as it came, as before
    assert shards.expected == []  # but applied parsed, on the leader too


def test_why_a_request_with_fields_of_its_own_is_not_handed_over() -> None:
    """The request parses, its command (one level deeper) does not: every replica must fail it alike."""
    raw = length_delimited(MESSAGES, encode_message("a/b", b"p", "s", 1, False)) + groups(100)
    pb.StoreBatchRequest.FromString(raw)
    with pytest.raises(Exception, match="parsing"):
        cpb.VnodeCommand.FromString(store_command(raw, NOW))


def test_a_batch_of_several_shards_is_not_handed_over() -> None:
    """Its commands are built by protobuf, one per shard: applying parses them."""
    raw = b"".join(length_delimited(MESSAGES, encode_message("a/b", b"p", f"s{i}", 1, False)) for i in range(40))
    shards = OneShard()
    shards.n_shards = 4
    service = StorageService(shards, max_payload_bytes=100, max_batch_messages=100, max_next_batch=100)  # type: ignore[arg-type]
    service.start_store(pb.StoreBatchRequest.FromString(raw), raw).finish(5.0)
    assert len(shards.proposed) == 4 and shards.expected == []


# -- the memory of proposed commands ----------------------------------------------------------------


def part(n: int) -> StorePart:
    return StorePart([], n)


def test_a_command_is_taken_once_and_only_for_equal_bytes() -> None:
    stores = ProposedStores()
    body = b"\x0a\x03abc" + varint(NOW)
    stores.remember(body, one := part(1))
    twin = b"\x0a\x03abd" + varint(NOW)  # same length, same end: same key, other bytes
    assert stores.take(bytes(twin)) is None
    stores.remember(body, one)
    assert stores.take(bytes(body)) is one  # equal bytes, another object (as the log hands them)
    assert stores.take(body) is None and len(stores) == 0


def test_taking_a_command_drops_those_remembered_before_it() -> None:
    stores = ProposedStores()
    bodies = [b"cmd-%d" % i * 3 for i in range(4)]
    for i, body in enumerate(bodies):
        stores.remember(body, part(i))
    assert stores.take(bodies[2]) is not None
    assert stores.take(bodies[0]) is None and stores.take(bodies[1]) is None  # never logged: parsed if they are
    assert stores.take(bodies[3]) is not None


def test_a_refused_proposal_is_forgotten() -> None:
    stores = ProposedStores()
    body = b"refused" * 3
    stores.remember(body, part(1))
    stores.forget(body)
    assert len(stores) == 0


def test_old_commands_and_too_many_bytes_are_dropped() -> None:
    clock = [0.0]
    stores = ProposedStores(keep_s=10.0, max_bytes=100, clock=lambda: clock[0])
    stores.remember(b"a" * 40, part(1))
    stores.remember(b"b" * 40, part(2))
    stores.remember(b"c" * 40, part(3))  # 120 bytes: the oldest goes
    assert stores.take(b"a" * 40) is None
    assert len(stores) == 2
    clock[0] = 11.0
    assert stores.take(b"x" * 3) is None and len(stores) == 0  # a follower's apply drops them when too old
    stores.remember(b"d" * 500, big := part(4))  # the newest is kept whatever its size
    assert stores.take(b"d" * 500) is big


# -- a replica applying with and without ----------------------------------------------------------------


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[VnodeReplica, VnodeReplica]]:
    with vnode_replica(str(tmp_path / "told")) as told, vnode_replica(str(tmp_path / "parsing")) as parsing:
        yield told, parsing


def request(topic: str, n: int, producer: str = "", sequence: int = 0) -> bytes:
    raw = b"".join(
        length_delimited(MESSAGES, encode_message(f"{topic}/{i}", b"p%d" % i, "s", 1, i % 2 == 0, (("k", "v"),)))
        for i in range(n)
    )
    return pb.StoreBatchRequest(producer_id=producer, sequence=sequence).SerializeToString() + raw


def proposed(raw: bytes, now: int) -> tuple[bytes, StorePart]:
    ((body, parsed),) = started(raw, now).expected
    return body, parsed


class NoParse:
    def FromString(self, body: bytes) -> None:
        pytest.fail("the replica parsed a command it was told")


def contents(replica: VnodeReplica) -> list[Any]:
    with replica.reading() as storage:
        stored = []
        for ref in storage.get_streams(["#"], 0):
            state = storage.make_iterator(ref.generation, ref.stream, "#", 0)
            stored.extend(storage.next(state, 10_000).entries)
    feed = [(p.first, list(p.encoded), [m.topic for m in p.messages]) for p in replica.feed._parts]
    return [sorted(stored), feed, replica.stored_messages, replica.stored_bytes, replica.storage.last_ts]


def test_a_replica_told_stores_what_one_parsing_stores(
    replicas: tuple[VnodeReplica, VnodeReplica], monkeypatch: pytest.MonkeyPatch
) -> None:
    told, parsing = replicas
    entries = [
        [proposed(request("a", 3, "p", 1), 2_000)],
        [proposed(request("b", 2, "p", 2), 3_000), proposed(request("b", 2, "p", 2), 3_001)],  # a retry: deduplicated
        [proposed(request("c", 1), 4_000), proposed(request("d", 4, "q", 1), 4_001)],
    ]
    for index, entry in enumerate(entries, 2):
        for body, parsed in entry:
            told.expect_store(body, parsed)
        bodies = [body for body, _ in entry]
        logged = [bytes(bodies[0])] if len(bodies) == 1 else batching.decode(batching.encode(bodies))
        with monkeypatch.context() as patched:  # the told replica parses nothing
            patched.setattr(vnode_module, "cpb", SimpleNamespace(VnodeCommand=NoParse(), VnodeCommandEncoded=NoParse()))
            told_results = [told.apply(logged[0], index)] if len(logged) == 1 else told.apply_batch(logged, index)
        parsing_results = [parsing.apply(logged[0], index)] if len(logged) == 1 else parsing.apply_batch(logged, index)
        assert told_results == parsing_results
    assert len(told.proposed) == 0
    assert contents(told) == contents(parsing)
    assert told.stored_messages == 10


def test_a_replica_told_of_other_bytes_parses_what_it_applies(replicas: tuple[VnodeReplica, VnodeReplica]) -> None:
    told, parsing = replicas
    body, _ = proposed(request("a", 2), 2_000)
    other, other_parsed = proposed(request("z", 2), 2_000)  # the same length and end, other topics
    assert (len(other), other[-16:]) == (len(body), body[-16:]) and other != body
    told.expect_store(other, other_parsed)
    assert told.apply(body, 2) == parsing.apply(body, 2)
    assert contents(told) == contents(parsing)
