"""Retention limits by size and count per topic filter (issue 47) on a real 3-node cluster.

A rule's ``max_messages``, ``max_bytes`` and ``max_messages_per_topic`` count
the messages it decides, per shard (a shard keeps the filter-wide limits
divided by the number of shards: 4 here). Each vnode's leader runs a pass
every ``retention_check_interval_s`` (1 s here): discard=old logs the keys
over a limit, which every replica deletes; discard=new refuses the stores
over them (LIMIT_REACHED) until deletes make room.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from mqds.cli import main
from mqds.client import Client, Message
from mqds.client.errors import FailedPreconditionError, InvalidArgumentError, PartialBatchError, Reason
from mqds.protocol.retention import parse_rule_limits
from mqds.protocol.sharding import shard_of
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.waiting import wait_until
from mqds.v1 import cluster_pb2 as clpb
from mqds.v1 import cluster_pb2_grpc as clpb_grpc
from mqds.v1 import storage_pb2 as spb
from mqds.v1 import storage_pb2_grpc as spb_grpc

pytestmark = pytest.mark.integration

N_SHARDS = 4
SENDER = "lim-sender"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(
        tmp_path_factory.mktemp("limits") / "c", 3, n_shards=N_SHARDS, args=["--retention-check-interval-s", "1"]
    ) as c:
        c.start()
        yield c


@pytest.fixture
def endpoints(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> str:
    """The nodes' addresses for the command line, which presents the cluster secret (an admin's)."""
    monkeypatch.setenv("MQDS_CLUSTER_SECRET", cluster.secret)
    return ",".join(cluster.addresses)


def kept(c: Client, topic_filter: str) -> dict[str, list[int]]:
    """Each topic's message numbers (the payloads), in the order stored."""
    out: dict[str, list[int]] = {}
    for m in c.replay(topic_filter):
        out.setdefault(m.topic, []).append(int(m.payload[:8]))
    for numbers in out.values():
        numbers.sort()
    return out


def settles(c: Client, topic_filter: str, want: dict[str, list[int]], timeout_s: float = 30) -> None:
    """Wait until the filter holds exactly ``want`` (bounded); on a timeout, say what it held."""
    seen: list[dict[str, list[int]]] = [{}]

    def check() -> bool:
        seen[0] = kept(c, topic_filter)
        return seen[0] == want

    try:
        wait_until(f"{topic_filter!r} trimmed to its limits", check, timeout_s)
    except TimeoutError as err:
        raise AssertionError(f"{err}: it holds {seen[0]}, not {want}") from None


def store(c: Client, topic: str, numbers: range, size: int = 8) -> None:
    c.store_batch(
        [Message(topic=topic, payload=str(n).zfill(8).encode().ljust(size, b"."), sender=SENDER) for n in numbers]
    )


def test_discard_old_trims_busy_filters_to_their_limits_and_keeps_a_quiet_one(cluster: LocalCluster) -> None:
    shard = shard_of(SENDER, N_SHARDS)
    with cluster.admin_client() as c:
        for topic in ("lim/busy/a", "lim/busy/b", "lim/quiet/x"):
            store(c, topic, range(50))
        store(c, "lim/cap/x", range(0, 60, 2))
        store(c, "lim/cap/y", range(1, 60, 2))
        store(c, "lim/bytes/z", range(30), size=1000)
        rules = [
            parse_rule_limits("lim/busy/#=keep,per_topic=10"),
            # 40 over 4 shards: the sender's shard keeps 10.
            parse_rule_limits("lim/cap/#=keep,max_msgs=40"),
            # 42,000 bytes over 4 shards: 10,500 a shard, ten records of a 1,000-byte payload and no more.
            parse_rule_limits("lim/bytes/#=keep,max_bytes=42000,discard=old"),
        ]
        c.set_retention(rules, default_s=0)
        want = {
            "lim/busy/a": list(range(40, 50)),
            "lim/busy/b": list(range(40, 50)),
            "lim/quiet/x": list(range(50)),
        }
        settles(
            c,
            "lim/+/+",
            {
                **want,
                # Filter-wide: the newest 10 of the rule's messages, whichever topic (y's were stored last).
                "lim/cap/y": list(range(41, 60, 2)),
                "lim/bytes/z": list(range(20, 30)),
            },
        )
        # New messages: the newest are kept again, the quiet filter still keeps all it has.
        store(c, "lim/busy/a", range(50, 55))
        settles(c, "lim/busy/#", {"lim/busy/a": list(range(45, 55)), "lim/busy/b": list(range(40, 50))})
        assert kept(c, "lim/quiet/#") == {"lim/quiet/x": list(range(50))}
        c.set_retention([], default_s=0)
    # Every replica removed the same messages: the replicas' digests agree, at the same applied index.
    cluster.assert_replicas_identical(shards=[shard])


