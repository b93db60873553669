"""Every metric the gateway exports, in one place, against a registry tests can replace.

Names are the gateway's own (``prefix_router_*``), never the engine's ``vllm:*``. Label values
are bounded: replica names come from the configuration or discovery (the series of a replica
discovery dropped are removed), and ``route``, ``result``, ``cause`` and ``code`` from fixed
sets; no prompt text ever becomes a label.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families

from prefix_router.misses.diagnosis import Cause
from prefix_router.constants import VLLM_LATENCY_BUCKETS, VLLM_TTFT_BUCKETS
from prefix_router.workers import MULTIPROC_ENV

__all__ = ["GatewayMetrics", "METRIC_NAMES", "sample_sum"]

# Seconds; TTFT and request buckets are vLLM's (prefix_router/constants.py).
ROUTING_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1)
# From tens of microseconds (a later turn, its prefix known) to tens of milliseconds (a 32k-token
# first turn's encode), and up to a second for what queues (docs/performance-notes.md).
ANALYSIS_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def _mode(mode: str) -> dict:
    """A gauge's ``multiprocess_mode`` under ``serve --workers N`` (prefix_router/workers.py): how the
    workers' values combine. prometheus-client ignores it in one process."""
    return {"multiprocess_mode": mode} if MULTIPROC_ENV in os.environ else {}


