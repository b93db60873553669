"""The simulated replica's ``/metrics``, with vLLM's metric names, labels and buckets.

Names, help texts and histogram buckets follow vLLM 0.32 (``vllm/v1/metrics/loggers.py``,
checked against a running CPU replica): labels ``model_name`` and ``engine`` ("0"),
``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` in tokens, and
``vllm:cache_config_info`` as an info gauge whose labels carry ``block_size`` and
``num_gpu_blocks``. Gauges and counters are read from the scheduler when scraped (nothing is
updated per step); histograms are observed per request, in modelled seconds.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from prefix_router.constants import VLLM_LATENCY_BUCKETS, VLLM_TTFT_BUCKETS
from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.scheduler import Scheduler, SimRequest

__all__ = ["EngineMetrics"]

LABELS = ("model_name", "engine")


class _StateCollector(Collector):
    def __init__(self, config: SimConfig, scheduler: Scheduler, metrics: EngineMetrics) -> None:
        self.config = config
        self.scheduler = scheduler
        self.metrics = metrics
        self.labels = [config.model, "0"]

    def collect(self):
        s, kv, labels = self.scheduler, self.scheduler.kv, self.labels

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", len(s.running))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(s.waiting))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv.usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", kv.num_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", kv.num_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.num_prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", s.num_generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=(*LABELS, "finished_reason"))
        for reason, count in sorted(self.metrics.finished.items()):
            success.add_metric([*labels, reason], count)
        yield success
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=("block_size", "enable_prefix_caching", "engine", "num_gpu_blocks",
                                         "prefix_caching_hash_algo", "simulated"))
        info.add_metric([str(self.config.block_size), "True", "0", str(self.config.num_gpu_blocks),
                         "xxhash", "True"], 1.0)
        yield info


class EngineMetrics:
    """vLLM's engine metrics for one simulated replica, in their own registry.

    ``registry`` may be passed in (tests use a fresh one); ``on_first_token`` and
    ``on_finish`` are called by the engine with modelled times already set on the request.
    """

    def __init__(self, config: SimConfig, scheduler: Scheduler, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.finished: dict[str, int] = {}
        labels = [config.model, "0"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, buckets=VLLM_TTFT_BUCKETS, registry=self.registry).labels(*labels)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LABELS, buckets=VLLM_LATENCY_BUCKETS, registry=self.registry).labels(*labels)
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               LABELS, buckets=VLLM_LATENCY_BUCKETS, registry=self.registry).labels(*labels)
        self.registry.register(_StateCollector(config, scheduler, self))

    def on_first_token(self, request: SimRequest) -> None:
        self.ttft.observe(request.first_token_s - request.arrival_s)

    def on_scheduled(self, request: SimRequest, now_s: float) -> None:
        self.queue.observe(now_s - request.arrival_s)

    def on_finish(self, request: SimRequest) -> None:
        reason = request.finish_reason or "length"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if reason != "abort":
            self.e2e.observe(request.finish_s - request.arrival_s)
