"""Server metrics through ``prometheus-client``, rendered in the Prometheus text format 0.0.4.

Each server keeps its own ``CollectorRegistry`` (one process may hold many apps,
as the tests do): counters and histograms the routes update, plus gauges read at
scrape time. What is truly process-wide lives in prometheus-client's default
registry and follows every server's own metrics on ``/metrics``: the process
and Python runtime collectors (``process_*``, ``python_*``) and the model
relays' totals (``harbor_exec_relay_*``, registered by ``harbor_exec.network.relay``)
and the package cache's (``harbor_exec_package_cache_*``: hits, misses, bytes by source,
stored bytes, bound; ``harbor_exec.network.packages.cache``).

The hot path stays cheap: an observation is one prometheus-client ``inc`` or
``observe``; labelled children are looked up once and kept.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Final

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Importing the relay registers its process-wide totals (harbor_exec_relay_*), and the
# package cache's module its own (harbor_exec_package_cache_*).
import harbor_exec.network.packages.cache
import harbor_exec.network.relay  # noqa: F401
from harbor_exec.protocol import NodeSlots

__all__ = [
    "DURATION_BUCKETS",
    "FAILURE_ORIGIN",
    "PROMETHEUS_CONTENT_TYPE",
    "REWARD_BUCKETS",
    "ServerMetrics",
    "package_cache_figures",
]

# What generate_latest writes (prometheus-client names it CONTENT_TYPE_PLAIN_0_0_4).
PROMETHEUS_CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; covers in-process workflows (ms) up to container trials (minutes).
DURATION_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
)  # fmt: skip

#: Rewards (most tasks score in [0, 1]; below 0 counts in the first bucket).
REWARD_BUCKETS: Final = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

#: Whose a failure is, by its category: the agent's (the model's doing: its errors and
#: timeouts), the infrastructure's (the server, its engine, a provider's API), or the
#: client's (a request that cannot run, a lease nobody renewed).
FAILURE_ORIGIN: Final = {
    "agent_error": "agent",
    "timeout": "agent",
    "internal_error": "infrastructure",
    "http_error": "infrastructure",
    "validation_error": "client",
    "lease_expired": "client",
}

Gauges = Mapping[str, tuple[str, float | int | None]]

# Per-node series (multi-node executors): metric name -> (help, field of a /queue node).
NODE_GAUGES: Final = (
    ("harbor_exec_node_up", "1 while the node is alive.", "alive"),
    ("harbor_exec_node_slots", "Trial slots the node offers.", "slots"),
    ("harbor_exec_node_slots_in_use", "Trial slots in use on the node.", "in_use"),
)


class _ScrapeTime(Collector):
    """What the server reads when scraped: the trajectory writer's drop count and
    the gauges handed to the current ``render`` call."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self.gauges: Gauges = {}
        self.nodes: Iterable[NodeSlots] = ()

    def collect(self) -> Iterable[Metric]:
        yield CounterMetricFamily(
            "harbor_exec_trajectories_dropped",
            "Trajectory files skipped because the writer was backlogged or failed.",
            value=self._metrics.trajectories_dropped,
        )
        for name, (help_text, value) in self.gauges.items():
            if value is not None:
                yield GaugeMetricFamily(name, help_text, value=value)
        nodes = list(self.nodes)
        if nodes:
            for name, help_text, key in NODE_GAUGES:
                family = GaugeMetricFamily(name, help_text, labels=["node", "address"])
                for node in nodes:
                    family.add_metric([node.node, node.address], float(getattr(node, key)))
                yield family