class GatewayMetrics:
    """The gateway's Prometheus metrics (``registry``: a fresh one unless given).

    Under ``serve --workers N`` (``PROMETHEUS_MULTIPROC_DIR`` set) every worker writes its
    values to that directory and ``page`` sums all workers'; gauges combine by their
    ``multiprocess_mode``: in flight and waiting add up over live workers, a replica is healthy
    or its events fresh only if every live worker says so, the rest take the largest.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self._request_metrics(r)
        self._replica_metrics(r)
        self._event_metrics(r)
        self._per_replica = (  # (metric, its label names): what forget_replica clears
            (self.requests, ("replica", "route", "code")), (self.cache_requests, ("replica", "result")),
            (self.prompt_tokens, ("replica",)), (self.cached_predicted, ("replica",)), (self.cached, ("replica",)),
            (self.cached_predicted_offload, ("replica", "medium")),
            (self.lost_tokens, ("replica", "cause")), (self.spillovers, ("from_replica", "to_replica")),
            (self.decode_requests, ("replica", "transfer")),
            (self.queue_depth, ("replica",)), (self.inflight, ("replica",)), (self.healthy, ("replica",)),
            (self.breaker_state, ("replica",)), (self.ttft, ("replica",)), (self.request_seconds, ("replica",)),
            (self.kv_events, ("replica",)), (self.kv_gaps, ("replica", "outcome")),
            (self.kv_parity, ("replica", "result")), (self.kv_view_fresh, ("replica",)),
            (self.kv_view_blocks, ("replica",)))

    def _request_metrics(self, r: CollectorRegistry) -> None:
        """Requests, their cache outcomes, tokens and times."""
        self.requests = Counter("prefix_router_requests", "Requests proxied, by replica, route and HTTP status.",
                                ("replica", "route", "code"), registry=r)
        self.cache_requests = Counter("prefix_router_cache_requests",
                                      "Requests by cache outcome: hit, miss_cold, miss_changed, miss_routed, miss_evicted.",
                                      ("replica", "result"), registry=r)
        self.prompt_tokens = Counter("prefix_router_prompt_tokens", "Prompt tokens sent, by replica.",
                                     ("replica",), registry=r)
        self.cached_predicted = Counter("prefix_router_cached_tokens_predicted",
                                        "Prompt tokens the gateway predicted the replica had cached.",
                                        ("replica",), registry=r)
        self.cached = Counter("prefix_router_cached_tokens", "Cached prompt tokens the engine reported.",
                              ("replica",), registry=r)
        self.cached_predicted_offload = Counter(
            "prefix_router_cached_tokens_predicted_offload",
            "Of the predicted cached prompt tokens, those the replica loads from its offload tier (CPU, STORAGE).",
            ("replica", "medium"), registry=r)
        self.lost_tokens = Counter("prefix_router_lost_tokens",
                                   "Prompt tokens recomputed that could have been reused, by cause.",
                                   ("replica", "cause"), registry=r)
        self.changed = Counter("prefix_router_changed",
                               "Requests whose client changed text it had sent before (miss_changed), by cause: "
                               "volatile_value, tools_changed, key_order, history_rewritten, "
                               "inserted_before_history, other.", ("cause",), registry=r)
        self.changed_lost_tokens = Counter("prefix_router_changed_lost_tokens",
                                           "Prompt tokens recomputed because a client changed its prefix, by cause.",
                                           ("cause",), registry=r)
        for cause in Cause:
            self.changed.labels(cause.value)
            self.changed_lost_tokens.labels(cause.value)
        self.spillovers = Counter("prefix_router_spillovers", "Requests moved off their ring replica by load.",
                                  ("from_replica", "to_replica"), registry=r)
        # a disaggregated fleet's decode legs (serve/disagg.py): transfer is pulled (the prefill's
        # kv_transfer_params handed over), no_params (its answer had none), prefill_failed (no
        # prefill replica served it), decode_retried (a decode attempt failed; the retry computed
        # the prompt), short (no full block to move, or fewer uncached tokens than
        # min_prefill_tokens), whole (not split: n > 1 ...)
        self.decode_requests = Counter("prefix_router_decode_requests",
                                       "Requests sent to a decode replica, by replica and how the prompt's KV came.",
                                       ("replica", "transfer"), registry=r)
        self.routing_seconds = Histogram("prefix_router_routing_seconds",
                                         "Time to choose a replica (tokenization excluded).",
                                         buckets=ROUTING_BUCKETS, registry=r)
        self.analysis_seconds = Histogram("prefix_router_analysis_seconds",
                                          "Time to read the prompt's blocks (chat template, tokenization, block "
                                          "hashes), waiting for a worker thread included.",
                                          buckets=ANALYSIS_BUCKETS, registry=r)
        self.ttft = Histogram("prefix_router_ttft_seconds", "Time to first token seen by the gateway.",
                              ("replica",), buckets=VLLM_TTFT_BUCKETS, registry=r)
        self.request_seconds = Histogram("prefix_router_request_seconds", "Request duration seen by the gateway.",
                                         ("replica",), buckets=VLLM_LATENCY_BUCKETS, registry=r)

    def _replica_metrics(self, r: CollectorRegistry) -> None:
        """Each replica's state as this gateway sees it, and the admission queue."""
        self.queue_depth = Gauge("prefix_router_replica_queue_depth",
                                 "Replica queue depth: vllm:num_requests_waiting at the last scrape plus requests sent since.",
                                 ("replica",), registry=r, **_mode("livemax"))
        self.inflight = Gauge("prefix_router_replica_inflight", "Requests this gateway has in flight on a replica.",
                              ("replica",), registry=r, **_mode("livesum"))
        self.healthy = Gauge("prefix_router_replica_healthy", "1 when the replica passes health checks.",
                             ("replica",), registry=r, **_mode("livemin"))
        self.breaker_state = Gauge("prefix_router_replica_breaker_state",
                                   "Circuit breaker: 0 closed, 1 open (no requests), 2 half-open (one trial).",
                                   ("replica",), registry=r, **_mode("livemax"))
        self.admission_waiting = Gauge("prefix_router_admission_waiting",
                                       "Requests waiting in the gateway's admission queue (every replica saturated).",
                                       registry=r, **_mode("livesum"))
        self.admission_rejected = Counter("prefix_router_admission_rejected",
                                          "Requests refused while every replica was saturated: queue_full (429), timeout (503).",
                                          ("reason",), registry=r)
        for reason in ("queue_full", "timeout"):
            self.admission_rejected.labels(reason)

    def _event_metrics(self, r: CollectorRegistry) -> None:
        """vLLM's KV events (prefix_router/fleet/kv_follower.py): what each replica's engine reported of its cache."""
        self.kv_events = Counter("prefix_router_kv_events", "KV cache events applied, by replica.",
                                 ("replica",), registry=r)
        self.kv_gaps = Counter("prefix_router_kv_event_gaps",
                               "Gaps in a replica's KV event sequence, by outcome (repaired by replay, or lost).",
                               ("replica", "outcome"), registry=r)
        self.kv_parity = Counter("prefix_router_kv_parity",
                                 "Requests whose prompt blocks the engine's events showed (match) or never showed "
                                 "(mismatch: the gateway hashes prompts differently from the engine).",
                                 ("replica", "result"), registry=r)
        self.kv_view_fresh = Gauge("prefix_router_kv_view_fresh",
                                   "1 while routing reads the replica's KV events, 0 while its view is stale and "
                                   "routing falls back to the gateway's guess; absent without events.",
                                   ("replica",), registry=r, **_mode("livemin"))
        self.kv_view_blocks = Gauge("prefix_router_kv_view_blocks", "Blocks the replica's KV events say it holds.",
                                    ("replica",), registry=r, **_mode("livemax"))

    def page(self) -> bytes:
        """The Prometheus text exposition of every metric: this process's, or every worker's
        summed under ``serve --workers N``."""
        if MULTIPROC_ENV not in os.environ:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)

    def counter_samples(self, names: tuple[str, ...]) -> dict[str, list[tuple[dict[str, str], float]]]:
        """Sample name (``..._total``) -> its samples (labels, value), of this process's counters
        or every worker's summed under ``serve --workers N``: the figures of ``page()`` without
        rendering it, which at 256 replicas is over a megabyte of text and took the event loop
        longer than a request's routing by two orders of magnitude (docs/operations.md)."""
        found: dict[str, list] = {name: [] for name in names}
        if MULTIPROC_ENV in os.environ:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            families = registry.collect()
        else:
            counters = [m for m in vars(self).values() if isinstance(m, Counter)
                        and m.describe()[0].name + "_total" in found]
            families = (family for metric in counters for family in metric.collect())
        for family in families:
            for sample in family.samples:
                if sample.name in found:
                    found[sample.name].append((sample.labels, sample.value))
        return found

    def forget_replica(self, name: str) -> int:
        """Remove every series labelled with replica ``name`` (one that discovery dropped), so
        pod churn does not grow the label sets without bound. Returns the series removed."""
        removed = 0
        for metric, labelnames in self._per_replica:
            keys = set()
            for family in metric.collect():
                for sample in family.samples:
                    if any(sample.labels.get(label) == name for label in labelnames if "replica" in label):
                        keys.add(tuple(sample.labels[label] for label in labelnames))
            for key in keys:
                metric.remove(*key)
                removed += 1
        return removed