def test_a_new_leader_goes_on_trimming_and_the_restarted_replica_agrees(cluster: LocalCluster) -> None:
    shard = shard_of(SENDER, N_SHARDS)
    with cluster.admin_client() as c:
        c.set_retention([parse_rule_limits("lim/kill/#=keep,per_topic=5")], default_s=0)
        store(c, "lim/kill/a", range(20))
        settles(c, "lim/kill/#", {"lim/kill/a": list(range(15, 20))})
        leader = cluster.wait_for_leader(shard)
        cluster.kill(leader)
        try:
            store(c, "lim/kill/a", range(20, 40))  # through the new leader
            settles(c, "lim/kill/#", {"lim/kill/a": list(range(35, 40))})
        finally:
            cluster.start_node(leader)
        c.set_retention([], default_s=0)
    cluster.assert_replicas_identical(shards=[shard])


def test_discard_new_refuses_a_store_over_the_limit_until_deletes_make_room(cluster: LocalCluster) -> None:
    with cluster.admin_client() as c:
        # 20 over 4 shards: 5 a shard.
        c.set_retention([parse_rule_limits("lim/new/#=keep,max_msgs=20,discard=new")], default_s=0)
        store(c, "lim/new/t", range(5))
        extra = 0

        def refused() -> FailedPreconditionError | None:
            nonlocal extra
            try:
                store(c, "lim/new/t", range(100 + extra, 101 + extra))
            except FailedPreconditionError as err:
                return err
            extra += 1  # the leader's first pass had not counted the shard yet
            return None

        err = wait_until("a store over the limit refused", refused, 30, interval_s=0.3)
        assert err.reason is Reason.LIMIT_REACHED and not err.retriable
        assert "retention rule 1 ('lim/new/#')" in err.message and "discard=new" in err.message
        assert sum(len(v) for v in kept(c, "lim/new/#").values()) == 5 + extra
        # Refused at once, not retried until the deadline; the other topics are stored.
        began = time.monotonic()
        with pytest.raises(FailedPreconditionError):
            store(c, "lim/new/t", range(200, 201))
        assert time.monotonic() - began < 5
        store(c, "lim/other/t", range(3))
        # In a batch, only the rule's messages are refused; the others are stored.
        mixed = [Message(topic=t, payload=b"m", sender=SENDER) for t in ("lim/other/u", "lim/new/t", "lim/other/u")]
        with pytest.raises(PartialBatchError) as partial:
            c.store_batch(mixed)
        assert [m.topic for m in partial.value.stored] == ["lim/other/u", "lim/other/u"]
        assert [(m.topic, e.reason) for m, e in partial.value.failed] == [("lim/new/t", Reason.LIMIT_REACHED)]
        # The raw status: RESOURCE_EXHAUSTED.
        with grpc.insecure_channel(
            cluster.nodes[cluster.wait_for_leader(shard_of(SENDER, N_SHARDS))].address
        ) as channel:
            request = spb.StoreBatchRequest(messages=[spb.Message(topic="lim/new/t", payload=b"1", sender=SENDER)])
            with pytest.raises(grpc.RpcError) as raw:
                spb_grpc.StorageStub(channel).StoreBatch(request, timeout=10)
            assert raw.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Deletes make room: the next pass counts again and stores are taken.
        c.delete_messages("lim/new/#")

        def taken() -> bool:
            try:
                store(c, "lim/new/t", range(300, 301))
            except FailedPreconditionError:
                return False
            return True

        wait_until("a store taken again after the delete", taken, 30, interval_s=0.3)
        c.set_retention([], default_s=0)