class ServerMetrics:
    """One server's metrics: counters the routes update, gauges read at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self._admitted = Counter(
            "harbor_exec_rollouts_admitted", "Rollouts admitted (202).", registry=registry
        )
        self._rejected = Counter(
            "harbor_exec_rollouts_rejected",
            "Rollout submissions refused, by reason.",
            ["reason"],
            registry=registry,
        )
        self._completed = Counter(
            "harbor_exec_rollouts_completed",
            "Rollouts finished, by status and error category.",
            ["status", "err_category"],
            registry=registry,
        )
        self._result_polls = Counter(
            "harbor_exec_result_polls",
            "GET /rollout/{id}/result requests.",
            registry=registry,
        )
        self.rollout_seconds = Histogram(
            "harbor_exec_rollout_duration_seconds",
            "Admission to final result.",
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self._failures = Counter(
            "harbor_exec_rollout_failures",
            "Rollouts that failed, by error category and whose failure it is "
            "(agent, infrastructure, client).",
            ["category", "origin"],
            registry=registry,
        )
        self.rewards = Histogram(
            "harbor_exec_rollout_reward",
            "Rewards of finished rollouts (those whose result carries one).",
            buckets=REWARD_BUCKETS,
            registry=registry,
        )
        self.queued_seconds = Histogram(
            "harbor_exec_rollout_queued_seconds",
            "Admission to running.",
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        # Set by the server before each render (the writer keeps the count).
        self.trajectories_dropped = 0
        self._scrape = _ScrapeTime(self)
        registry.register(self._scrape)
        # labels() validates and locks on every call; a child per key is kept instead.
        self._rejected_by: dict[str, Counter] = {}
        self._completed_by: dict[tuple[str, str], Counter] = {}
        self._failures_by: dict[str, Counter] = {}

    @property
    def admitted(self) -> int:
        return int(self.registry.get_sample_value("harbor_exec_rollouts_admitted_total") or 0)

    def admit(self) -> None:
        self._admitted.inc()

    def poll(self) -> None:
        self._result_polls.inc()

    def reject(self, reason: str) -> None:
        child = self._rejected_by.get(reason)
        if child is None:
            child = self._rejected_by[reason] = self._rejected.labels(reason)
        child.inc()

    def complete(self, status: str, err_category: str | None, seconds: float) -> None:
        key = (status, err_category or "")
        child = self._completed_by.get(key)
        if child is None:
            child = self._completed_by[key] = self._completed.labels(*key)
        child.inc()
        self.rollout_seconds.observe(seconds)
        if status == "failure":
            category = err_category or "internal_error"
            failures = self._failures_by.get(category)
            if failures is None:
                origin = FAILURE_ORIGIN.get(category, "infrastructure")
                failures = self._failures_by[category] = self._failures.labels(category, origin)
            failures.inc()

    def observe_reward(self, reward: float) -> None:
        if math.isfinite(reward):
            self.rewards.observe(reward)

    def render(self, gauges: Gauges, nodes: Iterable[NodeSlots] = ()) -> str:
        """The exposition text: this server's metrics with ``gauges`` (name ->
        (help, value), None skipped) and per-node series for ``nodes`` (``/queue``'s
        entries), then the process-wide ones."""
        self._scrape.gauges = gauges
        self._scrape.nodes = nodes
        try:
            own = generate_latest(self.registry)
        finally:
            self._scrape.gauges = {}
            self._scrape.nodes = ()
        return (own + generate_latest(REGISTRY)).decode()


_PACKAGE_CACHE_PREFIX: Final = "harbor_exec_package_cache_"


def package_cache_figures() -> dict[str, float]:
    """The package caches' figures summed over nodes (``hits``, ``misses``,
    ``requests``, ``stored_bytes``, ``bytes`` by source as ``bytes_cache`` and
    ``bytes_upstream``, ...), from the process-wide metrics."""
    figures: dict[str, float] = {}
    for family in REGISTRY.collect():
        if not family.name.startswith(_PACKAGE_CACHE_PREFIX):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            name = sample.name.removeprefix(_PACKAGE_CACHE_PREFIX).removesuffix("_total")
            source = sample.labels.get("source")
            if source:
                name = f"{name}_{source}"
            figures[name] = figures.get(name, 0.0) + sample.value
    return figures