METRIC_NAMES = (
    "prefix_router_requests_total", "prefix_router_cache_requests_total", "prefix_router_prompt_tokens_total",
    "prefix_router_cached_tokens_predicted_total", "prefix_router_cached_tokens_predicted_offload_total",
    "prefix_router_cached_tokens_total",
    "prefix_router_lost_tokens_total", "prefix_router_changed_total", "prefix_router_changed_lost_tokens_total",
    "prefix_router_spillovers_total", "prefix_router_decode_requests_total", "prefix_router_replica_queue_depth",
    "prefix_router_replica_inflight", "prefix_router_replica_healthy", "prefix_router_replica_breaker_state",
    "prefix_router_admission_waiting", "prefix_router_admission_rejected_total", "prefix_router_routing_seconds",
    "prefix_router_analysis_seconds", "prefix_router_ttft_seconds", "prefix_router_request_seconds",
    "prefix_router_kv_events_total", "prefix_router_kv_event_gaps_total", "prefix_router_kv_parity_total",
    "prefix_router_kv_view_fresh", "prefix_router_kv_view_blocks",
)


def sample_sum(page: str, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` (``..._total`` for counters) whose labels include
    ``labels``, in a Prometheus text page (this gateway's or a replica's ``/metrics``)."""
    total = 0.0
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
