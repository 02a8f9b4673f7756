"""The Prometheus metrics of a real 3-node cluster, scraped over HTTP while it stores, serves, fails over and refuses.

One cluster story (module fixture) and several checks of what the scrapes
show: stored counts per vnode, one leader per vnode, leader changes and
elections after a leader is killed, the leader's view of a dead follower,
applied indexes converging after its restart, refused calls by reason,
latency histograms; and that the Grafana dashboard and docs/operations.md use and
document exactly what a node exports.
"""

from __future__ import annotations

import json
import math
import re
import socket
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from repo_paths import ROOT

from mqds.client import Client, Message
from mqds.protocol.errors import Reason, from_rpc_error
from mqds.protocol.sharding import shard_of
from mqds.server.metrics import REQUEST_BUCKETS
from mqds.tools.local_cluster import LocalCluster
from mqds.tools.processes import NodeProcess
from mqds.tools.waiting import wait_until
from mqds.v1 import storage_pb2 as pb
from mqds.v1 import storage_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DASHBOARD = ROOT / "deploy" / "grafana" / "mqds-dashboard.json"
N_SHARDS = 4


class Scrape:
    """One scrape of a node's /metrics: its families and samples."""

    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            self.samples.extend((s.name, s.labels, s.value) for s in family.samples)

    def get(self, name: str, **labels: str) -> float | None:
        """The value of the one sample with these labels (None if there is none)."""
        found = [v for n, lab, v in self.samples if n == name and all(lab.get(k) == w for k, w in labels.items())]
        assert len(found) <= 1, f"{name}{labels}: {len(found)} samples"
        return found[0] if found else None

    def by(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """Samples of ``name`` matching ``labels``, keyed by the value of ``label``."""
        return {
            lab[label]: v
            for n, lab, v in self.samples
            if n == name and label in lab and all(lab.get(k) == w for k, w in labels.items())
        }

    def exported(self, name: str) -> bool:
        """Whether a query may use ``name``: a sample name, or a family's name with its type's suffix."""
        if any(n == name for n, _, _ in self.samples):
            return True
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
        return any(
            name == family + suffix for family, kind in self.types.items() for suffix in suffixes.get(kind, ("",))
        )


def scrape(proc: NodeProcess) -> Scrape:
    assert proc.metrics_url is not None
    with urllib.request.urlopen(proc.metrics_url, timeout=5) as response:
        assert response.status == 200
        return Scrape(response.read().decode())


def scrape_all(cluster: LocalCluster) -> dict[str, Scrape]:
    return {node_id: scrape(cluster.nodes[node_id]) for node_id in cluster.live()}


def leaders(scrapes: dict[str, Scrape], shard: str) -> list[str]:
    return [n for n, s in scrapes.items() if s.get("mqds_raft_role", shard=shard, role="leader") == 1.0]


def batch(sender: str, start: int, count: int) -> list[Message]:
    return [
        Message(topic=f"m/{sender}/{i}", payload=b"p" * 100, sender=sender, qos=1) for i in range(start, start + count)
    ]


@dataclass
class Story:
    cluster: LocalCluster
    client: Client
    written: Counter[int]
    shard: int
    victim: str
    before_kill: dict[str, Scrape]


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    """A cluster that stored, replayed, refused bad calls, lost the leader of one vnode and stored again."""
    # No leader balancing: leadership stays where the story put it.
    with LocalCluster(
        tmp_path_factory.mktemp("metrics") / "c",
        3,
        n_shards=N_SHARDS,
        metrics=True,
        args=["--leader-balance-interval-s", "0"],
    ) as cluster:
        cluster.start()
        client = cluster.client(timeout_s=20)
        senders = [f"dev-{i}" for i in range(12)]
        assert {shard_of(s, N_SHARDS) for s in senders} == set(range(N_SHARDS))
        written: Counter[int] = Counter()
        for round_ in range(3):
            for sender in senders:
                client.store_batch(batch(sender, round_ * 40, 40))
                written[shard_of(sender, N_SHARDS)] += 40
        assert sum(1 for _ in client.replay("m/#")) == sum(written.values())

        shard = shard_of(senders[0], N_SHARDS)
        victim = cluster.wait_for_leader(shard)
        follower = next(n for n in cluster.replicas(shard) if n != victim)
        _refused_calls(cluster, victim, follower, senders[0])
        before_kill = scrape_all(cluster)

        cluster.kill(victim)
        cluster.wait_for_leader(shard, exclude=[victim])
        for sender in senders:
            client.store_batch(batch(sender, 1000, 10))
            written[shard_of(sender, N_SHARDS)] += 10
        yield Story(cluster, client, written, shard, victim, before_kill)
        client.close()


def _refused_calls(cluster: LocalCluster, leader: str, follower: str, sender: str) -> None:
    """Bad input to the leader, and a write to a follower: each answered with its reason."""
    with grpc.insecure_channel(cluster.nodes[leader].address) as channel:
        stub = pb_grpc.StorageStub(channel)
        bad = pb.StoreBatchRequest(messages=[pb.Message(topic="a/+", payload=b"x", sender=sender)])
        for request, call, reason in (
            (bad, stub.StoreBatch, Reason.INVALID_TOPIC),
            (pb.NextRequest(batch_size=0), stub.Next, Reason.INVALID_REQUEST),
        ):
            with pytest.raises(grpc.RpcError) as exc:
                call(request, timeout=5)
            assert from_rpc_error(exc.value).reason is reason
    with grpc.insecure_channel(cluster.nodes[follower].address) as channel:
        write = pb.StoreBatchRequest(messages=[pb.Message(topic="a/b", payload=b"x", sender=sender)])
        with pytest.raises(grpc.RpcError) as exc:
            pb_grpc.StorageStub(channel).StoreBatch(write, timeout=5)
        assert from_rpc_error(exc.value).reason is Reason.NOT_LEADER


def test_stored_counts_roles_and_a_leader_change(story: Story) -> None:
    cluster = story.cluster
    label = str(story.shard)
    survivors = cluster.live()
    assert story.victim not in survivors

    def one_leader_everywhere() -> dict[str, Scrape] | None:
        scrapes = scrape_all(cluster)
        ok = all(len(leaders(scrapes, str(s))) == 1 for s in [*range(N_SHARDS), "meta"])
        return scrapes if ok else None

    scrapes = wait_until("exactly one leader per vnode", one_leader_everywhere, 20)
    # What the leaders stored is what was written, vnode by vnode (they never restarted).
    for shard in range(N_SHARDS):
        (leader,) = leaders(scrapes, str(shard))
        assert scrapes[leader].get("mqds_stored_messages_total", shard=str(shard)) == story.written[shard]
        assert scrapes[leader].get("mqds_stored_bytes_total", shard=str(shard)) > 100 * story.written[shard]
        assert scrapes[leader].get("mqds_storage_generations", shard=str(shard)) == 1.0
    total = sum(
        scrapes[leaders(scrapes, str(shard))[0]].get("mqds_stored_messages_total", shard=str(shard)) or 0
        for shard in range(N_SHARDS)
    )
    assert total == sum(story.written.values())

    # Every survivor saw the killed leader replaced; someone ran an election for it.
    for node_id in survivors:
        before = story.before_kill[node_id].get("mqds_raft_leader_changes_total", shard=label) or 0
        assert scrapes[node_id].get("mqds_raft_leader_changes_total", shard=label) >= before + 1, node_id
    elections_before = sum(story.before_kill[n].get("mqds_raft_elections_total", shard=label) or 0 for n in survivors)
    elections_after = sum(scrapes[n].get("mqds_raft_elections_total", shard=label) or 0 for n in survivors)
    assert elections_after >= elections_before + 1
    term_before = max(s.get("mqds_raft_term", shard=label) or 0 for s in story.before_kill.values())
    assert all(scrapes[n].get("mqds_raft_term", shard=label) > term_before for n in survivors)

    # The new leader sees the dead replica falling behind, and the link to it down.
    (leader,) = leaders(scrapes, label)
    lag = scrapes[leader].by("mqds_raft_follower_lag_entries", "follower", shard=label)
    assert lag[story.victim] > 0
    wait_until(
        "the link to the killed node reported down",
        lambda: all(scrape(cluster.nodes[n]).get("mqds_raft_peer_up", peer=story.victim) == 0.0 for n in survivors),
        20,
    )

    # Back again: it catches up, and every replica applies up to the same index.
    cluster.restart(story.victim)

    def converged() -> dict[str, Scrape] | None:
        now = scrape_all(cluster)
        for shard in [str(s) for s in range(N_SHARDS)] + ["meta"]:
            applied = {now[n].get("mqds_raft_applied_index", shard=shard) for n in now}
            commit = {now[n].get("mqds_raft_commit_index", shard=shard) for n in now}
            if len(now) != 3 or len(applied) != 1 or applied != commit or len(leaders(now, shard)) != 1:
                return None
            # The leader's view: every follower has acknowledged its whole log.
            lag = now[leaders(now, shard)[0]].by("mqds_raft_follower_lag_entries", "follower", shard=shard)
            if set(lag) != set(now) - set(leaders(now, shard)) or any(lag.values()):
                return None
        return now

    scrapes = wait_until("applied indexes converging", converged, 30, interval_s=0.3)
    for node_id, s in scrapes.items():
        assert s.get("mqds_node_ready") == 1.0, node_id
        assert s.get("mqds_node_info", node=node_id) == 1.0
        assert all(v == 0 for v in s.by("mqds_raft_catch_up_lag_entries", "shard").values())
        assert s.get("mqds_raft_journal_bytes", shard=label) > 0
        assert s.get("mqds_raft_wal_bytes") > 0
        assert (
            sum(s.by("mqds_storage_generation_bytes", "shard").values())
            + sum(s.by("mqds_storage_memtable_bytes", "shard").values())
            > 0
        )


def test_refused_calls_are_counted_by_reason(story: Story) -> None:
    scrapes = scrape_all(story.cluster)
    rejected: Counter[tuple[str, str]] = Counter()
    for s in scrapes.values():
        for name, labels, value in s.samples:
            if name == "mqds_rejected_requests_total":
                rejected[(labels["method"], labels["reason"])] += int(value)
    # The killed leader took its own counts with it: the NOT_LEADER went to a survivor,
    # the bad input to the victim, whose fresh process counts from 0.
    assert rejected[("StoreBatch", "NOT_LEADER")] >= 1
    before = story.before_kill[story.victim]
    assert (
        before.get("mqds_rejected_requests_total", service="Storage", method="StoreBatch", reason="INVALID_TOPIC") == 1
    )
    assert before.get("mqds_rejected_requests_total", service="Storage", method="Next", reason="INVALID_REQUEST") == 1


def test_latency_histograms_have_their_buckets(story: Story) -> None:
    # A replay now: the node that served the first one may be the one killed since.
    assert sum(1 for _ in story.client.replay("m/#")) == sum(story.written.values())
    scrapes = scrape_all(story.cluster)
    for method in ("StoreBatch", "Next"):
        counts = [
            s.get("mqds_request_duration_seconds_count", service="Storage", method=method) or 0
            for s in scrapes.values()
        ]
        assert sum(counts) > 0, method
        busiest = max(
            scrapes.values(),
            key=lambda s: s.get("mqds_request_duration_seconds_count", service="Storage", method=method) or 0,
        )
        buckets = busiest.by("mqds_request_duration_seconds_bucket", "le", service="Storage", method=method)
        assert {float(le) for le in buckets} == {*REQUEST_BUCKETS, math.inf}
        assert buckets["+Inf"] == busiest.get("mqds_request_duration_seconds_count", service="Storage", method=method)
        assert sorted(buckets.values()) == [buckets[k] for k in sorted(buckets, key=lambda le: float(le))]
    assert sum(s.get("mqds_client_connections") or 0 for s in scrapes.values()) >= 1


def test_the_dashboard_uses_only_what_nodes_export(story: Story) -> None:
    scrapes = list(scrape_all(story.cluster).values())
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) > 20
    used = {name for expr in exprs for name in re.findall(r"\bmqds_[a-z0-9_]+", expr)}
    missing = sorted(name for name in used if not any(s.exported(name) for s in scrapes))
    assert not missing, f"the dashboard queries metrics no node exports: {missing}"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert "datasource" in variables
    assert all(p.get("datasource", {}).get("uid") == "${datasource}" for p in dashboard["panels"] if p["type"] != "row")


def test_the_readme_documents_every_metric(story: Story) -> None:
    readme = (ROOT / "docs" / "operations.md").read_text()
    section = readme.split("## Metrics and health", 1)[1].split("\n## ", 1)[0]
    families: set[str] = set()
    for s in scrape_all(story.cluster).values():
        families |= {name + ("_total" if kind == "counter" else "") for name, kind in s.types.items()}
    undocumented = sorted(name for name in families if f"`{name}`" not in section)
    assert not undocumented, f"docs/operations.md 'Metrics and health' lacks {undocumented}"


def test_a_metrics_port_in_use_is_a_startup_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = NodeProcess(tmp_path / "n1", metrics_port=port).launch()
        assert proc.proc is not None
        assert proc.proc.wait(timeout=30) == 1
    assert f"cannot serve metrics on 127.0.0.1:{port} (metrics_listen)" in proc.output()