def test_bad_limits_are_refused_naming_the_rule_and_change_nothing(
    cluster: LocalCluster, endpoints: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with cluster.admin_client() as c:
        c.set_retention([parse_rule_limits("lim/good/#=7d,max_msgs=100")], default_s=0)
        before = wait_until("the policy applied", c.retention, 30)
        for text, says in (
            ("lim/a/#=1d,discard=sometimes", "discard='sometimes' is not a discard policy"),
            ("lim/a/#=1d,max_msgs=-5", "max_msgs='-5' is not a count"),
            ("lim/a/#=1d,max_bytes=lots", "'lots' is not a size"),
            ("lim/a/#=1d,max_msgs=10000000000000", "max_msgs=10000000000000 is over the most"),
            ("lim/a/#=1d,discard=new", "a discard policy without a limit"),
            ("lim/a/#=1d,max_msgs=10,per_topic=20", "per_topic=20 is over max_msgs=10"),
            ("lim/a/#=1d,per_topic=20,discard=new", "discard=new cannot go with per_topic"),
        ):
            assert main(["--endpoints", endpoints, "retention", "set", "ok/#=1d", text]) == 2, text
            err = capsys.readouterr().err
            assert says in err, (text, err)
            assert "lim/a/#" in err, err  # the rule is named
        with pytest.raises(InvalidArgumentError, match=r"retention rule 2 \('b/#'\): max_bytes=.* is over the most"):
            c.set_retention([("a/#", 10), clpb.RetentionRule(topic_filter="b/#", max_bytes=2**60)])
        # The node checks too (a client that skips the checks): INVALID_ARGUMENT naming the rule.
        with grpc.insecure_channel(cluster.addresses[0]) as channel:
            stub = clpb_grpc.ClusterStub(channel)
            for rule in (
                clpb.RetentionRule(topic_filter="x/#", max_messages=10, discard=7),  # type: ignore[arg-type]
                clpb.RetentionRule(topic_filter="x/#", max_messages=10**13),
                clpb.RetentionRule(topic_filter="x/#", max_messages_per_topic=5, discard=clpb.RETENTION_DISCARD_NEW),
            ):
                bad = clpb.SetRetentionRequest(
                    policy=clpb.RetentionPolicy(rules=[clpb.RetentionRule(topic_filter="ok/#"), rule])
                )
                with pytest.raises(grpc.RpcError) as refused:
                    stub.SetRetention(bad, timeout=10, metadata=[("x-mqds-cluster-secret", cluster.secret)])
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "retention rule 2 ('x/#')" in (refused.value.details() or "")
        assert c.retention() == before  # nothing changed
        c.set_retention([], default_s=0)


def test_cli_sets_and_shows_limits(cluster: LocalCluster, endpoints: str, capsys: pytest.CaptureFixture[str]) -> None:
    rule = "lim/cli/#=7d,max_msgs=1000,max_bytes=64MiB,per_topic=10,discard=old"
    assert main(["--endpoints", endpoints, "retention", "set", rule, "lim/new/#=keep,max_bytes=1GB,discard=new"]) == 0
    capsys.readouterr()
    assert main(["--endpoints", endpoints, "retention", "show"]) == 0
    out = capsys.readouterr().out
    assert "max_msgs=1000,max_bytes=64MiB,per_topic=10,discard=old" in out
    assert "max_bytes=1000000000,discard=new" in out and "7d" in out
    with cluster.admin_client() as c:
        policy = c.retention()
        assert policy is not None
        first = policy.rules[0]
        assert (first.max_messages, first.max_bytes, first.max_messages_per_topic) == (1000, 64 * 2**20, 10)
        assert first.discard == clpb.RETENTION_DISCARD_OLD
        assert policy.rules[1].discard == clpb.RETENTION_DISCARD_NEW
        c.set_retention([], default_s=0)
    with pytest.raises(SystemExit):
        main(["retention", "set", "--help"])
    assert "discard=new" in capsys.readouterr().out
