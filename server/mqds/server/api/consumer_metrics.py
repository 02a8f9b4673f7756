"""Consumer lag as Prometheus metrics, measured when scraped, with a bounded set of series.

Two kinds of consumer get series of their own, each kind up to
``consumer_lag_metric_top`` of them (those furthest behind), the rest summed
into ``consumer="_other"``:

- ``share_group``: a share group (``consumer="$share/<group>/<filter>"``),
  reported by the node leading the shard that keeps it, measured over the
  shards this node holds a replica of (every shard while each node holds all
  of them: nodes <= replication_factor), from its own replicas' applied state.
- ``push``: the push subscriptions (Follow calls) this node serves, one
  series per (filter, shard) (``consumer="<filter>"``, ``shard``): the
  furthest behind of them there.

Read positions are not exported one by one (a series per clientid would be
unbounded): ``mqds consumers`` lists them with their lag.
``mqds_consumers{kind}`` counts what was measured. Each count stops at
:data:`CAP` messages per consumer and shard, and one scrape counts at most
:data:`mqds.server.api.consumers.LAG_SCAN_BUDGET` messages; a figure that
stopped there is a lower bound (``mqds_consumer_lag_capped`` says so).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mqds.protocol.errors import MqdsError
from mqds.protocol.share_groups import position_client
from mqds.server.api.consumers import LAG_SCAN_BUDGET
from mqds.server.api.follow_registry import FollowCalls
from mqds.server.storage.consumers import ConsumerQuery
from mqds.server.storage.lag import Lag, measure

log = logging.getLogger(__name__)

CAP = 10_000
"""Messages counted per consumer and shard."""
MAX_GROUPS = 1_000
"""Share groups one scrape measures, at most (in the order the shards keep them)."""
OTHER = "_other"


class _Observed(Protocol):
    """What the collector reads of the node."""

    @property
    def follow_calls(self) -> FollowCalls: ...

    def hosted_vnodes(self) -> list[tuple[int, Any]]: ...


@dataclass
class _Figure:
    kind: str
    consumer: str
    shard: str
    messages: int
    seconds: float
    capped: bool


class ConsumerLagCollector(Collector):
    """The consumer lag families (see the module); ``top`` is ``consumer_lag_metric_top``."""

    def __init__(self, node: _Observed, top: int, clock: Callable[[], int] | None = None) -> None:
        self.node = node
        self.top = top
        self.clock = clock or (lambda: time.time_ns() // 1000)

    def collect(self) -> Iterator[Metric]:
        budget = [LAG_SCAN_BUDGET]
        now = self.clock()
        vnodes = dict(self.node.hosted_vnodes())
        figures: list[_Figure] = []
        try:
            figures += self._share_groups(vnodes, now, budget)
            figures += self._push(vnodes, now, budget)
        except Exception:  # a scrape never fails for one consumer: what was measured is reported
            log.exception("measuring consumer lag for the metrics failed")
        counts = GaugeMetricFamily(
            "mqds_consumers", "Consumers this node measured for the lag metrics, by kind", labels=["kind"]
        )
        labels = ["kind", "consumer", "shard"]
        messages = GaugeMetricFamily(
            "mqds_consumer_lag_messages",
            f"Messages a consumer is behind its filter's head (counted up to {CAP:,} per shard); share_group: "
            "over the shards this node holds, shard empty; push: the furthest behind subscription of the filter on "
            'the shard; consumer="_other": the sum of those without a series of their own',
            labels=labels,
        )
        seconds = GaugeMetricFamily(
            "mqds_consumer_lag_seconds",
            "How long the oldest message a consumer has not read has waited (0: none); _other: the largest",
            labels=labels,
        )
        capped = GaugeMetricFamily(
            "mqds_consumer_lag_capped",
            "1 when the consumer's message count stopped at its cap (or the scrape's budget): at least that many",
            labels=labels,
        )
        for kind in ("share_group", "push"):
            mine = sorted((f for f in figures if f.kind == kind), key=lambda f: (f.messages, f.seconds), reverse=True)
            counts.add_metric([kind], len(mine))
            shown, rest = mine[: self.top], mine[self.top :]
            for f in shown:
                key = [kind, f.consumer, f.shard]
                messages.add_metric(key, f.messages)
                seconds.add_metric(key, f.seconds)
                capped.add_metric(key, 1.0 if f.capped else 0.0)
            if rest:
                key = [kind, OTHER, ""]
                messages.add_metric(key, sum(f.messages for f in rest))
                seconds.add_metric(key, max(f.seconds for f in rest))
                capped.add_metric(key, 1.0 if any(f.capped for f in rest) else 0.0)
        yield from (counts, messages, seconds, capped)

    def _measure(self, storage: Any, topic_filter: str, after_us: int, now: int, budget: list[int], qos0: bool) -> Lag:
        lag = measure(storage, topic_filter, after_us, max(1, min(CAP, budget[0])), now, qos0)
        budget[0] -= lag.messages
        return lag if budget[0] > 0 else Lag(lag.messages, True, lag.oldest_us)

    def _share_groups(self, vnodes: dict[int, Any], now: int, budget: list[int]) -> list[_Figure]:
        figures: list[_Figure] = []
        for _, vnode in sorted(vnodes.items()):
            if len(figures) >= MAX_GROUPS:
                break
            try:
                if not vnode.group.is_leader:
                    continue
                with vnode.replica.reading() as storage:
                    page = storage.consumers.share_groups(b"", ConsumerQuery(MAX_GROUPS - len(figures)), now)
            except MqdsError:
                continue
            for group in page.entries:
                position = group.position
                total, waited, stopped = 0, 0.0, False
                for message_shard, other in sorted(vnodes.items()):
                    after = 0
                    if position is not None:
                        after = max(position.acked_us.get(message_shard, 0), position.start_us)
                    try:
                        with other.replica.reading() as storage:
                            lag = self._measure(storage, group.topic_filter, after, now, budget, False)
                    except MqdsError:
                        continue
                    total += lag.messages
                    stopped = stopped or lag.at_least
                    if lag.oldest_us:
                        waited = max(waited, max(0, now - lag.oldest_us) / 1e6)
                name = f"{position_client(group.group)}/{group.topic_filter}"
                figures.append(_Figure("share_group", name, "", total, waited, stopped))
        return figures

    def _push(self, vnodes: dict[int, Any], now: int, budget: list[int]) -> list[_Figure]:
        furthest: dict[tuple[str, int], _Figure] = {}
        for place in self.node.follow_calls.snapshot():
            vnode = vnodes.get(place.shard)
            if vnode is None:
                continue
            try:
                with vnode.replica.reading() as storage:
                    lag = self._measure(storage, place.topic_filter, place.position_us, now, budget, True)
            except MqdsError:
                continue
            waited = max(0, now - lag.oldest_us) / 1e6 if lag.oldest_us else 0.0
            figure = _Figure("push", place.topic_filter, str(place.shard), lag.messages, waited, lag.at_least)
            known = furthest.get((place.topic_filter, place.shard))
            if known is None or (figure.messages, figure.seconds) > (known.messages, known.seconds):
                furthest[(place.topic_filter, place.shard)] = figure
        return list(furthest.values())
